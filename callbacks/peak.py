"""Keep the checkpoint of the evaluation whose pooled Beta-posterior lower bound on accuracy is highest."""

import math
import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from alignment_games.callbacks.functional import pooled_lower_bound, posterior_mean
from alignment_games.callbacks.hooks import EvaluationBatchCallback
from alignment_games.callbacks.items import ItemRecords, read_step_outputs


class PeakCheckpoint(EvaluationBatchCallback):
    r"""Checkpoint the peak: the evaluation whose rolling window has the highest Beta-posterior lower bound (App. A).

    The module logs each evaluation's successes and trials as epoch sums named by the monitors, or returns per-item
    outcomes and ids (``success_key``, ``id_key``) so each item counts once across ranks. Only ``fit`` counts; rank 0
    decides. Logs ``{name}/lower_bound``, ``/step``, ``/epoch``, ``/value`` and ``/accuracy``.

    Args:
        monitor_correct: name of the logged number of successes of an evaluation (``None`` with ``success_key``).
        monitor_total: name of the logged number of trials of an evaluation (``None`` with ``success_key``).
        window: number of most recent evaluations pooled (the paper uses 3).
        quantile: posterior quantile used as the lower bound, in (0, 1).
        dirpath: directory of the peak checkpoint; default ``<trainer.log_dir>/checkpoints``.
        filename: file name of the peak checkpoint, without ``.ckpt``.
        name: namespace of the logged keys and part of :attr:`state_key`.
        verbose: report each new peak with ``rank_zero_info``.
        success_key: key of the per-item outcomes (bool or 0/1) in ``validation_step``'s output, instead of monitors.
        id_key: key of the outcomes' integer item ids in the same mapping (needed with ``success_key``).

    Raises:
        ValueError: for ``window < 1``, ``quantile`` outside (0, 1), not exactly one way of counting; in the run, for
            counts not ``0 <= correct <= total`` or outcomes and ids of different sizes.
        RuntimeError: during the run, if a monitored metric was not logged or the step's output lacks a key.
    """

    FILE_EXTENSION = ".ckpt"

    def __init__(
        self,
        monitor_correct: str | None = None,
        monitor_total: str | None = None,
        window: int = 3,
        quantile: float = 0.025,
        dirpath: str | os.PathLike | None = None,
        filename: str = "peak",
        name: str = "peak",
        verbose: bool = False,
        success_key: str | None = None,
        id_key: str | None = None,
    ) -> None:
        super().__init__()
        monitors = monitor_correct is not None and monitor_total is not None
        if (success_key is None) != (id_key is None):
            raise ValueError(f"`success_key` and `id_key` go together, got {success_key!r} and {id_key!r}.")
        if monitors == (success_key is not None) or (not monitors and (monitor_correct or monitor_total)):
            raise ValueError(
                "Give either `monitor_correct` and `monitor_total` (logged sums) or `success_key` and `id_key`"
                f" (per-item outcomes); got monitor_correct={monitor_correct!r}, monitor_total={monitor_total!r},"
                f" success_key={success_key!r}, id_key={id_key!r}."
            )
        if window < 1:
            raise ValueError(f"`window` must be >= 1, got {window}.")
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"`quantile` must lie in (0, 1), got {quantile}.")
        self.monitor_correct, self.monitor_total = monitor_correct, monitor_total
        self.window, self.quantile = int(window), float(quantile)
        self.dirpath = None if dirpath is None else os.fspath(dirpath)
        self.filename, self.name, self.verbose = filename, name, verbose
        self.success_key, self.id_key = success_key, id_key
        self.items = ItemRecords(("success",))
        self.evaluations: list[dict[str, float]] = []
        self.peak: dict[str, Any] | None = None

    @property
    @override
    def state_key(self) -> str:
        if self.success_key is not None:
            return self._generate_state_key(success_key=self.success_key, id_key=self.id_key, name=self.name)
        return self._generate_state_key(
            monitor_correct=self.monitor_correct, monitor_total=self.monitor_total, name=self.name
        )

    @property
    def best_model_path(self) -> str:
        """Path of the peak checkpoint ('' before the first evaluation)."""
        return self.peak["path"] if self.peak else ""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if (dirpath := self.dirpath) is None:
            dirpath = os.path.join(
                (trainer.log_dir if trainer.loggers else None) or trainer.default_root_dir, "checkpoints"
            )
        self.dirpath = trainer.strategy.broadcast(dirpath)

    def _counting(self, trainer: pl.Trainer) -> bool:
        """Whether this evaluation is one the callback reads (same answer on every rank)."""
        return not (trainer.sanity_checking or trainer.fast_dev_run or trainer.state.fn != TrainerFn.FITTING)

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.items.reset()

    @override
    def on_evaluation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        if self.success_key is None or not self._counting(trainer):
            return
        wanted = {self.success_key: "per-item outcomes", self.id_key: "item ids"}
        values = read_step_outputs(outputs, wanted, "PeakCheckpoint", "validation_step")
        success = values[self.success_key]
        self.items.update(values[self.id_key].to(success.device), success=success)

    def _read_items(self, pl_module: pl.LightningModule) -> tuple[float, float]:
        """Successes and trials of the evaluation's items from every rank, each item once (a collective)."""
        _, values = self.items.compute(pl_module.device)
        self.items.reset()
        success = values["success"]
        if bool(((success != 0) & (success != 1)).any()):
            raise ValueError(f"PeakCheckpoint: outcomes under {self.success_key!r} must be bool or 0/1.")
        return float(success.sum()), float(success.numel())

    def _read(self, trainer: pl.Trainer) -> tuple[float, float]:
        metrics = trainer.callback_metrics
        missing = [key for key in (self.monitor_correct, self.monitor_total) if key not in metrics]
        if missing:
            raise RuntimeError(
                f"PeakCheckpoint monitors {missing} but the module did not log it; logged metrics:"
                f" {sorted(metrics)}. Log the evaluation's successes and trials with reduce_fx='sum'."
            )
        # One read-back per evaluation; rank 0's values decide for everyone.
        correct, total = float(metrics[self.monitor_correct]), float(metrics[self.monitor_total])
        correct, total = trainer.strategy.broadcast((correct, total), src=0)
        if not (0.0 <= correct <= total and math.isfinite(total)):
            raise ValueError(
                f"PeakCheckpoint needs 0 <= {self.monitor_correct} <= {self.monitor_total}, got {correct} and {total}."
                " Log counts summed over the evaluation (reduce_fx='sum'), not means."
            )
        return correct, total

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._counting(trainer):
            return
        correct, total = self._read_items(pl_module) if self.success_key is not None else self._read(trainer)
        pairs = [(e["successes"], e["trials"]) for e in self.evaluations] + [(correct, total)]
        lower = pooled_lower_bound(pairs, self.window, self.quantile)
        recent = pairs[-self.window :]
        step, epoch = float(trainer.global_step), float(trainer.current_epoch)
        self.evaluations.append(
            {"successes": correct, "trials": total, "lower_bound": lower, "step": step, "epoch": epoch}
        )
        if self.peak is None or lower > self.peak["value"]:
            assert self.dirpath is not None
            self.peak = {
                "value": lower,
                "accuracy": posterior_mean(sum(s for s, _ in recent), sum(n for _, n in recent)),
                "step": trainer.global_step,
                "epoch": trainer.current_epoch,
                "evaluation": len(self.evaluations) - 1,
                "path": os.path.join(self.dirpath, self.filename + self.FILE_EXTENSION),
            }
            # the state above goes into the file, so the peak checkpoint knows it is the peak; full, so it resumes
            trainer.save_checkpoint(self.peak["path"], weights_only=False)
            if self.verbose:
                rank_zero_info(
                    f"PeakCheckpoint: new peak at step {trainer.global_step}: lower bound {lower:.4f} of the last"
                    f" {len(recent)} evaluation(s); saved {self.peak['path']}."
                )
        peak = {"lower_bound": lower, "value": self.peak["value"], "step": float(self.peak["step"])}
        peak.update(epoch=float(self.peak["epoch"]), accuracy=self.peak["accuracy"])
        metrics = {f"{self.name}/{k}": v for k, v in peak.items()}
        # The x-axis Lightning itself uses for logged metrics (as LearningRateMonitor does).
        step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "evaluations": [dict(e) for e in self.evaluations],
            "peak": None if self.peak is None else dict(self.peak),
            "dirpath": self.dirpath,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.evaluations = [dict(e) for e in state_dict["evaluations"]]
        self.peak = None if state_dict["peak"] is None else dict(state_dict["peak"])
