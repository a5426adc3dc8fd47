"""Cross-process helpers of the families: rank and world, work dealt by rank, object gathers, gradient sums, checks."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from alignment_games.modules.distributed.sharding import sharded_strategy_kind


def world(trainer: Any) -> tuple[int, int]:
    """``(rank, world size)`` of ``trainer``; ``(0, 1)`` without one."""
    return (0, 1) if trainer is None else (trainer.global_rank, trainer.world_size)


def owns(trainer: Any, item: int) -> bool:
    """Whether this rank does item ``item`` of a list dealt round-robin (item ``i`` to rank ``i % world``)."""
    rank, size = world(trainer)
    return item % size == rank


def share(trainer: Any, lo: int, hi: int) -> tuple[int, int]:
    """The contiguous share ``[a, b)`` of the rows ``[lo, hi)`` this rank computes (shares tile them in rank order)."""
    rank, size = world(trainer)
    n = hi - lo
    return lo + n * rank // size, lo + n * (rank + 1) // size


def shared_rows(trainer: Any, n: int, batch_size: int) -> list[bool]:
    """Which of the rows ``[0, n)`` this rank computes when each batch of ``batch_size`` is split by :func:`share`."""
    owned = [False] * n
    for lo in range(0, n, batch_size):
        a, b = share(trainer, lo, min(n, lo + batch_size))
        owned[a:b] = [True] * (b - a)
    return owned


def local_batches(owned: Sequence[bool], batch_size: int) -> list[tuple[int, tuple[int, int]]]:
    """Each batch of ``batch_size`` rows: its size, and the rows ``[a, b)`` of this rank's own tensors it covers."""
    before = [0, *itertools.accumulate(int(x) for x in owned)]
    ends = [(lo, min(len(owned), lo + batch_size)) for lo in range(0, len(owned), batch_size)]
    return [(hi - lo, (before[lo], before[hi])) for lo, hi in ends]


def gather_objects(trainer: Any, obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order; ``[obj]`` on one process. A collective: every rank calls it."""
    if world(trainer)[1] == 1:
        return [obj]
    out: list[Any] = [None] * world(trainer)[1]
    torch.distributed.all_gather_object(out, obj)
    return out


def sum_gradients(trainer: Any, params: list[Tensor], total: float) -> float:
    """Sum the gradients of ``params`` and the loss ``total`` over the ranks in fp32 (where DDP's reducer does not)."""
    if world(trainer)[1] == 1:
        return total
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    torch.distributed.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset : offset + g.numel()].view_as(p).to(g.dtype)
        offset += g.numel()
    stats = torch.tensor([total], dtype=torch.float64, device=flat.device)
    torch.distributed.all_reduce(stats)
    return float(stats[0])


def trainable_checksum(module: nn.Module) -> list[float]:
    """The sum of each trainable tensor of ``module`` (float64), read back once."""
    sums = [p.detach().double().sum() for p in module.parameters() if p.requires_grad]
    return torch.stack(sums).tolist() if sums else []


def check_ranks_agree(trainer: Any, state: Any, what: str) -> None:
    """Raise when a rank's ``state`` (picklable, comparable) differs from rank 0's (a collective; one process: no-op).

    Raises:
        RuntimeError: naming the ranks that diverged and ``what`` was compared.
    """
    everyone = gather_objects(trainer, state)
    if bad := [r for r, other in enumerate(everyone) if other != everyone[0]]:
        raise RuntimeError(f"ranks {bad} diverged from rank 0 ({what})")


def check_replicated_strategy(trainer: Any, family: str) -> None:
    """Refuse several processes under anything but DDP, for a family whose ranks each run the whole model.

    Raises:
        ValueError: naming ``trainer.strategy``, the strategy and the number of processes.
    """
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    strategy = trainer.strategy
    if trainer.world_size > 1 and (not isinstance(strategy, DDPStrategy) or isinstance(strategy, DeepSpeedStrategy)):
        raise ValueError(
            f"trainer.strategy: the {family} runs on several processes under DDP only (configs/overlays/ddp.yaml), "
            f"got {type(strategy).__name__} on {trainer.world_size} processes; every rank runs the whole base and the "
            "adapters are replicated"
        )


def lockstep(trainer: Any) -> bool:
    """Whether every rank must run each sharded forward equally often (its collectives would otherwise hang)."""
    if trainer is None or sharded_strategy_kind(trainer.strategy) is None:
        return False
    return torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def any_rank(flag: bool, device: torch.device | str) -> bool:
    """Whether ``flag`` holds on any rank (a max all-reduce on ``device``; every rank must call it)."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item() > 0)


def average_gradients(params: Sequence[Tensor]) -> None:
    """Average the gradients of ``params`` over the ranks, in place, as DDP would (one process: nothing)."""
    size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    for p in params:
        if p.grad is not None and size > 1:
            torch.distributed.all_reduce(p.grad)
            p.grad.div_(size)
