"""The families the resume tests run (``tests/test_resume.py``, ``tests/test_outside_kill.py``): every recipe's
kill-resume runs (:attr:`recipes.Recipe.resume`), and :func:`resume_points`, where each resumed run of a chain must
start."""

from __future__ import annotations

from .recipes import RECIPES
from .resume_harness import Family

FAMILIES: dict[str, Family] = {f.name: f for recipe in RECIPES.values() for f in recipe.resume}


def resume_points(family: Family) -> list[int]:
    """Batches done at the checkpoint each resumed run must start from (one per kill, in chain order)."""
    points, done = [], 0
    for kill in family.kills:
        stop = kill.after_batch if kill.after_batch is not None else kill.epoch * family.batches_per_epoch
        epoch_end = kill.after_batch is not None and kill.after_batch % family.batches_per_epoch == 0
        # periodic saves happen at batch ends that are multiples of ckpt_every; a SIGKILL in on_train_batch_end
        # comes before that batch's save, a SIGTERM after it, an epoch-start kill after the previous batch's save
        included = kill.epoch is not None or kill.signal == "SIGTERM"
        last_periodic = (stop - (0 if included else 1)) // family.ckpt_every * family.ckpt_every
        # a SIGTERM saves where it stops, except at the end of an epoch (CheckpointOnSigterm)
        done = stop if kill.signal == "SIGTERM" and not epoch_end else max(done, last_periodic)
        points.append(done)
    return points
