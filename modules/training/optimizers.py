"""Injected optimizers: every family's ``optimizer`` option, built on groups at the family's rates; AdamW by default."""

from collections.abc import Callable, Iterable
from typing import Any

import torch

#: What ``lightning.pytorch.cli.OptimizerCallable`` is (its type, without importing the CLI): parameters to optimizer.
OptimizerCallable = Callable[[Iterable], torch.optim.Optimizer]


def _refuse(what: str) -> TypeError:
    return TypeError(
        f"optimizer must build a torch.optim.Optimizer from parameters (class_path: torch.optim.SGD), got {what}"
    )


def check_optimizer(optimizer: Any) -> OptimizerCallable | None:
    """``optimizer`` if it is ``None`` or a callable that may build an optimizer; else ``TypeError`` naming it."""
    not_optimizer = isinstance(optimizer, type) and not issubclass(optimizer, torch.optim.Optimizer)
    if optimizer is not None and (not callable(optimizer) or not_optimizer):
        raise _refuse(repr(optimizer))
    return optimizer


def build_optimizer(
    optimizer: OptimizerCallable | None, params: Iterable, lr: float, **adamw: Any
) -> torch.optim.Optimizer:
    """One player's optimizer: ``AdamW(params, lr=lr, **adamw)``, or the injected one on groups at ``lr``.

    Raises:
        TypeError: naming the option, when the injected callable returns something other than an optimizer.
    """
    if optimizer is None:
        return torch.optim.AdamW(params, lr=lr, **adamw)
    params = list(params)
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    built = optimizer([{"lr": lr, **g} for g in groups])
    if not isinstance(built, torch.optim.Optimizer):
        raise _refuse(f"a {type(built).__name__} from {optimizer!r}")
    return built
