"""Schedules: learning-rate factors (for ``LambdaLR``) and the length a game's annealing schedules span."""

import math

from lightning.pytorch.utilities.rank_zero import rank_zero_warn


def warmup_cosine_factor(step: int, warmup_steps: int, total_steps: int, floor: float = 0.1) -> float:
    """Peak learning-rate multiplier: linear warmup, then cosine decay to ``floor`` at ``total_steps``, held after.

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


def schedule_length(num_iterations: int | None, max_epochs: int | None, batches_per_epoch: float) -> int:
    """The iterations the annealing schedules span: ``num_iterations``, or ``max_epochs × batches_per_epoch``.

    Raises:
        ValueError: naming both settings when ``num_iterations`` is ``None`` and the trainer's length is unbounded.
    """
    known = max_epochs is not None and max_epochs >= 0 and batches_per_epoch != float("inf")
    played = int(max_epochs * batches_per_epoch) if known else None
    if num_iterations is None:
        if played is None or played < 1:
            raise ValueError(
                "num_iterations: not given, and the trainer's length is unbounded (trainer.max_epochs "
                f"{max_epochs}); set trainer.max_epochs (one epoch = the datamodule's iterations_per_epoch "
                "iterations) or model.init_args.num_iterations"
            )
        return played
    if played is not None and played != num_iterations:
        rank_zero_warn(
            f"num_iterations={num_iterations}, but the trainer plays {played} iterations (trainer.max_epochs "
            f"{max_epochs} x {int(batches_per_epoch)} per epoch): the annealing schedules do not end with the run; "
            "leave num_iterations unset to take the trainer's"
        )
    return int(num_iterations)
