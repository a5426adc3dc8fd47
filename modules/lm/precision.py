"""Precision of a language model per device: the dtype ``auto`` resolves to, TF32, and frozen weights cast once.

Pure functions of a device or a module, no Lightning in them; :class:`~modules.lm.model_config.ModelConfig` and
:class:`~modules.lm.policy_bank.PolicyBank` call them (see ``docs/precision.md``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "AUTO",
    "autocast_dtype",
    "cast_frozen_for_strategy",
    "cast_frozen_parameters",
    "cuda_bf16_available",
    "frozen_weights_dtype",
    "resolve_dtype",
    "set_tf32",
]

AUTO = "auto"


def cuda_bf16_available() -> bool:
    """Whether a CUDA device that computes in bf16 (Ampere or later) is present."""
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def resolve_dtype(dtype: str, frozen: bool, bf16_device: bool | None = None) -> str:
    """The dtype a model is loaded in: ``dtype`` itself unless it is ``auto``.

    ``auto`` gives ``bfloat16`` to a frozen model (the base under LoRA adapters, a frozen reference copy) on a CUDA
    device with bf16, and ``float32`` to everything else: trainable weights (their optimizer moments follow their
    dtype) and every model on CPU, where fp32 is both the faster and the reference path.

    Args:
        dtype: A name of :data:`modules.lm.models.DTYPES` or ``auto``.
        frozen: Whether no parameter of the model is trained.
        bf16_device: Whether the run has a bf16 CUDA device; ``None`` asks :func:`cuda_bf16_available`.
    """
    if dtype != AUTO:
        return dtype
    if bf16_device is None:
        bf16_device = cuda_bf16_available()
    return "bfloat16" if frozen and bf16_device else "float32"


def set_tf32(enabled: bool) -> bool:
    """On a CUDA machine, let fp32 matmuls run on TF32 tensor cores (``enabled``) or not; nothing on CPU.

    TF32 keeps fp32's range with a 10-bit mantissa in the matmul's inputs (fp32 accumulation): what PyTorch's
    ``set_float32_matmul_precision("high")`` gives. It is a process-wide setting. Returns whether it was applied.
    """
    if not torch.cuda.is_available():
        return False
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled
    return True


def autocast_dtype(precision_plugin: Any) -> torch.dtype | None:
    """The dtype Lightning's autocast computes in: bf16 for a ``MixedPrecision`` plugin of ``bf16-mixed``, else None.

    Only the plain autocast plugin counts (single device, DDP): FSDP, FSDP2 and DeepSpeed bring their own mixed
    precision and own the parameters. ``16-mixed`` is left alone: fp16 weights would carry an fp16 residual stream,
    which fp32 weights under autocast do not.
    """
    try:
        from lightning.pytorch.plugins.precision import MixedPrecision
    except ImportError:  # pragma: no cover - Lightning is a dependency of the suite
        return None
    if type(precision_plugin) is MixedPrecision and precision_plugin.precision == "bf16-mixed":
        return torch.bfloat16
    return None


def frozen_weights_dtype(strategy: Any) -> torch.dtype | None:
    """The dtype to hold frozen weights in under ``strategy``: :func:`autocast_dtype` of its precision plugin, or None.

    None under sharded strategies (FSDP, FSDP2, DeepSpeed): they own the parameters and their mixed precision.
    """
    from alignment_games.modules.distributed.sharding import sharded_strategy_kind

    if sharded_strategy_kind(strategy) is not None:
        return None
    return autocast_dtype(getattr(strategy, "precision_plugin", None))


def cast_frozen_parameters(module: nn.Module, dtype: torch.dtype) -> int:
    """Cast every floating, frozen (``requires_grad=False``) parameter of ``module`` to ``dtype`` in place, once.

    Autocast caches its casts of trainable leaves only, so a frozen fp32 base under ``bf16-mixed`` is cast again by
    every forward, every decoded token included. Held in bf16 from the start it is never cast, and the matmuls see
    the same bf16 values autocast would have made. Trainable parameters (adapters, full copies) keep their dtype.
    Tied parameters are one object and stay tied. Returns how many parameters were cast.
    """
    done = 0
    seen: set[int] = set()
    for p in module.parameters():
        if id(p) in seen or p.requires_grad or not p.is_floating_point() or p.dtype == dtype:
            continue
        seen.add(id(p))
        p.data = p.data.to(dtype)
        done += 1
    return done


def cast_frozen_for_strategy(module: nn.Module, strategy: Any) -> int:
    """:func:`cast_frozen_parameters` to :func:`frozen_weights_dtype` of ``strategy`` where it names one; else 0."""
    dtype = frozen_weights_dtype(strategy)
    return 0 if dtype is None else cast_frozen_parameters(module, dtype)
