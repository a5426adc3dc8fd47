"""Progress bars whose training line counts what ends the run: epochs of ``max_epochs``, steps of ``max_steps``."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE
from typing_extensions import override

__all__ = ["StepsRichProgressBar", "StepsTQDMProgressBar", "progress_bar", "train_description"]


def train_description(trainer: pl.Trainer, epoch: int | None = None) -> str:
    """The training line's label: ``Epoch e[/last epoch][, step s/max_steps]``, only the limits that are set."""
    text = f"Epoch {trainer.current_epoch if epoch is None else epoch}"
    if trainer.max_epochs is not None and trainer.max_epochs > 0:
        text += f"/{trainer.max_epochs - 1}"
    if trainer.max_steps > 0:
        text += f", step {trainer.global_step}/{trainer.max_steps}"
    return text


class StepsTQDMProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar labelled with :func:`train_description`."""

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description(train_description(trainer))

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.train_progress_bar.set_description(train_description(trainer), refresh=False)  # drawn by the update
        super().on_train_batch_end(trainer, pl_module, *args)


class StepsRichProgressBar(RichProgressBar):
    """Lightning's rich bar labelled with :func:`train_description`."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        text = train_description(self.trainer, current_epoch)
        # as Lightning pads: the training and validation labels of one width, so the bars do not jump
        return f"{text:{len(self.validation_description)}}"

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.progress is not None and self.train_progress_bar_id is not None:
            label = self._get_train_description(trainer.current_epoch)
            self.progress.update(self.train_progress_bar_id, description=label)  # drawn by the update
        super().on_train_batch_end(trainer, pl_module, *args)


def progress_bar() -> ProgressBar:
    """The bar Lightning would choose (rich when installed, else tqdm), labelled with :func:`train_description`."""
    return StepsRichProgressBar() if _RICH_AVAILABLE else StepsTQDMProgressBar()
