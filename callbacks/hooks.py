"""A callback base whose evaluation-batch hook takes only what the callbacks read of it."""

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


class EvaluationBatchCallback(Callback):
    """A ``Callback`` that answers the end of each validation batch with :meth:`on_evaluation_batch_end`.

    For test batches too, a subclass sets ``on_test_batch_end = EvaluationBatchCallback.on_validation_batch_end``.
    """

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self.on_evaluation_batch_end(trainer, pl_module, outputs)

    def on_evaluation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        """What the evaluation step returned for one batch (``outputs``); nothing by default."""
