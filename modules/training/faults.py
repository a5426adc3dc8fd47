"""Non-finite losses, utilities and rewards: skip the update, log and count it, stop after too many in a row.

:class:`NonFiniteGuard` is a mixin for LightningModules. A module calls :meth:`NonFiniteGuard.check_finite` on the
values an update depends on before stepping; ``False`` means: return without an update (``None`` from
``training_step`` under automatic optimization, no ``step`` under manual optimization). The decision is taken
for all ranks together (any rank's non-finite value skips the step everywhere), so DDP never waits for a backward
that one rank skipped. The counters travel in checkpoints (:meth:`NonFiniteGuard.nonfinite_state`).

:func:`call_with_timeout` bounds the time of a judge or oracle call (an API-backed judge that hangs must not hang
the run): the caller substitutes its documented default and counts the timeout.

:func:`require_trainable_tensors` refuses a checkpoint that lacks a trainable tensor (the modules save only what
trains, and load non-strictly so that the frozen base is reloaded from its path, not read from the checkpoint).

:func:`reset_stale_epoch_metrics` keeps a module's persistent per-epoch metrics right across a resume: an end-of-epoch
checkpoint holds the finished epoch's running sums (Lightning resets them only after the save), which must not leak
into the next epoch, while a mid-epoch checkpoint's sums must be kept.

Stopping raises ``RuntimeError``: Lightning then writes no checkpoint (``CheckpointOnSigterm`` saves on SIGTERM
only), so the last periodic checkpoint, from before the failing streak, stays as it was.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["NonFiniteGuard", "call_with_timeout", "require_trainable_tensors", "reset_stale_epoch_metrics"]


def require_trainable_tensors(checkpoint: dict[str, Any], trainable: set[str]) -> None:
    """Raise naming the first missing names when ``checkpoint["state_dict"]`` lacks any of ``trainable``.

    A checkpoint without a ``state_dict`` is one whose strategy keeps the weights in its own files and has restored
    them itself before this hook (Lightning's DeepSpeed strategy: the engine loads each rank's ZeRO shards and passes
    only the rest of the checkpoint): nothing to check here.

    Raises:
        KeyError: listing up to five missing tensor names.
    """
    if "state_dict" not in checkpoint:
        return
    missing = sorted(trainable - set(checkpoint["state_dict"]))
    if missing:
        raise KeyError(f"checkpoint lacks trainable tensors: {missing[:5]}{' …' if len(missing) > 5 else ''}")


def reset_stale_epoch_metrics(trainer: Any, metrics: Any) -> bool:
    """Reset ``metrics`` (torchmetrics, persistent) at the start of a training epoch unless it resumes mid-epoch.

    Call from ``on_train_epoch_start``. Lightning calls that hook before the epoch loop resets its batch counter,
    which then holds the batches of this epoch already trained: between 0 and the epoch's length when a mid-epoch
    checkpoint was loaded (the sums belong to this epoch: kept), else 0 (a fresh start) or the previous epoch's
    length (a new epoch, uninterrupted or resumed from an end-of-epoch checkpoint whose sums are the finished
    epoch's: reset). Returns whether it reset.
    """
    done = trainer.fit_loop.epoch_loop.batch_progress.current.completed
    if 0 < done < trainer.num_training_batches:
        return False
    for metric in metrics:
        metric.reset()
    return True


def call_with_timeout(fn: Callable[..., Any], timeout_s: float | None, *args: Any, **kwargs: Any) -> tuple[Any, bool]:
    """``(fn(*args, **kwargs), False)``, or ``(None, True)`` when the call has not returned within ``timeout_s``.

    With ``timeout_s=None`` the call runs directly in this thread. Otherwise it runs in a daemon worker thread; a
    thread cannot be killed in Python, so a late call is abandoned: it finishes in the background (a daemon never
    keeps the process alive) and its result is dropped. Use it for calls that wait on something outside (an API,
    a subprocess); an in-process model should bound itself instead (``generate(max_time=...)``, as
    :class:`modules.scorers.judges.HFJudge` does), since an abandoned forward pass would keep computing. An exception
    raised by ``fn`` in time propagates unchanged: a bug is not a timeout.

    Raises:
        ValueError: ``timeout_s`` is not a positive finite number or ``None``.

    Example:
        >>> call_with_timeout(sum, 5.0, [1, 2])
        (3, False)
        >>> import time
        >>> call_with_timeout(time.sleep, 0.01, 1.0)
        (None, True)
    """
    if timeout_s is None:
        return fn(*args, **kwargs), False
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (0 < timeout_s < math.inf):
        raise ValueError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = err

    worker = threading.Thread(target=run, name=f"timeout:{getattr(fn, '__name__', 'call')}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return None, True
    if "error" in box:
        raise box["error"]
    return box["result"], False


class NonFiniteGuard:
    """Mixin: call ``check_finite(values, what)`` before an update; counts skipped steps, stops after too many.

    Call :meth:`init_nonfinite_guard` in ``__init__``. Logs ``train/nonfinite_skipped`` (the running total) when a
    step is skipped, and warns with the step and the number of bad values.
    """

    nonfinite_skipped: int
    consecutive_nonfinite: int
    max_consecutive_nonfinite: int

    def init_nonfinite_guard(self, max_consecutive_nonfinite: int) -> None:
        """Set the limit and zero the counters.

        Raises:
            ValueError: if the limit is not a positive integer.
        """
        if isinstance(max_consecutive_nonfinite, bool) or int(max_consecutive_nonfinite) != max_consecutive_nonfinite:
            raise ValueError(f"max_consecutive_nonfinite must be an integer, got {max_consecutive_nonfinite!r}")
        if max_consecutive_nonfinite < 1:
            raise ValueError(f"max_consecutive_nonfinite must be at least 1, got {max_consecutive_nonfinite}")
        self.max_consecutive_nonfinite = int(max_consecutive_nonfinite)
        self.nonfinite_skipped = 0
        self.consecutive_nonfinite = 0

    def check_finite(self, values: Tensor, what: str) -> bool:
        """``True`` when every value (on every rank) is finite; else count, log, warn and return ``False``.

        Raises:
            RuntimeError: when this is the ``max_consecutive_nonfinite``-th skipped step in a row.
        """
        bad = int((~torch.isfinite(values.detach())).sum())
        ok = bad == 0
        trainer = getattr(self, "_trainer", None)
        if trainer is not None:
            ok = trainer.strategy.reduce_boolean_decision(ok, all=True)
        if ok:
            self.consecutive_nonfinite = 0
            return True
        self.nonfinite_skipped += 1
        self.consecutive_nonfinite += 1
        step = trainer.global_step if trainer is not None else -1
        if trainer is not None:
            self.log("train/nonfinite_skipped", float(self.nonfinite_skipped), batch_size=1)  # type: ignore[attr-defined]
        warnings.warn(
            f"step {step}: {bad} of {values.numel()} {what} are NaN or inf; the update is skipped "
            f"({self.consecutive_nonfinite} in a row)",
            stacklevel=2,
        )
        if self.consecutive_nonfinite >= self.max_consecutive_nonfinite:
            raise RuntimeError(
                f"{self.consecutive_nonfinite} consecutive steps had non-finite {what}; stopping. "
                "The last checkpoint holds the last good state (resume from it after fixing the cause)."
            )
        return False

    def nonfinite_state(self) -> dict[str, int]:
        """The counters, for ``on_save_checkpoint``."""
        return {"nonfinite_skipped": self.nonfinite_skipped, "consecutive_nonfinite": self.consecutive_nonfinite}

    def load_nonfinite_state(self, state: dict[str, Any] | None) -> None:
        """Restore the counters from :meth:`nonfinite_state` (missing entries stay as they are)."""
        for key in ("nonfinite_skipped", "consecutive_nonfinite"):
            if state and key in state:
                setattr(self, key, int(state[key]))
