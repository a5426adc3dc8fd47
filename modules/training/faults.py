"""Non-finite losses, utilities and rewards: skip the update, log and count it, stop after too many in a row.

:meth:`NonFiniteGuard.check_finite` returning ``False`` means: return without an update. The decision is taken for
all ranks together, so DDP never waits for a backward that one rank skipped. Stopping raises ``RuntimeError``, after
which Lightning writes no checkpoint: the last periodic one, from before the failing streak, stays as it was.
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

    The modules save only what trains and load non-strictly. A checkpoint without a ``state_dict`` (DeepSpeed, whose
    engine restored its own shards) is not checked.

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

    Call from ``on_train_epoch_start``, where Lightning's batch counter still holds the batches of this epoch already
    trained: strictly between 0 and the epoch's length only after a mid-epoch resume (sums kept). Returns whether it
    reset (an end-of-epoch checkpoint holds the finished epoch's sums, which must not leak into the next).
    """
    done = trainer.fit_loop.epoch_loop.batch_progress.current.completed
    if 0 < done < trainer.num_training_batches:
        return False
    for metric in metrics:
        metric.reset()
    return True


def call_with_timeout(fn: Callable[..., Any], timeout_s: float | None, *args: Any, **kwargs: Any) -> tuple[Any, bool]:
    """``(fn(*args, **kwargs), False)``, or ``(None, True)`` when the call has not returned within ``timeout_s``.

    With ``timeout_s=None`` the call runs in this thread, else in a daemon thread that is abandoned when late (it
    cannot be killed), so use it for calls that wait on something outside (an API); an in-process model should bound
    itself (``generate(max_time=...)``). An exception raised by ``fn`` in time propagates unchanged.

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

    Call :meth:`init_nonfinite_guard` in ``__init__``. A skipped step logs ``train/nonfinite_skipped`` and warns.
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
