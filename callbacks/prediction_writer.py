"""Write whatever ``predict_step`` returns (a list of dicts per batch) as jsonl rows in the run's log folder."""

import json
import os
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override


class JsonlPredictionWriter(BasePredictionWriter):
    """Append each row ``predict_step`` returns (a list of dicts) to ``<log_dir>/<filename>``, one file per rank.

    Args:
        filename: File name inside the trainer's log folder, or an absolute path.
    """

    def __init__(self, filename: str = "predictions.jsonl") -> None:
        super().__init__(write_interval="batch")
        self.filename = filename
        self._handle = None
        self.path: str | None = None

    @override
    def on_predict_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        base = os.path.join(trainer.log_dir or trainer.default_root_dir, self.filename)  # an absolute one stays
        if trainer.world_size > 1:
            root, ext = os.path.splitext(base)
            base = f"{root}.rank{trainer.global_rank}{ext}"
        os.makedirs(os.path.dirname(base) or ".", exist_ok=True)
        self.path = base
        self._handle = open(base, "w")

    @override
    def write_on_batch_end(self, trainer, pl_module, prediction: Any, batch_indices, batch, batch_idx, dataloader_idx):
        for row in prediction:
            self._handle.write(json.dumps(row) + "\n")
        self._handle.flush()

    @override
    def on_predict_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
            rank_zero_info(f"predictions written to {self.path}")
