"""Language-model players on one frozen base: LoRA adapters per player, the disabled adapter as the reference.

:class:`PolicyBank` owns the models and does the two things every game needs, batched:

* :meth:`PolicyBank.generate`: one ``generate`` call per player per step for all prompts × samples (left padding,
  KV cache), returning a :class:`Rollout` whose token layout is ``[left-padded prompt | completion | right pad]``;
* :meth:`PolicyBank.logprobs`: the sum of log-probabilities of the completion tokens only (at the sampling
  temperature), for a player (with gradients) or the frozen reference (``player=None``: adapters disabled).

With ``players="separate"`` each player is a full trainable copy and one frozen copy serves as the reference.
"""

from __future__ import annotations

import inspect
import os
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from modules.models import apply_lora, load_model, load_tokenizer

__all__ = [
    "PolicyBank",
    "Rollout",
    "engine_grad_norm",
    "fill_template",
    "fit_manual_backward_strategy",
    "fsdp2_gradient_sync",
    "fully_shard_blocks",
    "grouped_prefix_attention",
    "parameter_gathering",
    "sharded_strategy_kind",
    "shard_for_strategy",
]

GROUPED_ATTENTION = "alignment_games_grouped_prefix"
# layer index -> (prompt keys [B, KV, P, D], prompt values, additive prompt-padding mask [B, 1, P]) of the one decode
# running with grouped_prefix_attention (set and cleared by PolicyBank._grouped_prefix)
_PREFIX: dict[int, tuple[Tensor, Tensor, Tensor]] = {}


def grouped_prefix_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Attention of G samples per prompt that reads each prompt's keys and values once (cascade attention).

    The rows ``b*G … b*G + G - 1`` continue prompt ``b``. Their prompt part lives once per prompt in ``_PREFIX``
    (``[B, KV, P, D]``), their own tokens in the cache (``key``/``value``: ``[B·G, KV, t, D]``). The scores against
    both parts share one softmax (a common maximum, one denominator), so the result equals attention over the
    prompt's cache copied to every row, as :meth:`PolicyBank.generate` did before, up to float rounding, while the
    prompt's keys are read once per group instead of G times, and grouped-query heads are never copied. Queries
    after the first (``q > 1``) are causal within the row's own tokens. Registered with transformers'
    ``AttentionInterface``; ``attention_mask`` is ignored (the prompt's padding is in ``_PREFIX``, the own tokens
    are never padding while decoding).
    """
    keys, values, pad = _PREFIX[module.layer_idx]
    n, h, q, d = query.shape
    b, kvh, p, _ = keys.shape
    g, rep = n // b, h // kvh
    scale = scaling if scaling is not None else d**-0.5
    # prompt part: the G rows of a prompt become G·rep query rows of one [B, KV] head, against one copy of its keys
    qp = query.reshape(b, g, kvh, rep * q, d).transpose(1, 2).reshape(b, kvh, g * rep * q, d)
    # scores, softmax and sums in float32 (as SDPA does for half precision); the matmuls in the model's dtype
    sp = (qp @ keys.transpose(-1, -2)).float() * scale + pad.float().unsqueeze(1)
    sp = sp.reshape(b, kvh, g, rep * q, p).transpose(1, 2).reshape(n, kvh, rep * q, p)
    # own part, per row
    ss = (query.reshape(n, kvh, rep * q, d) @ key.transpose(-1, -2)).float() * scale
    if q > 1:
        t = key.shape[2]
        causal = torch.ones(q, t, dtype=torch.bool, device=query.device).tril(t - q)
        ss = ss.reshape(n, kvh, rep, q, t).masked_fill(~causal, float("-inf")).reshape(n, kvh, rep * q, t)
    top = torch.maximum(sp.amax(-1, keepdim=True), ss.amax(-1, keepdim=True))
    ep, es = (sp - top).exp(), (ss - top).exp()
    denom = ep.sum(-1, keepdim=True) + es.sum(-1, keepdim=True)
    ep = ep.reshape(b, g, kvh, rep * q, p).transpose(1, 2).reshape(b, kvh, g * rep * q, p)
    op = (ep.to(values.dtype) @ values).reshape(b, kvh, g, rep * q, d).transpose(1, 2).reshape(n, kvh, rep * q, d)
    out = ((op.float() + (es.to(value.dtype) @ value).float()) / denom).to(query.dtype)
    return out.reshape(n, h, q, d).transpose(1, 2).contiguous(), None


GROUPED_DECODE_ENV = "ALIGNMENT_GAMES_GROUPED_DECODE"


def grouped_decode_setting() -> bool | None:
    """``PolicyBank.grouped_decode`` from the environment variable ``ALIGNMENT_GAMES_GROUPED_DECODE``.

    Unset or ``auto`` → None (CPU only), ``1``/``true``/``on`` → True, ``0``/``false``/``off`` → False.

    Raises:
        ValueError: naming the variable, for any other value.
    """
    raw = os.environ.get(GROUPED_DECODE_ENV, "auto").strip().lower()
    values = {"auto": None, "": None, "1": True, "true": True, "on": True, "0": False, "false": False, "off": False}
    if raw not in values:
        raise ValueError(f"{GROUPED_DECODE_ENV} must be one of 1, 0, true, false, on, off or auto, got {raw!r}")
    return values[raw]


def _register_grouped_attention() -> bool:
    """Register :func:`grouped_prefix_attention` (and a no-op mask) with transformers; False where unsupported."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        return False
    AttentionInterface.register(GROUPED_ATTENTION, grouped_prefix_attention)
    AttentionMaskInterface.register(GROUPED_ATTENTION, lambda *args, **kwargs: None)
    return True


_FIELD = re.compile(r"\{(prompt|leader_response)\}")


def fill_template(template: str, **values: str) -> str:
    """Replace ``{prompt}`` / ``{leader_response}`` in one pass over the template; data text is never re-read."""
    return _FIELD.sub(lambda m: values.get(m.group(1), m.group(0)), template)


def sharded_strategy_kind(strategy: Any) -> str | None:
    """The sharded strategy ``strategy`` is (a subclass of), by its base's name, else None.

    ``"DeepSpeedStrategy"``, ``"FSDPStrategy"`` (FSDP1) or ``"ModelParallelStrategy"`` (FSDP2 ``fully_shard``,
    e.g. :class:`modules.strategies.FSDP2Strategy`). Read from the class hierarchy's names, so neither DeepSpeed nor
    FSDP is imported where it is not used, and a user's subclass (e.g. with its own launcher or checks) is treated as
    the strategy it extends.
    """
    names = {cls.__name__ for cls in type(strategy).__mro__}
    return next((k for k in ("DeepSpeedStrategy", "FSDPStrategy", "ModelParallelStrategy") if k in names), None)


def shard_for_strategy(module: Any, bank: PolicyBank | nn.Module, family: str) -> None:
    """FSDP2: shard ``bank`` over the data-parallel mesh when the trainer's strategy gives the module one.

    ``bank`` is a :class:`PolicyBank` (:meth:`PolicyBank.shard`) or a transformers model (:func:`fully_shard_blocks`).
    Call from the LightningModule's ``configure_model`` (Lightning's ``ModelParallelStrategy`` calls it after the
    processes start and before the optimizers are made, and gives the module its ``device_mesh``). Elsewhere (no
    mesh) it does nothing. Only the policy is sharded; frozen scorers (reward models, judges, preference ensembles)
    stay whole on every rank. The strategy's ``mixed_precision_policy`` (:class:`modules.strategies.FSDP2Strategy`'s
    ``param_dtype`` / ``reduce_dtype``), if any, goes to every unit.

    Raises:
        ValueError: naming ``trainer.strategy``, for a mesh with tensor parallelism (the families shard by FSDP
            only; :class:`modules.strategies.FSDP2Strategy` puts every process in the data-parallel dimension).
    """
    mesh = getattr(module, "_device_mesh", None)
    if mesh is None:
        return
    if "tensor_parallel" in (mesh.mesh_dim_names or ()) and mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            f"trainer.strategy: {family} shards its policy with FSDP2 over the data-parallel dimension only, got a "
            f"tensor-parallel size of {mesh['tensor_parallel'].size()}; use modules.strategies.FSDP2Strategy "
            "(configs/overlays/fsdp2.yaml) or ModelParallelStrategy(tensor_parallel_size=1)"
        )
    dp = mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh
    trainer = getattr(module, "_trainer", None)
    policy = getattr(getattr(trainer, "strategy", None), "mixed_precision_policy", None)
    if isinstance(bank, PolicyBank):
        bank.shard(dp, policy)
    else:
        fully_shard_blocks(bank, dp, policy)


def fit_manual_backward_strategy(strategy: Any, family: str, grad_clip: float | None) -> None:
    """Fit a family that runs its backward passes inside ``training_step`` (manual optimization) to the strategy.

    Call from the LightningModule's ``setup("fit")``, before the strategy wraps the model.

    * FSDP (Lightning's ``FSDPStrategy``, FSDP1) is refused. Lightning runs ``training_step`` inside the root FSDP
      unit's forward, so every backward runs before that forward ends. With the whole model in the root unit, FSDP's
      backward hook asserts (``Expects BACKWARD_PRE or BACKWARD_POST state but got FORWARD``); with the decoder
      layers wrapped as inner units the steps run, but FSDP's end-of-backward callback (queued from the root's
      outputs) never runs, and the next state-dict gather (the checkpoint) asserts on a handle left in
      ``BACKWARD_POST``. Both reproduced on two CPU processes. FSDP2 (:class:`modules.strategies.FSDP2Strategy`, a
      ``ModelParallelStrategy``) shards the submodules in ``configure_model`` instead and runs ``training_step`` outside
      any forward: the families take it (:func:`shard_for_strategy`).
    * DeepSpeed: ``grad_clip`` becomes the engine's ``gradient_clipping``. The engine keeps the gradients in its own
      partitions and clips them by their global norm in ``step``, so a clip of ``p.grad`` in the module would see no
      gradients (and Lightning's ``clip_gradients`` is a no-op under DeepSpeed).

    Raises:
        ValueError: naming ``trainer.strategy``, under FSDP.
    """
    kind = sharded_strategy_kind(strategy)
    if kind == "FSDPStrategy":
        raise ValueError(
            f"trainer.strategy: {family} runs its backward passes inside training_step (manual optimization), which "
            f"Lightning's FSDP strategy cannot take (got {type(strategy).__name__}): FSDP's backward hooks expect "
            "the root unit's forward to have ended. Use FSDP2 (configs/overlays/fsdp2.yaml), DeepSpeed ZeRO-3 "
            "(configs/overlays/deepspeed_zero3.yaml) or DDP (configs/overlays/ddp.yaml)"
        )
    if kind == "DeepSpeedStrategy" and grad_clip is not None:
        config = getattr(strategy, "config", None)
        if isinstance(config, dict):
            config["gradient_clipping"] = float(grad_clip)


def engine_grad_norm(strategy: Any) -> float | None:
    """The global gradient norm DeepSpeed computed in its last ``step`` (before clipping); None elsewhere."""
    if sharded_strategy_kind(strategy) != "DeepSpeedStrategy":
        return None
    norm = strategy.model.get_global_grad_norm()
    return None if norm is None else float(norm)


def parameter_gathering(strategy: Any, module: nn.Module) -> Callable[[], AbstractContextManager]:
    """A factory of contexts in which ``module``'s sharded parameters are whole, for generation under sharding.

    Autoregressive decoding calls the model once per token. Under ZeRO-3 each call would gather every layer's
    shards again (hundreds of all-gathers per reply); gathering once around the whole ``generate`` call costs one.

    * DeepSpeed ZeRO stage 3: every parameter gathered once with ``deepspeed.zero.GatheredParameters`` while
      DeepSpeed's per-module hooks are held off the module (see :func:`_zero3_whole`), so the decode runs on whole
      weights without gathering or releasing anything per token.
    * FSDP (Lightning's ``FSDPStrategy``): Lightning runs ``training_step`` inside the root FSDP unit's forward, so the
      root's parameters are already whole there and ``summon_full_params`` is refused inside a forward. Inner units
      (an ``auto_wrap_policy``) gather themselves on each call, which is correct though slower; the factory yields
      ``summon_full_params(recurse=True, writeback=False)`` only where it is allowed (outside a forward, e.g.
      ``validation_step`` under ``predict``) and a no-op otherwise.
    * FSDP2 (``ModelParallelStrategy``; the bank sharded by :meth:`PolicyBank.shard`): every ``fully_shard`` unit
      unsharded once and kept whole for the block (see :func:`_fsdp2_whole`).
    * Everything else (single device, DDP, ZeRO-1/2 keep whole parameters): a no-op.

    Args:
        strategy: ``trainer.strategy`` (any object; only its class names, its bases' included, and attributes are
            read, so a subclass of Lightning's strategies counts as its base).
        module: The module whose parameters generation needs (e.g. a :class:`PolicyBank`).
    """
    kind = sharded_strategy_kind(strategy)
    if kind == "DeepSpeedStrategy":
        stage = (getattr(strategy, "config", None) or {}).get("zero_optimization", {}).get("stage", 0)
        if stage == 3:
            return lambda: _zero3_whole(strategy, module)
    if kind == "FSDPStrategy":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: PLC0415
        from torch.distributed.fsdp._common_utils import TrainingState  # noqa: PLC0415

        def summon() -> AbstractContextManager:
            root = strategy.model
            if not isinstance(root, FSDP) or getattr(root, "training_state", None) != TrainingState.IDLE:
                return nullcontext()  # inside the root's forward: its parameters are already whole
            return FSDP.summon_full_params(root, recurse=True, writeback=False)

        return summon
    if kind == "ModelParallelStrategy":
        return lambda: _fsdp2_whole(module)
    return nullcontext


def fully_shard_blocks(model: nn.Module, mesh: Any, mp_policy: Any = None) -> None:
    """FSDP2 on a transformers model: each block of ``model._no_split_modules`` a unit, then ``model`` the root unit.

    The blocks are resharded after their forward; the root (embeddings, final norm, head) keeps its parameters after
    the forward, since the backward needs them at once. A model already sharded is left as it is. ``mp_policy``: an
    FSDP2 ``MixedPrecisionPolicy`` for every unit (None: FSDP2's default, the parameters' own dtype).

    Raises:
        ValueError: for a model without ``_no_split_modules`` (its blocks cannot be found by name).
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

    mp = {"mp_policy": mp_policy if mp_policy is not None else MixedPrecisionPolicy()}
    if isinstance(model, FSDPModule):
        return
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"cannot shard {type(model).__name__} with FSDP2: it names no _no_split_modules (its blocks)")
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True, **mp)
        block._ag_reshard_after_forward = True
    fully_shard(model, mesh=mesh, reshard_after_forward=False, **mp)
    model._ag_reshard_after_forward = False


def _fsdp2_units(module: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


@contextmanager
def _fsdp2_whole(module: nn.Module) -> Iterator[None]:
    """FSDP2: ``module``'s ``fully_shard`` units whole for the block, each all-gathered once, resharded on exit.

    Each unit's reshard-after-forward is turned off for the block (a unit would otherwise free its parameters after
    every forward and gather them again on the next: per decoded token) and put back to what
    :meth:`PolicyBank.shard` chose. Inside, the modules' parameters are the plain unsharded tensors FSDP2 swaps in.
    A module never sharded (no units) gets a no-op.
    """
    units = _fsdp2_units(module)
    try:
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(getattr(unit, "_ag_reshard_after_forward", True), recurse=False)


@contextmanager
def fsdp2_gradient_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """FSDP2: turn the gradient reduce-scatter of ``module``'s units off (``enabled=False``) for the block.

    The micro-batches of one step but the last accumulate unsharded gradients locally; the last one's backward
    reduces the sum (FSDP2's ``set_requires_gradient_sync``, the counterpart of DDP's ``no_sync``). A no-op for a
    module without units or with ``enabled=True``.
    """
    units = [] if enabled else _fsdp2_units(module)
    try:
        for unit in units:
            unit.set_requires_gradient_sync(False, recurse=False)
        yield
    finally:
        for unit in units:
            unit.set_requires_gradient_sync(True, recurse=False)


@contextmanager
def _zero3_whole(strategy: Any, module: nn.Module) -> Iterator[None]:
    """ZeRO-3: ``module``'s parameters whole for the whole block, gathered once, with DeepSpeed's hooks held off.

    ``GatheredParameters`` alone does not keep them whole: DeepSpeed's per-module hooks still run on every forward
    inside the block, and the coordinator re-partitions each submodule's parameters after its forward (and waits for
    or prefetches others), so a decode would gather every layer again for every token. So, for the block:

    1. the coordinator releases everything of ``module`` (``release_and_reset_all``: in-flight prefetches are waited
       for, nothing of it stays held);
    2. DeepSpeed's own forward hooks are taken off ``module``'s submodules (only the handles DeepSpeed registered;
       any other hook stays), and the hook dictionaries are put back as they were afterwards;
    3. every parameter of ``module`` is gathered once (``GatheredParameters``) and partitioned again on exit.

    The engine is ``strategy.model`` (Lightning's DeepSpeed strategy); a model without ZeRO-3 offload state (not yet
    wrapped) gets the plain gather.
    """
    import deepspeed  # noqa: PLC0415 - only present where the DeepSpeed strategy runs

    engine = getattr(strategy, "model", None)
    owner = getattr(engine, "optimizer", None)
    # training engine: the ZeRO-3 optimizer holds the offload state; inference engine (validate/test without an
    # optimizer): the offload object is the engine's "optimizer" itself
    offload = getattr(owner, "parameter_offload", None)
    if offload is None and hasattr(owner, "get_param_coordinator") and hasattr(owner, "forward_hooks"):
        offload = owner
    params = list(module.parameters())
    if offload is None:
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield
        return
    offload.get_param_coordinator().release_and_reset_all(module)
    ours = {h.id for h in (*offload.forward_hooks, *offload.backward_hooks)}
    saved = [(m, m._forward_pre_hooks, m._forward_hooks) for m in module.modules()]
    try:
        for m, pre, post in saved:
            m._forward_pre_hooks = type(pre)((k, v) for k, v in pre.items() if k not in ours)
            m._forward_hooks = type(post)((k, v) for k, v in post.items() if k not in ours)
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield
    finally:
        for m, pre, post in saved:
            m._forward_pre_hooks, m._forward_hooks = pre, post


@dataclass
class Rollout:
    """Sampled sequences of one player.

    Attributes:
        sequences: ``[N, P + C]`` token ids: left-padded prompt (width P) then completion (right-padded).
        attention_mask: ``[N, P + C]``.
        prompt_width: P.
        completion_mask: ``[N, C]``: 1 on completion tokens up to and including the first EOS.
        texts: Decoded completions.
        group_size: Consecutive rows that share one prompt (``num_samples`` of :meth:`PolicyBank.generate`; 1 when
            unknown). Log-probabilities then run the shared prompt once per group (see
            :meth:`PolicyBank.token_logprobs`).
    """

    sequences: Tensor
    attention_mask: Tensor
    prompt_width: int
    completion_mask: Tensor
    texts: list[str]
    group_size: int = 1

    @property
    def num_empty(self) -> int:
        """Completions that are empty once special tokens are dropped."""
        return sum(1 for t in self.texts if not t.strip())


class PolicyBank(nn.Module):
    """The players of a game over one base model.

    Args:
        name_or_path: Causal LM by hub name or local path.
        players: Player names (e.g. ``["leader", "follower"]``).
        mode: ``"lora"`` (adapters over one frozen base) or ``"separate"`` (a trainable copy each + one frozen
            reference copy).
        lora_r: LoRA rank.
        lora_alpha: LoRA alpha.
        lora_target_modules: Modules to adapt (``None``: peft's default for the architecture).
        dtype: Weights dtype.
        gradient_checkpointing: Activation checkpointing of the base.
        trust_remote_code: Off unless turned on.
        max_prompt_tokens: Prompts longer than this are cut from the left, with a warning, and counted.
    """

    def __init__(
        self,
        name_or_path: str,
        players: Sequence[str] = ("leader", "follower"),
        mode: str = "lora",
        lora_r: int = 16,
        lora_alpha: int = 32,
        lora_target_modules: list[str] | str | None = None,
        dtype: str = "float32",
        gradient_checkpointing: bool = False,
        trust_remote_code: bool = False,
        max_prompt_tokens: int = 1024,
    ) -> None:
        super().__init__()
        if mode not in ("lora", "separate"):
            raise ValueError(f"players mode must be 'lora' or 'separate', got {mode!r}")
        self.mode, self.player_names, self.max_prompt_tokens = mode, list(players), max_prompt_tokens
        self.tokenizer = load_tokenizer(name_or_path, trust_remote_code=trust_remote_code, padding_side="left")
        load = dict(
            task="causal_lm",
            dtype=dtype,
            gradient_checkpointing=gradient_checkpointing,
            trust_remote_code=trust_remote_code,
        )
        if mode == "lora":
            base = load_model(name_or_path, **load)
            base.requires_grad_(False)
            self.model = apply_lora(
                base, r=lora_r, alpha=lora_alpha, target_modules=lora_target_modules, adapter_names=self.player_names
            )
            self._all_players_trainable()  # peft trains only the active adapter: train all players
        else:
            self.models = nn.ModuleDict({p: load_model(name_or_path, **load) for p in self.player_names})
            self.reference = load_model(name_or_path, **load).eval().requires_grad_(False)
        self.truncated_prompts = 0
        # the prompt's KV cache is shared across a group's rows unless activation checkpointing (which turns the
        # cache off in training) is on
        self.share_prompts = not gradient_checkpointing
        # set by the LightningModule from its strategy (parameter_gathering); a no-op on one device and under DDP
        self.gather_for_generation: Callable[[], AbstractContextManager] = nullcontext
        self.merge_for_generation = True  # see _for_generation; set False under sharded strategies
        # sampled groups decode with grouped_prefix_attention (each prompt's cache read once per group): on CPU by
        # default, where the copied prompt cache's reads and torch.cat were a third of generate's time; True/False
        # forces it on or off (GPU kernels for the copied cache are not measured against it yet). The environment
        # variable ALIGNMENT_GAMES_GROUPED_DECODE=1/0 sets it for every bank of a run (e.g. from the command line)
        self.grouped_decode: bool | None = grouped_decode_setting()

    def use_strategy(self, strategy: Any) -> None:
        """Fit generation to the trainer's strategy (call from the LightningModule's ``setup``).

        Sharded strategies (FSDP, DeepSpeed) gather the parameters once around each ``generate`` call
        (:func:`parameter_gathering`) and keep the adapters unmerged (their parameters must not be swapped); elsewhere
        generation needs no gathering and runs with the LoRA update merged into swapped-in weights.
        """
        self.gather_for_generation = parameter_gathering(strategy, self)
        self.merge_for_generation = sharded_strategy_kind(strategy) is None

    def shard(self, mesh: Any, mp_policy: Any = None) -> None:
        """FSDP2 (``fully_shard``) over ``mesh``: each decoder block a unit, then each causal LM the root unit.

        The blocks are the architecture's ``_no_split_modules`` (transformers' own list of the layers that must stay
        whole: ``Qwen2DecoderLayer`` and the like), so a block's parameters (its LoRA adapters included) are gathered
        together, one block at a time, and resharded after its forward. The root unit (embeddings, final norm, head)
        keeps its parameters after the forward (``reshard_after_forward=False``): the backward needs them at once. In
        LoRA mode the one base model is sharded (adapters, frozen weights and the disabled-adapter reference alike);
        in separate mode every copy and the reference. Idempotent: a model already sharded is left as it is. A
        sharded bank never swaps merged weights in for generation (FSDP2 owns the modules' parameters: its hooks
        would replace the merged tensors, and putting the originals back corrupts its state), whatever strategy
        :meth:`use_strategy` was given. ``mp_policy``: FSDP2's ``MixedPrecisionPolicy`` for every unit (see
        :class:`modules.strategies.FSDP2Strategy`).

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

    @contextmanager
    def _for_generation(self, player: str | None) -> Iterator[nn.Module]:
        """The player as :meth:`_use` gives it, with its LoRA update merged into fresh weights when allowed.

        Decoding calls every adapted layer once per token; with ``W + s·BA`` computed once per ``generate`` call the
        adapter costs nothing per token. The merged weights are new tensors swapped in for the base layers' and the
        original tensors are put back afterwards, so the frozen base is bit-for-bit untouched (merging in place and
        unmerging would not be). Off (``merge_for_generation = False``) under sharded strategies, whose parameters
        must not be replaced.
        """
        from peft.tuners.lora import LoraLayer  # noqa: PLC0415

        layers = (
            []
            if self.mode == "separate" or player is None
            else [m for m in self.model.modules() if isinstance(m, LoraLayer) and player in m.lora_A]
        )
        plain = all(
            type(m.get_base_layer()) is nn.Linear and not m.use_dora.get(player, False) for m in layers
        )  # the W + s·BA form holds for plain LoRA on nn.Linear only (not DoRA, embeddings, convolutions)
        if not layers or not plain or not self.merge_for_generation:
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
        player: str | None,
        prompts: Sequence[str],
        num_samples: int,
        temperature: float = 0.6,
        top_p: float = 1.0,
        max_new_tokens: int = 128,
        do_sample: bool = True,
        min_new_tokens: int = 0,
    ) -> Rollout:
        """Sample ``num_samples`` completions for each prompt in one batched call (row ``i*num_samples + s``).

        ``min_new_tokens`` > 0 suppresses EOS until that many tokens are written (benchmarks use it to fix the
        work per step). The call runs inside :attr:`gather_for_generation` (see :func:`parameter_gathering`), so
        that sharded parameters are gathered once for the whole decode instead of once per token.
        """
        device = next(self.parameters()).device
        once = {k: v.to(device) for k, v in self._encode_prompts(prompts).items()}
        enc = {k: v.repeat_interleave(num_samples, dim=0) for k, v in once.items()}
        eos = self.tokenizer.eos_token_id
        with self.gather_for_generation(), self._for_generation(player) as model:
            was_training = model.training
            model.eval()
            shared = num_samples > 1 and self.share_prompts and once["input_ids"].shape[1] > 1
            if shared and self._grouped_ok(model):
                out = self._decode_grouped(
                    model, once, num_samples, temperature, top_p, max_new_tokens, do_sample, min_new_tokens
                )
            else:
                extra = {}
                if shared:
                    # prefill each prompt once (all but its last token), then copy the cache to the prompt's samples:
                    # generate only runs the last prompt token and the new ones
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

    def _cache_arg(self, model: nn.Module) -> str:
        """Name of the KV-cache argument and output: ``cache`` in recent transformers, else ``past_key_values``."""
        if not hasattr(self, "_cache_name"):
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            params = inspect.signature(type(base).forward).parameters
            self._cache_name = "cache" if "cache" in params else "past_key_values"
        return self._cache_name

    def _grouped_ok(self, model: nn.Module) -> bool:
        """Whether sampled groups decode with :func:`grouped_prefix_attention` (see ``grouped_decode``)."""
        wanted = self.grouped_decode
        if wanted is None:
            wanted = next(self.parameters()).device.type == "cpu"
        if not wanted:
            return False
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

        The prompt (all but its last token) is prefilled once per prompt; the decode loop then runs the B·G rows
        with :func:`grouped_prefix_attention` over that one copy and a cache of the rows' own tokens. Sampling is
        ``generate``'s: EOS suppressed for ``min_new_tokens``, temperature, nucleus ``top_p``, multinomial draws from
        the global generator in the same order, a finished row padded, the loop ending when every row is finished.
        """
        from transformers.cache_utils import DynamicCache

        ids, mask = once["input_ids"], once["attention_mask"]
        width = ids.shape[1]
        cache, _ = self._prompt_forward(model, ids, mask, width - 1)
        pad_mask = torch.zeros(mask.shape[0], 1, width - 1, device=ids.device)  # float32, added to float32 scores
        pad_mask = pad_mask.masked_fill(mask[:, None, :-1] == 0, float("-inf"))
        prefix = {i: (layer.keys, layer.values, pad_mask) for i, layer in enumerate(cache.layers)}
        rows = ids.repeat_interleave(g, dim=0)
        position = mask.repeat_interleave(g, dim=0).sum(dim=1, keepdim=True) - 1
        token = rows[:, -1:]
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        unfinished = torch.ones(rows.shape[0], dtype=torch.bool, device=ids.device)
        own = DynamicCache()
        new: list[Tensor] = []
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        previous = base.config._attn_implementation
        _PREFIX.clear()
        _PREFIX.update(prefix)
        base.config._attn_implementation = GROUPED_ATTENTION
        try:
            for step in range(max_new_tokens):
                out = model(input_ids=token, position_ids=position, use_cache=True, **{self._cache_arg(model): own})
                logits = out.logits[:, -1, :].to(dtype=torch.float32)
                if step < min_new_tokens and eos is not None:
                    logits[:, eos] = float("-inf")
                if do_sample:
                    if temperature != 1.0:
                        logits = logits / temperature
                    if top_p < 1.0:
                        ordered, order = torch.sort(logits, descending=False)
                        drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
                        drop[..., -1:] = False
                        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
                    nxt = torch.multinomial(logits.softmax(dim=-1), num_samples=1).squeeze(1)
                else:
                    nxt = logits.argmax(dim=-1)
                nxt = torch.where(unfinished, nxt, torch.full_like(nxt, pad))
                new.append(nxt)
                if eos is not None:
                    unfinished &= nxt != eos
                if not bool(unfinished.any()):
                    break
                token, position = nxt[:, None], position + 1
        finally:
            base.config._attn_implementation = previous
            _PREFIX.clear()
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
        self, player: str | None, rollout: Rollout, temperature: float = 0.6, micro_batch: int = 0
    ) -> Tensor:
        """Per-token ``log softmax(logits / T)`` of the completion tokens, ``[N, C]``, zero outside the completion.

        Only the completion positions reach the LM head (``logits_to_keep``: the prompt's hidden states are never
        projected onto the vocabulary), and ``log p = logit − logsumexp`` avoids a second ``[rows, C, vocab]``
        tensor; ``micro_batch`` rows at a time bound the memory of those logits. When the rollout's rows come in
        groups sharing one prompt (``rollout.group_size`` G > 1), the prompt runs once per group and its KV cache is
        repeated to the group's rows, so the forward (and backward) covers ``B·P + B·G·C`` tokens instead of
        ``B·G·(P + C)``; micro-batches are then rounded up to whole groups. Gradients flow unless called under
        ``no_grad``, through the shared prompt too; ``player=None`` is the frozen reference (adapters disabled).
        """
        seq, att, width = rollout.sequences, rollout.attention_mask, rollout.prompt_width
        cmask = rollout.completion_mask.to(seq.device)
        n, c = seq.shape[0], seq.shape[1] - width
        g = rollout.group_size if self.share_prompts and width > 0 and n % max(rollout.group_size, 1) == 0 else 1
        step = micro_batch or n
        step = -(-step // g) * g  # whole groups per chunk
        pos_all = (att.cumsum(dim=1) - 1).clamp_min(0)
        out = []
        with self._use(player) as model:
            for i in range(0, n, step):
                s, a, pos = seq[i : i + step], att[i : i + step], pos_all[i : i + step]
                if g > 1:
                    # the prompt once per group: its cache and the logits predicting the first completion token
                    cache, first = self._prompt_forward(model, s[::g], a[::g], width)
                    cache.batch_repeat_interleave(g)
                    kw = {self._cache_arg(model): cache}
                    tail = model(input_ids=s[:, width:], attention_mask=a, position_ids=pos[:, width:], **kw).logits
                    logits = torch.cat([first.repeat_interleave(g, dim=0), tail[:, :-1]], dim=1)
                else:
                    # the last C + 1 positions: P − 1 … P + C − 1 predict the C completion tokens
                    logits = model(input_ids=s, attention_mask=a, position_ids=pos, logits_to_keep=c + 1).logits
                    logits = logits[:, :-1]
                logits = logits.float() / temperature
                target = s[:, width:]
                picked = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)
                lp = picked - torch.logsumexp(logits, dim=-1)
                out.append(lp * cmask[i : i + step])
        return torch.cat(out)

    def logprobs(self, player: str | None, rollout: Rollout, temperature: float = 0.6, micro_batch: int = 0) -> Tensor:
        """Sum of :meth:`token_logprobs` over the completion, ``[N]``."""
        return self.token_logprobs(player, rollout, temperature, micro_batch).sum(dim=1)
