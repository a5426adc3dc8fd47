"""Learning-rate schedules as plain functions of the step (no Lightning), for ``torch.optim.lr_scheduler.LambdaLR``."""

from __future__ import annotations

import math

__all__ = ["warmup_cosine_factor"]


def warmup_cosine_factor(step: int, warmup_steps: int, total_steps: int, floor: float = 0.1) -> float:
    """Multiplier of the peak learning rate: linear warmup, then cosine decay to ``floor`` at ``total_steps``.

    Step ``s < warmup_steps`` gets ``(s + 1) / warmup_steps``; later steps get
    ``floor + (1 - floor) * (1 + cos(pi * t)) / 2`` with ``t = (s - warmup_steps) / (total_steps - warmup_steps)``
    clipped to [0, 1], so steps past the end stay at ``floor``.

    Example:
        >>> [round(warmup_cosine_factor(s, 2, 6, 0.0), 3) for s in range(7)]
        [0.5, 1.0, 1.0, 0.854, 0.5, 0.146, 0.0]

    Raises:
        ValueError: for a negative ``warmup_steps``, ``total_steps <= warmup_steps`` or ``floor`` outside [0, 1].
    """
    if warmup_steps < 0 or total_steps <= warmup_steps:
        raise ValueError(f"need 0 <= warmup_steps < total_steps, got {warmup_steps}, {total_steps}")
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor must lie in [0, 1], got {floor}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    t = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t))
