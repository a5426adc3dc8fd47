"""Non-finite losses, utilities, rewards and gradients: skip the update, log and count it, stop after too many in a row.

Decisions are taken for all ranks together, so DDP never waits for a backward one rank skipped.
"""

import math
import threading
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from alignment_games.modules.algorithms.checks import require_at_least


def _local(tensor: Tensor) -> Tensor:
    """The local shard of a ``DTensor`` (FSDP2), the tensor itself otherwise: counting never runs a collective."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def count_nonfinite(tensors: Iterable[Tensor | None]) -> tuple[int, int]:
    """``(non-finite entries, entries)`` over the floating-point tensors given (``None`` and integers skipped).

    Example:
        >>> count_nonfinite([torch.tensor([1.0, float("nan")]), None, torch.tensor([float("inf")])])
        (2, 3)
    """
    counts: dict[torch.device, list[Tensor]] = {}
    total = 0
    for tensor in tensors:
        if tensor is None or not torch.is_floating_point(tensor):
            continue
        local = _local(tensor.detach())
        counts.setdefault(local.device, []).append((~torch.isfinite(local)).sum())
        total += local.numel()
    # one host sync per device, not one per tensor (a model has hundreds of gradient tensors)
    bad = sum(int(torch.stack(per_device).sum()) for per_device in counts.values())
    return bad, total


def nonfinite_entries(checkpoint: dict[str, Any], minus_inf_allowed: Iterable[str] = ()) -> list[str]:
    """Where a checkpoint's floating tensors (``state_dict``, then optimizer states) hold NaN or inf.

    ``-inf`` is allowed in the ``state_dict`` names ``minus_inf_allowed`` (log-probabilities of zero).
    """
    allowed = set(minus_inf_allowed)
    found = []
    for name, value in (checkpoint.get("state_dict") or {}).items():
        if isinstance(value, Tensor) and torch.is_floating_point(value):
            local = _local(value.detach())
            bad = local.isnan() | (local == math.inf) if name in allowed else ~torch.isfinite(local)
            if bool(bad.any()):
                found.append(f"state_dict[{name!r}]")
    for i, opt in enumerate(checkpoint.get("optimizer_states") or []):
        for param, state in ((opt or {}).get("state") or {}).items() if isinstance(opt, dict) else ():
            for key, value in (state or {}).items() if isinstance(state, dict) else ():
                if isinstance(value, Tensor) and count_nonfinite([value])[0]:
                    found.append(f"optimizer_states[{i}].state[{param}][{key!r}]")
    return found


def refuse_nonfinite_checkpoint(checkpoint: dict[str, Any], family: str) -> None:
    """Raise when the checkpoint's weights or optimizer moments hold NaN or inf (end of ``on_save_checkpoint``).

    Raises:
        RuntimeError: naming the first tensors with non-finite values.
    """
    if found := nonfinite_entries(checkpoint):
        raise RuntimeError(
            f"{family}: refusing to write a checkpoint whose tensors hold NaN or inf: {found[:5]}"
            f"{' …' if len(found) > 5 else ''}. Resume from the previous checkpoint, which was written before the "
            "values went bad."
        )


def reset_stale_epoch_metrics(trainer: Any, metrics: Any) -> bool:
    """Reset ``metrics`` in ``on_train_epoch_start`` unless resuming mid-epoch (sums kept); return whether it did."""
    done = trainer.fit_loop.epoch_loop.batch_progress.current.completed
    if 0 < done < trainer.num_training_batches:
        return False
    for metric in metrics:
        metric.reset()
    return True


def forget_earlier_step_values(trainer: Any) -> int:
    """Drop step-only values earlier batches logged (``on_train_batch_start``); return how many.

    Lightning repeats such a value in later rows that do not log the key, which a mid-epoch resume cannot reproduce;
    dropping them makes each row hold what its own step logged, resumed or not.
    """
    results = getattr(trainer, "_results", None)
    dropped = 0
    for item in (results or {}).values():
        if item.is_tensor and item.meta.on_step and not item.meta.on_epoch and not item.has_reset:
            item.reset()
            dropped += 1
    return dropped


def call_with_timeout(fn: Callable[..., Any], timeout_s: float | None, *args: Any, **kwargs: Any) -> tuple[Any, bool]:
    """``(fn(*args, **kwargs), False)``, or ``(None, True)`` when a daemon thread has not returned in ``timeout_s``.

    Raises:
        ValueError: ``timeout_s`` is not a positive finite number or ``None``.
    """
    if timeout_s is None:
        return fn(*args, **kwargs), False
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (0 < timeout_s < math.inf):
        raise ValueError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as err:
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
    """Mixin: ``check_finite`` before an update counts, logs (``train/nonfinite_skipped``) and warns on a skip."""

    nonfinite_skipped: int
    consecutive_nonfinite: int
    max_consecutive_nonfinite: int

    def init_nonfinite_guard(self, max_consecutive_nonfinite: int) -> None:
        """Set the limit and zero the counters (call in ``__init__``).

        Raises:
            ValueError: if the limit is not a positive integer.
        """
        if isinstance(max_consecutive_nonfinite, bool) or int(max_consecutive_nonfinite) != max_consecutive_nonfinite:
            raise ValueError(f"max_consecutive_nonfinite must be an integer, got {max_consecutive_nonfinite!r}")
        require_at_least(max_consecutive_nonfinite=(max_consecutive_nonfinite, 1))
        self.max_consecutive_nonfinite = int(max_consecutive_nonfinite)
        self.nonfinite_skipped = self.consecutive_nonfinite = 0

    def check_finite(self, values: Tensor, what: str) -> bool:
        """``True`` when every value (on every rank) is finite; else count, log, warn and return ``False``.

        Raises:
            RuntimeError: when this is the ``max_consecutive_nonfinite``-th skipped step in a row.
        """
        return self._decide(*count_nonfinite([values]), what)

    def check_gradients(self, parameters: Iterable[Tensor], what: str = "gradients") -> bool:
        """``True`` when every gradient (on every rank) is finite; else count, log, warn, ``False`` (caller skips).

        Raises:
            RuntimeError: when this is the ``max_consecutive_nonfinite``-th skipped step in a row.
        """
        return self._decide(*count_nonfinite(p.grad for p in parameters), what)

    def record_update(self) -> None:
        """An update was applied: the skip streak ends, unless another optimizer of this batch was skipped."""
        key = self._batch_key()
        if key is None or key != getattr(self, "_last_skip_key", None):
            self.consecutive_nonfinite = 0

    def _batch_key(self) -> int | None:
        """Which training batch this is (Lightning's count of batches started), ``None`` outside a trainer."""
        trainer = getattr(self, "_trainer", None)
        return None if trainer is None else int(trainer.fit_loop.epoch_loop.batch_progress.total.ready)

    def _decide(self, bad: int, total: int, what: str) -> bool:
        trainer = getattr(self, "_trainer", None)
        if bad == 0 if trainer is None else trainer.strategy.reduce_boolean_decision(bad == 0, all=True):
            return True
        self.nonfinite_skipped += 1
        self.consecutive_nonfinite += 1
        self._last_skip_key = self._batch_key()
        step = trainer.global_step if trainer is not None else -1
        if trainer is not None:
            self.log("train/nonfinite_skipped", float(self.nonfinite_skipped), batch_size=1)  # type: ignore[attr-defined]
        warnings.warn(
            f"step {step}: {bad} of {total} {what} are NaN or inf; the update is skipped "
            f"({self.consecutive_nonfinite} in a row)",
            stacklevel=3,
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
        for key in set(state or ()) & {"nonfinite_skipped", "consecutive_nonfinite"}:
            setattr(self, key, int(state[key]))


class AutomaticStepGuard(NonFiniteGuard):
    """Mixin for automatic optimisation: non-finite gradients are dropped (``None``) before the step.

    A skipped step is taken back out of ``global_step``, so ``max_steps`` counts applied updates as under manual
    optimisation. Put it before ``LightningModule`` in the bases.
    """

    _gradients_dropped: bool = False

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Drop every gradient of ``optimizer`` when one is not finite (on any rank); count the skip."""
        super().on_before_optimizer_step(optimizer)  # type: ignore[misc]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not self.check_gradients(params):
            for p in params:
                p.grad = None
            self._gradients_dropped = True

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """Lightning's step; a skipped one (counted during it) is taken back out of ``global_step``."""
        skipped_before = self.nonfinite_skipped
        self._gradients_dropped = False
        optimizer.step(closure=optimizer_closure)
        if self.nonfinite_skipped == skipped_before and not self._gradients_dropped:
            self.record_update()
        elif (trainer := getattr(self, "_trainer", None)) is not None:
            # Lightning marks the step ready before this hook and completed after it: one off both keeps them equal
            progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step
            for tracker in (progress.total, progress.current):
                tracker.ready -= 1
                tracker.completed -= 1
