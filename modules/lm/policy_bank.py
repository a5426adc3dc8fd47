"""Language-model players on one frozen base: LoRA adapters per player, the disabled adapter as the reference.

:class:`PolicyBank` batches :meth:`~PolicyBank.generate` (all prompts × samples of a player in one call, or of several
players, each row with its own adapter: :meth:`~PolicyBank.generate_each`) and :meth:`~PolicyBank.logprobs`
(completion tokens only, for a player or the frozen reference with ``player=None``).
With ``players="separate"`` each player is a full trainable copy and one frozen copy serves as the reference.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from alignment_games.modules.distributed.sharding import fully_shard_blocks, parameter_gathering, sharded_strategy_kind
from alignment_games.modules.lm import static_decode
from alignment_games.modules.lm.base_identity import base_identity
from alignment_games.modules.lm.decode_step import LeanDecoder, lean_decode_unsupported
from alignment_games.modules.lm.decoding import (
    _PREFIX,
    GROUPED_ATTENTION,
    _register_grouped_attention,
    grouped_decode_setting,
    next_tokens,
    preallocated_cache,
    prompt_cache,
)
from alignment_games.modules.lm.logprobs import head_inputs, head_token_logprobs
from alignment_games.modules.lm.micro_batches import micro_batches, row_lengths
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.models import check_exists, resolve_name_or_path
from alignment_games.modules.lm.precision import cast_frozen_parameters, frozen_weights_dtype
from alignment_games.modules.lm.rollout import Rollout
from alignment_games.modules.lm.row_adapters import plain_lora_layers, row_adapters

__all__ = ["PolicyBank"]


class PolicyBank(nn.Module):
    """The players of a game over one base model.

    Args:
        lm: Where the causal LM comes from and how it is loaded; ``lm.players`` says how the players are held:
            ``"lora"`` (adapters over one frozen base, loaded in 4 bits with ``lm.load_in_4bit``) or ``"separate"``
            (a trainable copy each + one frozen reference copy).
        players: Player names (e.g. ``["leader", "follower"]``).
    """

    def __init__(self, lm: ModelConfig | dict[str, Any] | str, players: Sequence[str] = ("leader", "follower")) -> None:
        super().__init__()
        lm = ModelConfig.coerce(lm)
        self.lm = lm  # where the base came from: recorded beside exported adapters (modules.checkpoints.export)
        # which frozen base the adapters train on (path, revision, hash of its config and weights' content)
        self.base_identity = base_identity(lm.name_or_path, lm.revision)
        self.mode, self.player_names, self.max_prompt_tokens = lm.players, list(players), lm.max_prompt_tokens
        check_exists("lm.name_or_path", resolve_name_or_path(lm.name_or_path))  # names the field and its config
        self.tokenizer = lm.load_tokenizer(padding_side="left")
        if self.mode == "lora":
            self.model = lm.with_adapters(lm.load_model("causal_lm", frozen=True), self.player_names)
            self._all_players_trainable()  # peft trains only the active adapter: train all players
        else:
            self.models = nn.ModuleDict({p: lm.load_model("causal_lm") for p in self.player_names})
            self.reference = lm.load_model("causal_lm", frozen=True).eval().requires_grad_(False)
        self.truncated_prompts = 0
        # a group's rows share the prompt's KV cache unless activation checkpointing turns the cache off
        self.share_prompts = not lm.gradient_checkpointing
        # set by the LightningModule from its strategy (parameter_gathering); a no-op on one device and under DDP
        self.gather_for_generation: Callable[[], AbstractContextManager] = nullcontext
        self.merge_for_generation = True  # see _for_generation; set False under sharded strategies
        # under lm.decode auto, sampled groups decode with grouped_prefix_attention (each prompt's cache read once per
        # group) on CPU, where copying the prompt cache was a third of generate's time, and with the static cascade
        # elsewhere; True/False (or the environment variable ALIGNMENT_GAMES_GROUPED_DECODE=1/0) forces grouped/generate
        self.grouped_decode: bool | None = grouped_decode_setting()
        # lm.decode: auto / generate / grouped / static (see ModelConfig); lm.compile_decode compiles the static step
        self.decode, self.compile_decode = lm.decode, lm.compile_decode
        # grouped decodes of Llama-family models step through LeanDecoder (the same arithmetic as their forward
        # without its per-token module and cache overhead); False keeps the model's forward
        self.lean_decode = True
        self.static_bucket = 64  # prompt widths padded to a multiple of this in a compiled static decode
        self._static_caches: dict[int, Any] | None = None  # kept between calls only when compiled (fixed addresses)
        self._compiled_step: Callable | None = None
        # tokens whose logits are formed at once by token_logprobs; None: as many as fit LOGIT_CHUNK_BYTES of fp32
        self.logit_chunk_tokens: int | None = None

    def use_strategy(self, strategy: Any) -> None:
        """Fit generation to the trainer's strategy (call from the LightningModule's ``setup``).

        Sharded strategies gather the parameters once per ``generate`` call and keep the adapters unmerged.
        """
        self.gather_for_generation = parameter_gathering(strategy, self)
        self.merge_for_generation = sharded_strategy_kind(strategy) is None
        dtype = frozen_weights_dtype(strategy)
        if dtype is not None:
            self.cast_frozen(dtype)

    def cast_frozen(self, dtype: torch.dtype) -> int:
        """Hold the frozen weights (the base under the adapters, the reference copy) in ``dtype``; return how many.

        Under Lightning's ``bf16-mixed`` (``use_strategy`` calls this) autocast would cast frozen fp32 weights again
        at every forward and every decoded token, since it caches casts of trainable weights only. Adapters and
        trainable copies keep their dtype (fp32), and so do their optimizer moments.
        """
        self._all_players_trainable()
        frozen = self.model if self.mode == "lora" else self.reference
        return cast_frozen_parameters(frozen, dtype)

    def shard(self, mesh: Any, mp_policy: Any = None) -> None:
        """FSDP2 (``fully_shard``) over ``mesh``: each decoder block a unit, then each causal LM the root unit.

        The blocks are the architecture's ``_no_split_modules`` (see :func:`fully_shard_blocks`). In LoRA mode the one
        base model is sharded, in separate mode every copy and the reference; idempotent. A sharded bank never swaps
        merged weights in for generation (FSDP2 owns the parameters). ``mp_policy``: FSDP2's ``MixedPrecisionPolicy``.

        Raises:
            ValueError: for an architecture without ``_no_split_modules`` (its blocks cannot be found by name).
        """
        models = [self.model.get_base_model()] if self.mode == "lora" else [*self.models.values(), self.reference]
        for lm in models:
            fully_shard_blocks(lm, mesh, mp_policy)
        self.merge_for_generation = False

    def player_parameters(self, player: str) -> list[nn.Parameter]:
        """The trainable parameters of one player (its adapter, or its copy)."""
        if player not in self.player_names:
            raise KeyError(f"unknown player {player!r}; players: {self.player_names}")
        if self.mode == "separate":
            return list(self.models[player].parameters())
        return [p for n, p in self.model.named_parameters() if f".{player}." in n]

    @contextmanager
    def _use(self, player: str | None) -> Iterator[nn.Module]:
        if self.mode == "separate":
            yield self.reference if player is None else self.models[player]
            return
        if player is None:
            with self.model.disable_adapter():
                yield self.model
        else:
            self.model.set_adapter(player)
            self._all_players_trainable()
            yield self.model
        # peft's set_adapter / disable_adapter freeze the inactive adapters; a graph built earlier with another
        # player would then lose its gradients at backward time, so every player is made trainable again.
        self._all_players_trainable()

    def mixes_players(self, players: Sequence[str | None]) -> bool:
        """Whether one :meth:`generate` can decode rows of all ``players`` together, each with its own adapter.

        True for adapters over one base (``lm.players: lora``) whose LoRA layers are plain (see
        :func:`~modules.lm.row_adapters.plain_lora_layers`); ``None`` is the frozen reference.
        """
        if self.mode != "lora":
            return False
        return all(p is None or plain_lora_layers(self.model, p) is not None for p in set(players))

    @contextmanager
    def _for_generation(
        self, player: str | None, row_players: list[str | None] | None = None, group: int = 1
    ) -> Iterator[nn.Module]:
        """The player as :meth:`_use` gives it, with its LoRA update merged into fresh weights when allowed.

        ``W + s·BA`` computed once per ``generate`` call makes the adapter free per token. The merged weights are new
        tensors swapped in and the originals put back, so the frozen base is bit-for-bit untouched (an in-place merge
        and unmerge would not be). Off under sharded strategies (``merge_for_generation``).

        ``row_players`` (one per prompt, each prompt's ``group`` rows following it): the base with adapters disabled,
        and each row's own adapter added to its rows by :func:`~modules.lm.row_adapters.row_adapters` (one decode of
        several players).
        """
        if row_players is not None:
            with self._use(None) as model, row_adapters(model, row_players, group):
                yield model
            return
        layers = [] if self.mode == "separate" or player is None else plain_lora_layers(self.model, player)
        if not layers or not self.merge_for_generation:
            with self._use(player) as model:
                yield model
            return
        swapped = []
        with self._use(None) as model:  # adapters disabled: every LoRA layer calls its base layer only
            try:
                with torch.no_grad():
                    for module in layers:
                        base = module.get_base_layer()
                        original = base.weight
                        merged = original + module.get_delta_weight(player).to(original.dtype)
                        base.weight = nn.Parameter(merged, requires_grad=False)
                        swapped.append((base, original))
                yield model
            finally:
                for base, original in swapped:
                    base.weight = original

    def _all_players_trainable(self) -> None:
        for name, p in self.model.named_parameters():
            if any(f".{q}." in name for q in self.player_names):
                p.requires_grad_(True)

    def chat(self, system: str | None, user: str) -> str:
        """Render one conversation turn with the tokenizer's chat template, ready for the assistant's reply."""
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "

    def _encode_prompts(self, prompts: Sequence[str]) -> dict[str, Tensor]:
        enc = self.tokenizer(list(prompts), add_special_tokens=False)
        ids = enc["input_ids"]
        cut = [i for i, s in enumerate(ids) if len(s) > self.max_prompt_tokens]
        if cut:
            self.truncated_prompts += len(cut)
            warnings.warn(
                f"{len(cut)} prompts longer than max_prompt_tokens={self.max_prompt_tokens} were cut from the left",
                stacklevel=3,
            )
            ids = [s[-self.max_prompt_tokens :] for s in ids]
        width = max(len(s) for s in ids)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, s in enumerate(ids):
            if s:
                input_ids[i, width - len(s) :] = torch.tensor(s)
                mask[i, width - len(s) :] = 1
        return {"input_ids": input_ids, "attention_mask": mask}

    @torch.no_grad()
    def generate(
        self,
        player: str | None | Sequence[str | None],
        prompts: Sequence[str],
        num_samples: int,
        temperature: float = 0.6,
        top_p: float = 1.0,
        max_new_tokens: int = 128,
        do_sample: bool = True,
        min_new_tokens: int = 0,
    ) -> Rollout:
        """Sample ``num_samples`` completions for each prompt in one batched call (row ``i*num_samples + s``).

        ``player`` is one player (``None``: the frozen reference), or one per prompt: then the prompts of several
        players decode together, each row with its own player's adapter (see :meth:`mixes_players`;
        :meth:`generate_each` splits such a decode back per player). ``min_new_tokens`` > 0 suppresses EOS until that
        many tokens are written (benchmarks use it to fix the work per step).

        Raises:
            ValueError: for a player list whose length is not the prompts', or players this bank cannot decode
                together.
            KeyError: naming an unknown player of the list.
        """
        row_players = None
        if player is not None and not isinstance(player, str):
            row_players = list(player)
            if len(row_players) != len(prompts):
                raise ValueError(f"generate: {len(row_players)} players for {len(prompts)} prompts (one per prompt)")
            for i, p in enumerate(row_players):
                if p is not None and p not in self.player_names:
                    raise KeyError(f"generate: unknown player {p!r} of prompt {i}; players: {self.player_names}")
            if len(set(row_players)) == 1:
                player, row_players = row_players[0], None  # one player: its merged-adapter decode
            elif not self.mixes_players(row_players):
                raise ValueError(
                    f"generate: players {sorted(set(row_players), key=str)} cannot decode in one batch (lm.players "
                    f"{self.mode!r}, or LoRA layers other than plain LoRA on nn.Linear); use generate_each"
                )
        device = next(self.parameters()).device
        once = {k: v.to(device) for k, v in self._encode_prompts(prompts).items()}
        enc = {k: v.repeat_interleave(num_samples, dim=0) for k, v in once.items()}
        eos = self.tokenizer.eos_token_id
        with self.gather_for_generation(), self._for_generation(player, row_players, num_samples) as model:
            was_training = model.training
            model.eval()
            mode = self._decode_mode(model, num_samples, once["input_ids"].shape[1])
            if mode != "generate":
                decode = self._decode_static if mode == "static" else self._decode_grouped
                out = decode(model, once, num_samples, temperature, top_p, max_new_tokens, do_sample, min_new_tokens)
            else:
                extra = {}
                if num_samples > 1 and self.share_prompts and once["input_ids"].shape[1] > 1:
                    # prefill each prompt once (all but its last token) and copy the cache to the prompt's samples
                    ids, mask = once["input_ids"], once["attention_mask"]
                    cache, _ = self._prompt_forward(model, ids, mask, ids.shape[1] - 1)
                    cache.batch_repeat_interleave(num_samples)
                    extra[self._cache_arg(model)] = cache
                out = model.generate(
                    **enc,
                    **extra,
                    do_sample=do_sample,
                    temperature=temperature if do_sample else None,
                    top_p=top_p if do_sample else None,
                    top_k=0 if do_sample else None,
                    max_new_tokens=max_new_tokens,
                    min_new_tokens=min_new_tokens or None,
                    pad_token_id=self.tokenizer.pad_token_id,
                    eos_token_id=eos,
                )
            model.train(was_training)
        width = enc["input_ids"].shape[1]
        completion = out[:, width:]
        is_eos = completion == eos
        # keep tokens up to and including the first EOS (generating EOS is an action too)
        after_first_eos = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
        # pads only follow a finished row's EOS; a pad token sampled mid-reply is an action like any other
        completion_mask = (~after_first_eos).long()
        texts = self.tokenizer.batch_decode(completion * completion_mask, skip_special_tokens=True)
        attention = torch.cat([enc["attention_mask"], completion_mask], dim=1)
        return Rollout(out, attention, width, completion_mask, texts, group_size=num_samples)

    def generate_each(
        self, requests: Sequence[tuple[str | None, Sequence[str]]], num_samples: int, **kwargs: Any
    ) -> list[Rollout]:
        """:meth:`generate` of each ``(player, prompts)`` request, the requests decoded in one batch where possible.

        Where :meth:`mixes_players` allows, all requests' prompts go through one decode, each row with its own
        player's adapter, and the result is split back per request (:meth:`Rollout.split`): with greedy decoding each
        rollout equals its own :meth:`generate` token for token (up to float rounding of the unmerged adapters); with
        sampling the draws come from the same global generator in one batch. Otherwise one :meth:`generate` per
        request. ``kwargs`` are :meth:`generate`'s.

        Raises:
            ValueError: naming a request without prompts.
        """
        requests = [(p, list(x)) for p, x in requests]
        for i, (p, x) in enumerate(requests):
            if not x:
                raise ValueError(f"generate_each: request {i} (player {p!r}) has no prompts")
        players = [p for p, _ in requests]
        if len(requests) < 2 or len(set(players)) < 2 or not self.mixes_players(players):
            return [self.generate(p, x, num_samples, **kwargs) for p, x in requests]
        rows = [p for p, x in requests for _ in x]
        out = self.generate(rows, [y for _, x in requests for y in x], num_samples, **kwargs)
        return out.split([len(x) for _, x in requests])

    def _cache_arg(self, model: nn.Module) -> str:
        """Name of the KV-cache argument and output: ``cache`` in recent transformers, else ``past_key_values``."""
        if not hasattr(self, "_cache_name"):
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            params = inspect.signature(type(base).forward).parameters
            self._cache_name = "cache" if "cache" in params else "past_key_values"
        return self._cache_name

    def _decode_mode(self, model: nn.Module, num_samples: int, width: int) -> str:
        """Which decode runs: ``generate``, ``grouped`` or ``static`` (see ``ModelConfig.decode``).

        ``auto``: ``grouped_decode`` (True: grouped, False: generate) where it is set, else grouped on CPU and static
        elsewhere. Grouped needs sampled groups (G > 1) unless :class:`LeanDecoder` steps it (``lean_decode`` and a
        model it serves); both cascades a prompt cache (``share_prompts``, prompts wider than one token) and an
        attention backend they can stand in for; otherwise ``generate`` runs.
        """
        mode = self.decode
        if mode == "auto":
            if self.grouped_decode is not None:
                mode = "grouped" if self.grouped_decode else "generate"
            else:
                mode = "grouped" if next(self.parameters()).device.type == "cpu" else "static"
        lean = self._lean_ok(model)  # LeanDecoder serves G = 1 as well
        if (
            mode == "generate"
            or not self.share_prompts
            or width < 2
            or (mode == "grouped" and num_samples < 2 and not lean)
        ):
            return "generate"
        return mode if self._cascade_ok(model) else "generate"

    def _lean_ok(self, model: nn.Module) -> bool:
        """Whether :class:`LeanDecoder` steps this decode.

        It needs ``lean_decode``, no sharded strategy (it reads weights outside any gathering hook) and a model it
        repeats exactly.
        """
        return self.lean_decode and self.merge_for_generation and lean_decode_unsupported(model) is None

    def _grouped_ok(self, model: nn.Module) -> bool:
        """Whether sampled groups decode with :func:`grouped_prefix_attention` (see ``grouped_decode``)."""
        wanted = self.grouped_decode
        if wanted is None:
            wanted = next(self.parameters()).device.type == "cpu"
        return bool(wanted) and self._cascade_ok(model)

    def _cascade_ok(self, model: nn.Module) -> bool:
        """Whether ``model`` can run a cascade attention: transformers' attention interface on sdpa or eager."""
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        # models whose attention goes through transformers' AttentionInterface, on a plain (sdpa/eager) backend
        if not getattr(base, "_supports_attention_backend", False):
            return False
        if getattr(base.config, "_attn_implementation", None) not in ("sdpa", "eager"):
            return False
        return _register_grouped_attention()

    def _decode_grouped(
        self,
        model: nn.Module,
        once: dict[str, Tensor],
        g: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        do_sample: bool,
        min_new_tokens: int,
    ) -> Tensor:
        """Sample ``g`` continuations per prompt with the prompt's cache held once (``[prompt | completion]`` rows).

        The decode loop runs the B·G rows over one prefilled copy of each prompt: stepped by :class:`LeanDecoder`
        where it serves the model (``lean_decode``), else through the model's forward with
        :func:`grouped_prefix_attention`; sampling is ``generate``'s (same draws from the global generator, in the
        same order).
        """
        ids, mask = once["input_ids"], once["attention_mask"]
        width = ids.shape[1]
        cache, prompt_mask = prompt_cache(model, ids, mask, self._cache_arg(model))
        if self._lean_ok(model):
            decoder = LeanDecoder(model, cache, prompt_mask, g, max_new_tokens)
            del cache

            def lean_step(token: Tensor, position: Tensor, step: int) -> Tensor:
                return decoder.step(token, position)

            return self._sample(lean_step, ids, mask, g, temperature, top_p, max_new_tokens, do_sample, min_new_tokens)
        pad_mask = torch.zeros(mask.shape[0], 1, width - 1, device=ids.device)  # float32, added to float32 scores
        pad_mask = pad_mask.masked_fill(prompt_mask[:, None] == 0, float("-inf"))
        prefix = {i: (layer.keys, layer.values, pad_mask) for i, layer in enumerate(cache.layers)}
        own = preallocated_cache(max_new_tokens)  # the prompt's last token, then every token but the last written
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        previous = base.config._attn_implementation
        _PREFIX.clear()
        _PREFIX.update(prefix)
        base.config._attn_implementation = GROUPED_ATTENTION

        def step_logits(token: Tensor, position: Tensor, step: int) -> Tensor:
            out = model(input_ids=token, position_ids=position, use_cache=True, **{self._cache_arg(model): own})
            return out.logits[:, -1, :]

        try:
            return self._sample(
                step_logits, ids, mask, g, temperature, top_p, max_new_tokens, do_sample, min_new_tokens
            )
        finally:
            base.config._attn_implementation = previous
            _PREFIX.clear()

    def _decode_static(
        self,
        model: nn.Module,
        once: dict[str, Tensor],
        g: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        do_sample: bool,
        min_new_tokens: int,
    ) -> Tensor:
        """:meth:`_decode_grouped` over caches allocated once at full length (:mod:`modules.lm.static_decode`).

        Each prompt's cache is held once for its ``g`` rows (never copied to them), the rows' own keys go to
        ``max_new_tokens`` preallocated slots, and every step has the same shapes, so with ``compile_decode`` the step
        runs under ``torch.compile`` (CUDA graphs on CUDA). Sampling is ``generate``'s, draw for draw.
        """
        ids, mask = once["input_ids"], once["attention_mask"]
        prompt, prompt_mask = prompt_cache(model, ids, mask, self._cache_arg(model))
        compiled = self.compile_decode
        caches = static_decode.build_caches(
            prompt,
            prompt_mask,
            g,
            max_new_tokens,
            self.static_bucket if compiled else 1,
            reuse=self._static_caches if compiled else None,
        )
        del prompt
        step_fn = static_decode.step_logits
        if compiled:
            if caches is not self._static_caches:
                static_decode.mark_static(caches)
                self._static_caches = caches
            if self._compiled_step is None:
                self._compiled_step = static_decode.compiled_step(ids.device)
            step_fn = self._compiled_step
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        previous = base.config._attn_implementation
        static_decode.register_static_attention()
        static_decode._STATE.clear()
        static_decode._STATE.update(caches)
        base.config._attn_implementation = static_decode.STATIC_ATTENTION
        step_slot = caches[0].step

        def step_logits(token: Tensor, position: Tensor, step: int) -> Tensor:
            step_slot.fill_(step)
            return step_fn(model, token, position)

        try:
            return self._sample(
                step_logits, ids, mask, g, temperature, top_p, max_new_tokens, do_sample, min_new_tokens
            )
        finally:
            base.config._attn_implementation = previous
            static_decode._STATE.clear()

    def _sample(
        self,
        step_logits: Callable[[Tensor, Tensor, int], Tensor],
        ids: Tensor,
        mask: Tensor,
        g: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        do_sample: bool,
        min_new_tokens: int,
    ) -> Tensor:
        """The cascaded decodes' loop: ``[prompt | completion]`` rows, ``g`` per prompt, until every row ends.

        ``step_logits(token, position, step)`` gives each row's next-token logits ``[B·G, V]``; sampling is
        ``generate``'s (the same draws from the global generator, in the same order); a row that wrote EOS is padded.
        """
        rows = ids.repeat_interleave(g, dim=0)
        position = mask.repeat_interleave(g, dim=0).sum(dim=1, keepdim=True) - 1
        token = rows[:, -1:].contiguous()  # the strides of every later step's token (no recompile when compiled)
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        unfinished = torch.ones(rows.shape[0], dtype=torch.bool, device=ids.device)
        new: list[Tensor] = []
        for step in range(max_new_tokens):
            nxt = next_tokens(
                step_logits(token, position, step), step, min_new_tokens, eos, do_sample, temperature, top_p
            )
            nxt = torch.where(unfinished, nxt, torch.full_like(nxt, pad))
            new.append(nxt)
            if eos is not None:
                unfinished &= nxt != eos
            if not bool(unfinished.any()):
                break
            token, position = nxt[:, None], position + 1
        return torch.cat([rows, torch.stack(new, dim=1)], dim=1)

    def _prompt_forward(self, model: nn.Module, ids: Tensor, mask: Tensor, end: int) -> tuple[Any, Tensor]:
        """KV cache of ``ids[:, :end]`` and the last position's logits ``[rows, 1, V]`` (positions from the mask)."""
        pos = (mask.cumsum(dim=1) - 1).clamp_min(0)
        out = model(
            input_ids=ids[:, :end],
            attention_mask=mask[:, :end],
            position_ids=pos[:, :end],
            use_cache=True,
            logits_to_keep=1,
        )
        return getattr(out, self._cache_arg(model)), out.logits

    def token_logprobs(
        self, player: str | None, rollout: Rollout, temperature: float = 0.6, micro_batch: int = 0, max_tokens: int = 0
    ) -> Tensor:
        """Per-token ``log softmax(logits / T)`` of the completion tokens, ``[N, C]``, zero outside the completion.

        No ``[N, C, V]`` logits are held: the model runs to its final hidden states and the completion's logits are
        formed ``logit_chunk_tokens`` at a time, recomputed in the backward (:mod:`modules.lm.logprobs`). Rows run in
        the chunks of :func:`~modules.lm.micro_batches.micro_batches` (at most ``micro_batch`` rows and ``max_tokens``
        padded tokens; 0: no limit), a group sharing one prompt (G > 1) running it once. A chunk runs only the columns
        its rows use (from its longest prompt to its longest completion); exact, since positions come from each full
        row's mask. Gradients flow unless under ``no_grad``; ``player=None`` is the frozen reference.
        """
        seq, att, width = rollout.sequences, rollout.attention_mask, rollout.prompt_width
        cmask = rollout.completion_mask.to(seq.device)
        n, c = seq.shape[0], seq.shape[1] - width
        g = rollout.group_size if self.share_prompts and width > 0 and n % max(rollout.group_size, 1) == 0 else 1
        spans, lengths = row_lengths(att, width, cmask)
        pos_all = (att.cumsum(dim=1) - 1).clamp_min(0)  # from the full rows: dropping padding columns keeps them
        out = []
        with self._use(player) as model:
            for i, j in micro_batches(spans, lengths, max_tokens, micro_batch, g):
                # the chunk's columns: from its longest prompt (at least one prompt column, which predicts the first
                # completion token) to its longest completion; the others are padding in every row of it
                start = max(0, min(width - max(spans[i:j]), width - 1))
                cols, p = max(max(lengths[i:j]), 1), width - start
                s, a, pos = (x[i:j, start : width + cols] for x in (seq, att, pos_all))
                k = g if i % g == 0 and (j - i) % g == 0 else 1  # whole groups (a group over the budget is cut)
                with head_inputs(model) as seen:
                    if k > 1:
                        # the prompt once per group: its cache and the state predicting the first completion token
                        cache, _ = self._prompt_forward(model, s[::k], a[::k], p)
                        cache.batch_repeat_interleave(k)
                        kw = {self._cache_arg(model): cache}
                        model(input_ids=s[:, p:], attention_mask=a, position_ids=pos[:, p:], **kw)
                        first, tail = seen
                        hidden = torch.cat([first.repeat_interleave(k, dim=0), tail[:, :-1]], dim=1)
                    else:
                        # the chunk's last C' + 1 positions: P − 1 … P + C' − 1 predict its C' completion columns
                        model(input_ids=s, attention_mask=a, position_ids=pos, logits_to_keep=cols + 1)
                        hidden = seen[0][:, :-1]
                lp = head_token_logprobs(model, hidden, s[:, p:], temperature, self.logit_chunk_tokens)
                lp = lp * cmask[i:j, :cols]
                out.append(torch.nn.functional.pad(lp, (0, c - lp.shape[1])))
        return torch.cat(out)

    def logprobs(self, player: str | None, rollout: Rollout, temperature: float = 0.6, micro_batch: int = 0) -> Tensor:
        """Sum of :meth:`token_logprobs` over the completion, ``[N]``."""
        return self.token_logprobs(player, rollout, temperature, micro_batch).sum(dim=1)
