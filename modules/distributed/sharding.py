"""Everything that depends on the distributed strategy: the only place that names DDP, FSDP, FSDP2 or DeepSpeed.

The families ask through these functions: which sharded strategy runs (:func:`sharded_strategy_kind`), whether a
manual-backward family can run under it (:func:`check_manual_backward_strategy`), how to shard a policy under FSDP2
(:func:`shard_for_strategy`), how to keep its parameters whole for a generate call (:func:`parameter_gathering`), how
to skip the gradient reduction of all but the last micro-batch (:func:`gradient_sync`), and the gradient norm of a step
(:func:`grad_norm_after_step`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "check_exportable",
    "check_manual_backward_strategy",
    "engine_grad_norm",
    "fsdp2_gradient_sync",
    "fsdp_wrapped",
    "fully_shard_blocks",
    "full_tensors",
    "grad_norm_after_step",
    "gradient_sync",
    "is_deepspeed",
    "is_fsdp2",
    "parameter_gathering",
    "shard_for_strategy",
    "sharded_strategy_kind",
]


def sharded_strategy_kind(strategy: Any) -> str | None:
    """The sharded strategy ``strategy`` is (a subclass of), by its base's name, else None.

    ``"DeepSpeedStrategy"``, ``"FSDPStrategy"`` (FSDP1) or ``"ModelParallelStrategy"`` (FSDP2). Read from the class
    hierarchy's names, so nothing is imported and a user's subclass counts as the strategy it extends.
    """
    names = {cls.__name__ for cls in type(strategy).__mro__}
    return next((k for k in ("DeepSpeedStrategy", "FSDPStrategy", "ModelParallelStrategy") if k in names), None)


def shard_for_strategy(module: Any, bank: nn.Module, family: str) -> None:
    """FSDP2: shard ``bank`` over the data-parallel mesh when the trainer's strategy gives the module one.

    ``bank`` is a policy bank (its own ``shard(mesh, mp_policy)``) or a transformers model (:func:`fully_shard_blocks`).
    Call from the LightningModule's ``configure_model``; without a mesh it does nothing. Frozen scorers stay whole on
    every rank. The strategy's ``mixed_precision_policy``, if any, goes to every unit.

    Raises:
        ValueError: naming ``trainer.strategy``, for a mesh with tensor parallelism (the families shard by FSDP
            only; :class:`~.strategies.FSDP2Strategy` puts every process in the data-parallel dimension).
    """
    mesh = getattr(module, "_device_mesh", None)
    if mesh is None:
        return
    if "tensor_parallel" in (mesh.mesh_dim_names or ()) and mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            f"trainer.strategy: {family} shards its policy with FSDP2 over the data-parallel dimension only, got a "
            f"tensor-parallel size of {mesh['tensor_parallel'].size()}; use "
            "alignment_games.modules.distributed.strategies.FSDP2Strategy "
            "(configs/overlays/fsdp2.yaml) or ModelParallelStrategy(tensor_parallel_size=1)"
        )
    dp = mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh
    trainer = getattr(module, "_trainer", None)
    policy = getattr(getattr(trainer, "strategy", None), "mixed_precision_policy", None)
    if hasattr(bank, "shard"):
        bank.shard(dp, policy)
    else:
        fully_shard_blocks(bank, dp, policy)


def check_manual_backward_strategy(
    strategy: Any, family: str, grad_clip: float | None, num_optimizers: int = 1
) -> None:
    """Fit a family that runs its backward passes inside ``training_step`` (manual optimization) to the strategy.

    Call from the LightningModule's ``setup("fit")``, before the strategy wraps the model.

    * FSDP1 (``FSDPStrategy``) is refused: Lightning runs ``training_step`` inside the root unit's forward, so each
      backward runs before that forward ends and FSDP's backward hooks assert. FSDP2 runs ``training_step`` outside
      any forward: the families take it (:func:`shard_for_strategy`).
    * DeepSpeed: ``grad_clip`` becomes the engine's ``gradient_clipping`` (the engine keeps the gradients in its own
      partitions, so a clip of ``p.grad`` would see none). It takes exactly one optimizer in Lightning.

    Raises:
        ValueError: naming ``trainer.strategy``, under FSDP, or under DeepSpeed with more than one optimizer.
    """
    kind = sharded_strategy_kind(strategy)
    if kind == "DeepSpeedStrategy" and num_optimizers != 1:
        raise ValueError(
            f"trainer.strategy: {family} trains with {num_optimizers} optimizers, and Lightning's DeepSpeed strategy "
            f"takes exactly one (got {type(strategy).__name__}); use FSDP2 (configs/overlays/fsdp2.yaml) or DDP "
            "(configs/overlays/ddp.yaml)"
        )
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

    Gathering once around the whole ``generate`` call costs one all-gather instead of one per decoded token.

    * DeepSpeed ZeRO-3: :func:`_zero3_whole`.
    * FSDP1: ``summon_full_params(recurse=True, writeback=False)`` outside a forward; inside one (``training_step``)
      the root's parameters are already whole and inner units gather themselves, so a no-op.
    * FSDP2: every ``fully_shard`` unit unsharded once for the block (:func:`_fsdp2_whole`).
    * Everything else (single device, DDP, ZeRO-1/2 keep whole parameters): a no-op.

    Args:
        strategy: ``trainer.strategy`` (a subclass of Lightning's strategies counts as its base).
        module: The module whose parameters generation needs (e.g. a :class:`PolicyBank`).
    """
    kind = sharded_strategy_kind(strategy)
    if kind == "DeepSpeedStrategy":
        stage = (getattr(strategy, "config", None) or {}).get("zero_optimization", {}).get("stage", 0)
        if stage == 3:
            return lambda: _zero3_whole(strategy, module)
    if kind == "FSDPStrategy":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp._common_utils import TrainingState

        def summon() -> AbstractContextManager:
            root = strategy.model
            if not isinstance(root, FSDP) or getattr(root, "training_state", None) != TrainingState.IDLE:
                return nullcontext()  # inside the root's forward: its parameters are already whole
            return FSDP.summon_full_params(root, recurse=True, writeback=False)

        return summon
    if kind == "ModelParallelStrategy":
        return lambda: _fsdp2_whole(module)
    return nullcontext


def check_exportable(strategy: Any) -> None:
    """Refuse a strategy :func:`full_tensors` cannot gather from: Lightning's FSDP (FSDP1).

    Raises:
        ValueError: naming ``trainer.strategy``; its original parameters are views of flat shards, and a whole copy
            needs ``summon_full_params`` over the root unit, which is not done here.
    """
    if sharded_strategy_kind(strategy) == "FSDPStrategy":
        raise ValueError(
            f"trainer.strategy: exporting weights under Lightning's FSDP ({type(strategy).__name__}) is not supported; "
            "train with FSDP2 (configs/overlays/fsdp2.yaml), DeepSpeed or DDP, or export a one-file checkpoint with "
            "`python train.py export` (docs/export.md)"
        )


def full_tensors(strategy: Any, tensors: dict[str, Tensor], keep: bool = True) -> dict[str, Tensor]:
    """Whole CPU copies of ``tensors`` (parameters, by name), gathered from their shards; a collective when sharded.

    Every rank must call it with the same names in the same order; a rank with ``keep=False`` (one that writes
    nothing) takes part in the gathers and gets ``{}``, holding no copy. FSDP2 parameters (``DTensor``) are all-gathered
    one by one in their own dtype (the fp32 shards, not a ``param_dtype`` cast); ZeRO-3 parameters are gathered with
    ``GatheredParameters``; whole parameters (one device, DDP, ZeRO-1/2) are copied.

    Raises:
        ValueError: naming ``trainer.strategy`` under Lightning's FSDP (:func:`check_exportable`).
    """
    check_exportable(strategy)
    from torch.distributed.tensor import DTensor

    partitioned = [t for t in tensors.values() if hasattr(t, "ds_id")]  # ZeRO-3 marks its partitioned parameters
    gather: AbstractContextManager = nullcontext()
    if partitioned:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)
    out = {}
    with gather, torch.no_grad():
        for name, tensor in tensors.items():
            whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if keep:
                out[name] = whole.detach().to("cpu", copy=True).contiguous()
    return out


def fully_shard_blocks(model: nn.Module, mesh: Any, mp_policy: Any = None) -> None:
    """FSDP2 on a transformers model: each block of ``model._no_split_modules`` a unit, then ``model`` the root unit.

    The root keeps its parameters after the forward (the backward needs them at once); a sharded model is left as it
    is. ``mp_policy``: an FSDP2 ``MixedPrecisionPolicy`` for every unit (None: the parameters' own dtype).

    Raises:
        ValueError: for a model without ``_no_split_modules`` (its blocks cannot be found by name).
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

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


def fsdp_wrapped(module: nn.Module) -> str | None:
    """The class name of the first FSDP unit inside ``module`` (FSDP1's wrapper or FSDP2's ``FSDP<Class>``), or None.

    Such units gather their weights in their own forward hooks, so code that reads weights without calling those
    forwards must not run on them.
    """
    for m in module.modules():
        if type(m).__name__.startswith(("FSDP", "FullyShardedDataParallel")):
            return type(m).__name__
    return None


def _fsdp2_units(module: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


@contextmanager
def _fsdp2_whole(module: nn.Module) -> Iterator[None]:
    """FSDP2: ``module``'s ``fully_shard`` units whole for the block, each all-gathered once, resharded on exit.

    Reshard-after-forward is off for the block (else every decoded token would gather again), then put back.
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

    FSDP2's counterpart of DDP's ``no_sync``; a no-op for a module without units or with ``enabled=True``.
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

    ``GatheredParameters`` alone is not enough: DeepSpeed's per-module hooks would re-partition each submodule after
    its forward, so every token would gather again. So the coordinator releases ``module``, DeepSpeed's own forward
    hooks are taken off its submodules (others stay) and put back on exit. A model without ZeRO-3 offload state (not
    yet wrapped) gets the plain gather.
    """
    import deepspeed

    engine = getattr(strategy, "model", None)
    owner = getattr(engine, "optimizer", None)
    # the ZeRO-3 optimizer holds the offload state; in an inference engine the offload object is the "optimizer"
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


def is_deepspeed(strategy: Any) -> bool:
    """Whether ``strategy`` is (a subclass of) Lightning's DeepSpeed strategy."""
    return sharded_strategy_kind(strategy) == "DeepSpeedStrategy"


def is_fsdp2(strategy: Any) -> bool:
    """Whether ``strategy`` is (a subclass of) Lightning's ``ModelParallelStrategy`` (FSDP2 ``fully_shard``)."""
    return sharded_strategy_kind(strategy) == "ModelParallelStrategy"


def grad_norm_after_step(strategy: Any, norm: Tensor) -> Tensor:
    """The gradient norm to log for a step: DeepSpeed's own (its engine holds the gradients), else ``norm``."""
    engine = engine_grad_norm(strategy)
    return norm if engine is None else torch.tensor(engine)


@contextmanager
def gradient_sync(trainer: Any, module: nn.Module, banks: Sequence[nn.Module], enabled: bool) -> Iterator[None]:
    """Skip the gradient reduction of a micro-batch unless ``enabled`` (the last micro-batch of a step).

    * DDP: the wrapped model's ``no_sync``.
    * FSDP2: each bank's ``fully_shard`` units skip their reduce-scatter (:func:`fsdp2_gradient_sync`).
    * DeepSpeed: nothing; its engine refuses ``no_sync`` with ZeRO-2/3 and keeps its own accumulation boundary.
    * One process: nothing.
    """
    strategy = getattr(trainer, "strategy", None) if trainer is not None else None
    if enabled or strategy is None:
        yield
        return
    if is_fsdp2(strategy):
        with ExitStack() as stack:
            for bank in banks:
                stack.enter_context(fsdp2_gradient_sync(bank, enabled=False))
            yield
        return
    wrapped = strategy.model
    if wrapped is None or wrapped is module or not hasattr(wrapped, "no_sync") or is_deepspeed(strategy):
        yield
        return
    with wrapped.no_sync():
        yield
