"""Continue from a checkpoint with the config's optimizer settings: its rates, not the ones the checkpoint stored.

Lightning restores ``param_groups`` with each optimizer's state; moments and loop position stay the checkpoint's.
"""

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


def _settings(optimizer: Any) -> list[dict[str, Any]]:
    """Every parameter group's settings (all but its parameters)."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


class GivenOptimizerSettings(Callback):
    """After a resume, set every optimizer's parameter-group settings (``lr``, betas, weight decay …) to the config's.

    Under a learning-rate schedule the restored position in it is kept: a group's rate is the config's base rate
    (``initial_lr``) times the factor the restored schedule reached, and each scheduler's ``base_lrs`` become the
    config's.
    """

    def __init__(self) -> None:
        super().__init__()
        self._given: list[list[dict[str, Any]]] = []
        self._given_base_lrs: list[list[float] | None] = []

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._given = [_settings(opt) for opt in trainer.optimizers]  # built from the config, not yet restored
        self._given_base_lrs = [
            list(getattr(c.scheduler, "base_lrs", None) or []) or None for c in trainer.lr_scheduler_configs
        ]

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for optimizer, given in zip(trainer.optimizers, self._given, strict=True):
            for group, settings in zip(optimizer.param_groups, given, strict=True):
                restored_lr, restored_base = group.get("lr"), group.get("initial_lr")
                group.update(settings)
                if restored_base and "initial_lr" in settings:  # scheduled: keep the schedule's reached factor
                    group["lr"] = settings["initial_lr"] * restored_lr / restored_base
        for config, base_lrs in zip(trainer.lr_scheduler_configs, self._given_base_lrs, strict=True):
            if base_lrs is not None:
                config.scheduler.base_lrs = list(base_lrs)
