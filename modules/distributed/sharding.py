"""Everything that depends on the distributed strategy: the only place that names DDP, FSDP, FSDP2 or DeepSpeed."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn


def sharded_strategy_kind(strategy: Any) -> str | None:
    """``"DeepSpeedStrategy"``, ``"FSDPStrategy"`` or ``"ModelParallelStrategy"`` by class names, else None."""
    names = {cls.__name__ for cls in type(strategy).__mro__}
    return next((k for k in ("DeepSpeedStrategy", "FSDPStrategy", "ModelParallelStrategy") if k in names), None)


def shard_for_strategy(module: Any, bank: nn.Module, family: str) -> None:
    """FSDP2 (from ``configure_model``): shard ``bank`` over the module's data-parallel mesh, if it has one.

    Raises:
        ValueError: naming ``trainer.strategy``, for a mesh with tensor parallelism.
    """
    if (mesh := getattr(module, "_device_mesh", None)) is None:
        return
    if "tensor_parallel" in (mesh.mesh_dim_names or ()) and mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            f"trainer.strategy: {family} shards its policy with FSDP2 over the data-parallel dimension only, got a "
            f"tensor-parallel size of {mesh['tensor_parallel'].size()}; use alignment_games.modules.distributed."
            "strategies.FSDP2Strategy (configs/overlays/fsdp2.yaml) or ModelParallelStrategy(tensor_parallel_size=1)"
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
    """Fit a manual-optimization family to the strategy (``setup("fit")``): FSDP1 refused, DeepSpeed's clipping set.

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


def parameter_gathering(strategy: Any, module: nn.Module) -> Callable[[], AbstractContextManager]:
    """A factory of contexts in which ``module``'s sharded parameters are whole (one gather per ``generate``)."""
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
        ValueError: naming ``trainer.strategy``.
    """
    if sharded_strategy_kind(strategy) == "FSDPStrategy":
        raise ValueError(
            f"trainer.strategy: exporting weights under Lightning's FSDP ({type(strategy).__name__}) is not supported; "
            "train with FSDP2 (configs/overlays/fsdp2.yaml), DeepSpeed or DDP, or export a one-file checkpoint with "
            "`python train.py export` (docs/export.md)"
        )


def full_tensors(strategy: Any, tensors: dict[str, Tensor], keep: bool = True) -> dict[str, Tensor]:
    """Whole CPU copies of ``tensors``; a collective (same names, same order; ``keep=False`` gets ``{}``).

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
    """FSDP2: each ``model._no_split_modules`` block a unit, then ``model`` the root unit; a sharded model is kept.

    Raises:
        ValueError: for a model without ``_no_split_modules`` (its blocks cannot be found by name).
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mp = {"mp_policy": mp_policy if mp_policy is not None else MixedPrecisionPolicy()}
    if isinstance(model, FSDPModule):
        return
    names = set(getattr(model, "_no_split_modules", None) or ())
    if not (blocks := [m for m in model.modules() if type(m).__name__ in names]):
        raise ValueError(f"cannot shard {type(model).__name__} with FSDP2: it names no _no_split_modules (its blocks)")
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True, **mp)
        block._ag_reshard_after_forward = True
    fully_shard(model, mesh=mesh, reshard_after_forward=False, **mp)
    model._ag_reshard_after_forward = False


def fsdp_wrapped(module: nn.Module) -> str | None:
    """The first FSDP unit's class name in ``module`` (its weights are gathered by hooks), or None."""
    names = (type(m).__name__ for m in module.modules())
    return next((n for n in names if n.startswith(("FSDP", "FullyShardedDataParallel"))), None)


def _fsdp2_units(module: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


@contextmanager
def _fsdp2_whole(module: nn.Module) -> Iterator[None]:
    """FSDP2: ``module``'s units gathered once, whole for the block (reshard-after-forward off), then resharded."""
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
    """FSDP2's ``no_sync``: the reduce-scatter of ``module``'s units off for the block unless ``enabled``."""
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
    """ZeRO-3: ``module``'s parameters gathered once for the block, DeepSpeed's re-partitioning hooks off meanwhile."""
    import deepspeed

    owner = getattr(getattr(strategy, "model", None), "optimizer", None)
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


def is_fsdp2(strategy: Any) -> bool:
    """Whether ``strategy`` is (a subclass of) Lightning's ``ModelParallelStrategy`` (FSDP2)."""
    return sharded_strategy_kind(strategy) == "ModelParallelStrategy"


def grad_norm_after_step(strategy: Any, norm: Tensor) -> Tensor:
    """The gradient norm to log for a step: DeepSpeed's own (before clipping), else ``norm``."""
    if sharded_strategy_kind(strategy) != "DeepSpeedStrategy":
        return norm
    engine = strategy.model.get_global_grad_norm()
    return norm if engine is None else torch.tensor(float(engine))


@contextmanager
def gradient_sync(trainer: Any, module: nn.Module, banks: Sequence[nn.Module], enabled: bool) -> Iterator[None]:
    """Skip the gradient reduction of a micro-batch unless ``enabled`` (the last of a step).

    DDP: ``no_sync``; FSDP2: :func:`fsdp2_gradient_sync`; DeepSpeed (keeps its own boundary) and one process: nothing.
    """
    strategy = getattr(trainer, "strategy", None)
    if enabled or strategy is None:
        yield
        return
    if is_fsdp2(strategy):
        with ExitStack() as stack:
            for bank in banks:
                stack.enter_context(fsdp2_gradient_sync(bank, enabled=False))
            yield
        return
    wrapped, deepspeed = strategy.model, sharded_strategy_kind(strategy) == "DeepSpeedStrategy"
    plain = wrapped is None or wrapped is module or not hasattr(wrapped, "no_sync") or deepspeed
    with nullcontext() if plain else wrapped.no_sync():
        yield
