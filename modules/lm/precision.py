"""Precision of a language model per device: the dtype ``auto`` resolves to, TF32, and frozen weights cast once."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

AUTO = "auto"


def cuda_bf16_available() -> bool:
    """Whether a CUDA device that computes in bf16 (Ampere or later) is present."""
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def resolve_dtype(dtype: str, frozen: bool, bf16_device: bool | None = None) -> str:
    """The load dtype: ``dtype``, or for ``auto`` bf16 when ``frozen`` on a bf16 CUDA device (``None``: this one)."""
    if dtype != AUTO:
        return dtype
    return "bfloat16" if frozen and (cuda_bf16_available() if bf16_device is None else bf16_device) else "float32"


def set_tf32(enabled: bool) -> bool:
    """On CUDA, let fp32 matmuls run on TF32 tensor cores (process-wide); returns whether it was applied."""
    if not torch.cuda.is_available():
        return False
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled
    return True


def autocast_dtype(precision_plugin: Any) -> torch.dtype | None:
    """bf16 for a plain ``MixedPrecision`` plugin of ``bf16-mixed`` (not sharded, not ``16-mixed``), else None."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    if type(precision_plugin) is MixedPrecision and precision_plugin.precision == "bf16-mixed":
        return torch.bfloat16
    return None


def frozen_weights_dtype(strategy: Any) -> torch.dtype | None:
    """:func:`autocast_dtype` of ``strategy``'s precision plugin; None under sharded strategies."""
    from alignment_games.modules.distributed.sharding import sharded_strategy_kind

    if sharded_strategy_kind(strategy) is not None:
        return None
    return autocast_dtype(getattr(strategy, "precision_plugin", None))


def cast_frozen_parameters(module: nn.Module, dtype: torch.dtype) -> int:
    """Cast every floating frozen parameter of ``module`` to ``dtype`` in place, once (tied ones stay tied); how many.

    Autocast caches casts of trainable leaves only, so a frozen fp32 base under ``bf16-mixed`` is recast every forward.
    """
    cast = [p for p in module.parameters() if not p.requires_grad and p.is_floating_point() and p.dtype != dtype]
    for p in cast:
        p.data = p.data.to(dtype)
    return len(cast)


def cast_frozen_for_strategy(module: nn.Module, strategy: Any) -> int:
    """:func:`cast_frozen_parameters` to :func:`frozen_weights_dtype` of ``strategy`` where it names one; else 0."""
    dtype = frozen_weights_dtype(strategy)
    return 0 if dtype is None else cast_frozen_parameters(module, dtype)
