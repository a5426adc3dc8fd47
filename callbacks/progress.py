"""The console of a run: bars that count what ends it, a line every half minute, no known-harmless noise."""

import logging
import threading
import time
import warnings
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelSummary, ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table
from typing_extensions import override


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


class ProgressLines(Callback):
    """A console line every ``every`` seconds from ``setup`` to ``teardown``: the phase, the batch, where it writes.

    A bar redrawn in place shows nothing in a log file or a pipe, and stands still in a phase without batches (a
    family's end-of-test report); these lines do not. Rank zero only.
    """

    def __init__(self, every: float = 25.0) -> None:
        self.every, self.doing, self._stop = every, "setting up", None

    def _say(self, stop: threading.Event, where: str, start: float) -> None:
        while True:  # a first line at once: a run shorter than ``every`` still says where it writes
            minutes, seconds = divmod(int(time.monotonic() - start), 60)
            print(f"[{minutes}:{seconds:02d}] {self.doing}; writing to {where}", flush=True)
            if stop.wait(self.every):
                return

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        where = trainer.log_dir or trainer.default_root_dir  # a collective under DDP: every rank asks
        if trainer.is_global_zero and self._stop is None:
            stage = getattr(stage, "value", stage)  # Lightning passes a TrainerFn, whose str() is "TrainerFn.FITTING"
            self.doing, self._stop = f"{stage}: setting up", threading.Event()
            args = (self._stop, where, time.monotonic())
            threading.Thread(target=self._say, args=args, daemon=True, name="progress-lines").start()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._stop is not None:
            self._stop.set()
            self._stop = None

    on_exception = teardown  # type: ignore[assignment]

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.doing = f"fit: {train_description(trainer)}, batch {args[-1] + 1}/{trainer.num_training_batches}"

    def _evaluating(self, trainer: pl.Trainer, batch_idx: int, dataloader_idx: int = 0) -> None:
        stage = "sanity check" if trainer.sanity_checking else trainer.state.stage.value
        totals = trainer.num_sanity_val_batches if trainer.sanity_checking else None
        totals = totals or {"test": trainer.num_test_batches, "predict": trainer.num_predict_batches}.get(stage)
        total = (totals or trainer.num_val_batches)[dataloader_idx]
        self.doing = f"{stage}: batch {batch_idx + 1}/{total}"

    @override
    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._evaluating(trainer, *args[1:])

    on_test_batch_start = on_predict_batch_start = on_validation_batch_start  # type: ignore[assignment]

    @override
    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.doing = "test: after the last batch, the model's end-of-test work (metrics, report, figures)"


class CountedModelSummary(ModelSummary):
    """Lightning's model summary without its FLOPs column and total when nothing counted them (no example input)."""

    @staticmethod
    @override
    def summarize(summary_data, total_parameters, trainable_parameters, model_size, modes, total_flops, **kwargs):
        if total_flops:
            return ModelSummary.summarize(
                summary_data, total_parameters, trainable_parameters, model_size, modes, total_flops, **kwargs
            )
        data = [column for column in summary_data if column[0] != "FLOPs"]
        table = _format_summary_table(total_parameters, trainable_parameters, model_size, modes, 0, *data)
        text = "\n".join(line for line in table.splitlines() if not line.endswith("Total Flops"))
        logging.getLogger("lightning.pytorch.callbacks.model_summary").info("\n" + text)


def console_callbacks(callbacks: list, progress: bool = True, summary: bool = True) -> list[Callback]:
    """A run's console beside ``callbacks``: progress lines, a bar and a summary unless given or off.

    The bar is the one Lightning would choose (rich when installed, else tqdm), labelled with :func:`train_description`.
    """
    added: list[Callback] = [ProgressLines()] if progress else []
    if progress and not any(isinstance(c, ProgressBar) for c in callbacks):
        added.append(StepsRichProgressBar() if _RICH_AVAILABLE else StepsTQDMProgressBar())
    if summary and not any(isinstance(c, ModelSummary) for c in callbacks):
        added.append(CountedModelSummary())
    return added


def _not_an_advert(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(("💡 Tip", "Trainer already configured with model summary"))


def quiet_lightning_console() -> None:
    """Silence Lightning's known-harmless console lines, each for the reason given beside it."""
    # the families freeze encoders, reference policies and judges in eval mode on purpose (no dropout in what they
    # score or cache); Lightning restores each module's own mode after validation
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")
    # Lightning 2.6's pytree helper asks torch 2.13 a deprecated isinstance question: nothing a user can change
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    # adverts for Lightning's cloud services, and the note that our summary replaces Lightning's
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_not_an_advert)
