"""A datamodule of dummy step indices, so the trainer's loop drives modules that need no data (e.g. tabular SMIDA)."""

from __future__ import annotations

import lightning as L
from torch.utils.data import DataLoader

from alignment_games.datamodules.resumable import ResumableDataLoader


class StepDataModule(L.LightningDataModule):
    """Yields the integers ``0 … steps_per_epoch − 1`` as training batches, one per step.

    Args:
        steps_per_epoch: Training steps in one epoch; ``max_steps`` may span several epochs.

    Raises:
        ValueError: for ``steps_per_epoch < 1``.
    """

    def __init__(self, steps_per_epoch: int = 100) -> None:
        super().__init__()
        if isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int) or steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be an int >= 1, got {steps_per_epoch!r}")
        self.steps_per_epoch = steps_per_epoch
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        """One plain int index per batch, in order; resumable mid-epoch."""
        return ResumableDataLoader(range(self.steps_per_epoch), batch_size=None, shuffle=False)
