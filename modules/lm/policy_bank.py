"""Language-model players on one frozen base: LoRA adapters (or full copies), the disabled adapter as the reference."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from alignment_games.modules.distributed.sharding import fully_shard_blocks, parameter_gathering, sharded_strategy_kind
from alignment_games.modules.lm.base_identity import base_identity
from alignment_games.modules.lm.decoders import Decoder, make_decoder
from alignment_games.modules.lm.decoding import base_model, cache_arg, prompt_forward
from alignment_games.modules.lm.logprobs import head_inputs, head_token_logprobs
from alignment_games.modules.lm.merged_adapters import MergedAdapters
from alignment_games.modules.lm.micro_batches import micro_batches, row_lengths
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.models import check_exists, resolve_name_or_path
from alignment_games.modules.lm.precision import cast_frozen_parameters, frozen_weights_dtype
from alignment_games.modules.lm.rollout import Rollout
from alignment_games.modules.lm.row_adapters import plain_lora_layers, row_adapters
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.lm.text import pad_sequences, render_chat
from alignment_games.modules.lm.vllm_engine import VLLMEngine


class PolicyBank(nn.Module):
    """The players of a game over one base model (``lm.players``: ``lora`` or ``separate``)."""

    def __init__(self, lm: ModelConfig | dict[str, Any] | str, players: Sequence[str] = ("leader", "follower")) -> None:
        super().__init__()
        self.lm = lm = ModelConfig.coerce(lm)  # the base's origin, recorded beside exports
        self.base_identity = base_identity(lm.name_or_path, lm.revision)  # the frozen base the adapters train on
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
        config = base_model(self.model if self.mode == "lora" else self.reference).config
        # the positions the base was trained on (GPT-2 style configs: n_positions); None: not checked
        self.max_positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        self.share_prompts = not lm.gradient_checkpointing  # a group's rows share the prompt's KV cache
        # set from the strategy (parameter_gathering; a no-op on one device and under DDP); False under sharding
        self.gather_for_generation: Callable[[], AbstractContextManager] = nullcontext
        self.merge_for_generation = True
        self.merged = MergedAdapters()  # each player's merged weights, reused by for_generation while current
        self.decoder: Decoder | VLLMEngine = make_decoder(lm, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id)
        # tokens whose logits token_logprobs forms at once; None: as many as fit LOGIT_CHUNK_BYTES of fp32
        self.logit_chunk_tokens: int | None = None

    def use_strategy(self, strategy: Any) -> None:
        """Fit generation to the trainer's strategy (from ``setup``): one gather per ``generate``."""
        sharded = sharded_strategy_kind(strategy)
        if sharded is not None and isinstance(self.decoder, VLLMEngine):
            raise ValueError(f"lm.decode: vllm loads one process's whole weights, not {sharded}'s shards")
        self.gather_for_generation = parameter_gathering(strategy, self)
        self.merge_for_generation = sharded is None
        if (dtype := frozen_weights_dtype(strategy)) is not None:  # else autocast would recast them every forward
            self._all_players_trainable()
            cast_frozen_parameters(self.model if self.mode == "lora" else self.reference, dtype)

    def shard(self, mesh: Any, mp_policy: Any = None) -> None:
        """FSDP2 over ``mesh``: each decoder block a unit, each causal LM the root (:func:`fully_shard_blocks`).

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
    def using(self, player: str | None) -> Iterator[nn.Module]:
        """The model of ``player`` (its adapter active, or its copy); ``None``: the frozen reference."""
        if self.mode == "separate":
            yield self.reference if player is None else self.models[player]
            return
        if torch.is_grad_enabled():
            self.merged.clear()  # training changes adapters: the merged copies would be remade, so free them now
        if player is None:
            with self.model.disable_adapter():
                yield self.model
        else:
            self.model.set_adapter(player)
            self._all_players_trainable()
            yield self.model
        # peft freezes the inactive adapters, which would cut gradients of a graph built with another player
        self._all_players_trainable()

    def mixes_players(self, players: Sequence[str | None]) -> bool:
        """Whether one :meth:`generate` can decode all ``players``' rows together (plain LoRA over one base)."""
        plain = (p is None or plain_lora_layers(self.model, p, mergeable=False) is not None for p in set(players))
        return self.mode == "lora" and (isinstance(self.decoder, VLLMEngine) or all(plain))  # vllm: a LoRARequest a row

    @contextmanager
    def for_generation(
        self, player: str | None, row_players: list[str | None] | None = None, group: int = 1
    ) -> Iterator[nn.Module]:
        """The player as :meth:`using` gives it, its LoRA update merged into swapped-in weights when allowed.

        The base stays bit-for-bit untouched; the merged weights are kept while current (:class:`MergedAdapters`).
        ``row_players`` (one per prompt of ``group`` rows): each row's own adapter (:func:`row_adapters`).
        """
        if row_players is not None:
            with self.using(None) as model, row_adapters(model, row_players, group):
                yield model
            return
        layers = [] if self.mode == "separate" or player is None else plain_lora_layers(self.model, player)
        if not layers or not self.merge_for_generation:
            with self.using(player) as model:
                yield model
            return
        swapped = []
        merged = self.merged.weights(player, layers)
        with self.using(None) as model:  # adapters disabled: every LoRA layer calls its base layer only
            try:
                for module, weight in zip(layers, merged, strict=True):
                    base = module.get_base_layer()
                    swapped.append((base, base.weight))
                    base.weight = weight
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
        return render_chat(self.tokenizer, messages, add_generation_prompt=True)

    def encode_prompts(self, prompts: Sequence[str]) -> dict[str, Tensor]:
        """``input_ids`` and ``attention_mask`` ``[B, W]`` of the left-padded prompts, cut to ``max_prompt_tokens``."""
        ids, most = self.tokenizer(list(prompts), add_special_tokens=False)["input_ids"], self.max_prompt_tokens
        if cut := sum(len(s) > most for s in ids):
            self.truncated_prompts += cut
            warnings.warn(f"{cut} prompts longer than max_prompt_tokens={most} were cut from the left", stacklevel=3)
            ids = [s[-most:] for s in ids]
        return pad_sequences(ids, self.tokenizer.pad_token_id, left=True)

    @torch.no_grad()
    def generate(
        self,
        player: str | None | Sequence[str | None],
        prompts: Sequence[str],
        num_samples: int,
        sampling: Sampling,
        greedy: bool = False,
    ) -> Rollout:
        """Sample ``num_samples`` completions for each prompt in one batched call (row ``i*num_samples + s``).

        ``player``: one player (``None``: the reference), or one per prompt, each row with its own adapter
        (:meth:`mixes_players`). ``greedy``: arg-max tokens.

        Raises:
            ValueError: for a player list not one per prompt or not decodable together, or a decode past the positions.
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
        ids, mask = (v.to(device) for v in self.encode_prompts(prompts).values())
        sampling.check_fits(ids.shape[1], self.max_positions, self.lm.name_or_path)
        prompt_mask = mask.repeat_interleave(num_samples, dim=0)
        if isinstance(self.decoder, VLLMEngine):
            rows = row_players or [player] * len(prompts)
            out, lps = self.decoder.decode_players(self, rows, ids, mask, num_samples, sampling, greedy)
            return Rollout.from_decode(out, prompt_mask, num_samples, self.tokenizer, sample_logprobs=lps)
        with self.gather_for_generation(), self.for_generation(player, row_players, num_samples) as model:
            was_training = model.training
            out = self.decoder.decode(model.eval(), ids, mask, num_samples, sampling, greedy)
            model.train(was_training)
        return Rollout.from_decode(out, prompt_mask, num_samples, self.tokenizer)

    def generate_each(
        self,
        requests: Sequence[tuple[str | None, Sequence[str]]],
        num_samples: int,
        sampling: Sampling,
        greedy: bool = False,
    ) -> list[Rollout]:
        """:meth:`generate` of each ``(player, prompts)`` request, in one decode split back where :meth:`mixes_players`.

        Raises:
            ValueError: naming a request without prompts.
        """
        requests = [(p, list(x)) for p, x in requests]
        if empty := [(i, p) for i, (p, x) in enumerate(requests) if not x]:
            raise ValueError(f"generate_each: request {empty[0][0]} (player {empty[0][1]!r}) has no prompts")
        players = [p for p, _ in requests]
        if len(requests) < 2 or len(set(players)) < 2 or not self.mixes_players(players):
            return [self.generate(p, x, num_samples, sampling, greedy) for p, x in requests]
        rows = [p for p, x in requests for _ in x]
        out = self.generate(rows, [y for _, x in requests for y in x], num_samples, sampling, greedy)
        return out.split([len(x) for _, x in requests])

    def token_logprobs(
        self, player: str | None, rollout: Rollout, temperature: float = 0.6, micro_batch: int = 0, max_tokens: int = 0
    ) -> Tensor:
        """Per-token ``log softmax(logits / T)`` of the completion tokens, ``[N, C]``, zero outside the completion.

        No ``[N, C, V]`` logits are held; rows run in :func:`micro_batches` chunks (0: no limit), a group's shared
        prompt once. ``player=None``: the reference.
        """
        seq, att, width = rollout.sequences, rollout.attention_mask, rollout.prompt_width
        cmask = rollout.completion_mask.to(seq.device)
        n, c = seq.shape[0], seq.shape[1] - width
        g = rollout.group_size if self.share_prompts and width > 0 and n % max(rollout.group_size, 1) == 0 else 1
        spans, lengths = row_lengths(att, width, cmask)
        pos_all = (att.cumsum(dim=1) - 1).clamp_min(0)  # from the full rows: dropping padding columns keeps them
        out = []
        with self.using(player) as model:
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
                        cache, _ = prompt_forward(model, s[::k], a[::k], p)
                        cache.batch_repeat_interleave(k)
                        kw = {cache_arg(model): cache}
                        model(input_ids=s[:, p:], attention_mask=a, position_ids=pos[:, p:], **kw)
                        first, tail = seen
                        hidden = torch.cat([first.repeat_interleave(k, dim=0), tail[:, :-1]], dim=1)
                    else:
                        # the chunk's last C' + 1 positions: P − 1 … P + C' − 1 predict its C' completion columns
                        model(input_ids=s, attention_mask=a, position_ids=pos, logits_to_keep=cols + 1)
                        hidden = seen[0][:, :-1]
                lp = head_token_logprobs(model, hidden, s[:, p:], temperature, self.logit_chunk_tokens)
                out.append(torch.nn.functional.pad(lp * cmask[i:j, :cols], (0, c - lp.shape[1])))
        return torch.cat(out)

    def logprobs(self, player: str | None, rollout: Rollout, temperature: float = 0.6, micro_batch: int = 0) -> Tensor:
        """Sum of :meth:`token_logprobs` over the completion, ``[N]``."""
        return self.token_logprobs(player, rollout, temperature, micro_batch).sum(dim=1)
