"""Matthews correlation of a binary judge against the truth, with its trend over evaluations."""

from typing import Any

import lightning.pytorch as pl
import torch
from torchmetrics.classification import BinaryStatScores
from typing_extensions import override

from alignment_games.callbacks.functional import least_squares_slope, matthews_corrcoef_from_counts
from alignment_games.callbacks.hooks import EvaluationBatchCallback
from alignment_games.callbacks.items import ItemRecords, read_step_outputs

_STAGES = ("train", "val", "test")


def _evaluation_stage(trainer: pl.Trainer) -> str:
    """``"test"`` inside ``trainer.test``, else ``"val"`` (validation, sanity check included)."""
    return "test" if trainer.testing else "val"


class MCCTracker(EvaluationBatchCallback):
    r"""Matthews correlation of a binary judge with the truth per epoch, and its trend (debate RLAIF, "Metrics").

    Reward hacking shows as MCC falling, hence the slope over the last ``trend_window`` evaluations. The ``stage``'s
    step returns the verdicts (bool, 0/1 or probabilities) and the truth in a mapping; with ``id_key`` each item counts
    once across ranks. Logs ``{stage}/{name}``, ``_trend``, ``_accept_rate`` and ``_tp``/``_fp``/``_tn``/``_fn``.

    Args:
        prediction_key: key of the judge's verdicts in the step's output mapping.
        target_key: key of the truth in the step's output mapping.
        stage: ``"val"``, ``"train"`` or ``"test"``: which steps and epochs to track.
        trend_window: number of most recent evaluations the slope is fitted on (>= 2).
        threshold: probability above which a floating verdict counts as accepting.
        name: metric name inside the stage namespace, and part of :attr:`state_key`.
        id_key: key of the verdicts' integer item ids in the step's output; ``None`` counts every verdict.

    Raises:
        ValueError: on an unknown ``stage``, ``trend_window < 2`` or ``threshold`` outside [0, 1]; during the run,
            if the verdicts, the truth and the item ids differ in size.
        RuntimeError: during the run, if the step's output is not a mapping holding the keys.
    """

    def __init__(
        self,
        prediction_key: str,
        target_key: str,
        stage: str = "val",
        trend_window: int = 5,
        threshold: float = 0.5,
        name: str = "mcc",
        id_key: str | None = None,
    ) -> None:
        super().__init__()
        if stage not in _STAGES:
            raise ValueError(f"`stage` must be one of {_STAGES}, got {stage!r}.")
        if trend_window < 2:
            raise ValueError(f"`trend_window` must be >= 2 (a slope needs two points), got {trend_window}.")
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"`threshold` must lie in [0, 1], got {threshold}.")
        self.prediction_key, self.target_key, self.stage = prediction_key, target_key, stage
        self.trend_window, self.threshold, self.name, self.id_key = int(trend_window), float(threshold), name, id_key
        self.counts = BinaryStatScores(validate_args=False)
        self.items = ItemRecords(("preds", "target"))
        # With `id_key`: the records of a running training epoch restored from a checkpoint (unique across ranks).
        self._offset_items: dict[str, list[float]] = {}
        # Counts restored from a mid-epoch checkpoint (already summed over ranks), added to the epoch's total.
        self._offset = [0, 0, 0, 0]
        self.history: list[dict[str, float]] = []

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(stage=self.stage, name=self.name)

    @property
    def last(self) -> dict[str, float] | None:
        """Values logged at the last evaluation (``None`` before the first)."""
        return self.history[-1] if self.history else None

    def _start(self, pl_module: pl.LightningModule) -> None:
        self.counts = self.counts.to(pl_module.device)
        self.counts.reset()
        self.items.reset()

    def _update(self, trainer: pl.Trainer, outputs: Any) -> None:
        if trainer.sanity_checking:
            return
        wanted = {self.prediction_key: "verdicts", self.target_key: "truth values"}
        if self.id_key is not None:
            wanted[self.id_key] = "item ids"
        step = {"train": "training_step", "val": "validation_step", "test": "test_step"}[self.stage]
        values = read_step_outputs(outputs, wanted, "MCCTracker", step)
        preds, target = values[self.prediction_key], values[self.target_key]
        if preds.numel() == 0:
            return
        # Threshold here rather than in torchmetrics: its logit check on floats reads a value back from the device.
        preds = (preds > self.threshold).long() if preds.is_floating_point() else preds.long()
        if self.id_key is not None:
            self.items.update(values[self.id_key].to(preds.device), preds=preds, target=target.to(preds.device))
            return
        self.counts.update(preds.detach().to(self.counts.tp.device), target.detach().long().to(self.counts.tp.device))

    def _unique_items(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The epoch's records from every rank (a collective), each item once, restored ones first."""
        return self.items.compute(self.counts.tp.device, extra=self._offset_items)

    def _synced_counts(self) -> list[int]:
        if self.id_key is not None:
            _, v = self._unique_items()
            preds, target = v["preds"] > 0, v["target"] > 0
            cells = [preds & target, preds & ~target, ~preds & ~target, ~preds & target]
            return [int(x) for x in torch.stack([c.sum() for c in cells]).tolist()]
        # `sync_context` sums the count states over ranks (a no-op on one process) and restores the local ones.
        with self.counts.sync_context(should_unsync=True):
            local = [self.counts.tp, self.counts.fp, self.counts.tn, self.counts.fn]
            values = torch.stack([t.reshape(-1).sum() for t in local]).tolist()
        return [int(v) + o for v, o in zip(values, self._offset)]

    def _end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        tp, fp, tn, fn = self._synced_counts()
        self.counts.reset()
        self.items.reset()
        self._offset = [0, 0, 0, 0]
        self._offset_items = {}
        total = tp + fp + tn + fn
        mcc = matthews_corrcoef_from_counts(tp, fp, tn, fn)
        recent = [h["mcc"] for h in self.history[-(self.trend_window - 1) :]] + [mcc]
        values = {"mcc": mcc, "trend": least_squares_slope(recent), "accept_rate": (tp + fp) / total if total else 0.0}
        values.update(tp=float(tp), fp=float(fp), tn=float(tn), fn=float(fn))
        self.history.append({**values, "step": float(trainer.global_step)})
        prefix = f"{self.stage}/{self.name}"
        logged = {prefix if key == "mcc" else f"{prefix}_{key}": value for key, value in values.items()}
        # Identical on every rank; "max" makes Lightning's epoch-level reduction exact (and silences its warning).
        sync = trainer.world_size > 1
        pl_module.log_dict(logged, on_step=False, on_epoch=True, sync_dist=sync, reduce_fx="max", batch_size=1)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Once per fit, after any checkpoint was restored: counts of a resumed epoch live in `_offset`.
        if self.stage == "train":
            self._start(pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.stage == "train":
            self._update(trainer, outputs)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.stage == "train":
            self._end(trainer, pl_module)

    # Validation and test share their hooks: the running loop tells which of the two stages it is.

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.stage == _evaluation_stage(trainer):
            self._start(pl_module)

    @override
    def on_evaluation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        if self.stage == _evaluation_stage(trainer):
            self._update(trainer, outputs)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.stage == _evaluation_stage(trainer):
            self._end(trainer, pl_module)

    on_test_epoch_start = on_validation_epoch_start
    on_test_batch_end = EvaluationBatchCallback.on_validation_batch_end
    on_test_epoch_end = on_validation_epoch_end

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Runs on every rank: store the running training epoch's counts, summed over ranks, for a mid-epoch resume.
        if self.stage == "train" and self.state_key in checkpoint.get("callbacks", {}):
            state = checkpoint["callbacks"][self.state_key]
            if self.id_key is not None:  # the records themselves, so a repeat after the resume is still dropped
                ids, v = self._unique_items()
                state["partial_items"] = {"ids": ids.tolist(), **{k: x.tolist() for k, x in v.items()}}
            else:
                state["partial_counts"] = self._synced_counts()

    @override
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"history": [dict(h) for h in self.history], "partial_counts": list(self._offset)}
        if self.id_key is not None:
            state["partial_items"] = {k: list(v) for k, v in self._offset_items.items()}
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [dict(h) for h in state_dict["history"]]
        self.counts.reset()
        self.items.reset()
        self._offset = [int(c) for c in state_dict.get("partial_counts", [0, 0, 0, 0])]
        self._offset_items = {k: list(v) for k, v in state_dict.get("partial_items", {}).items()}
