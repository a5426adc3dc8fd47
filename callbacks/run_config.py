"""The run's resolved config recorded in every checkpoint, so a resume can tell whether it continues the same run."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

__all__ = ["RUN_CONFIG_KEY", "RunConfigRecord"]

#: the checkpoint key (also ``modules.checkpoints.trust.RUN_CONFIG_KEY``; callbacks import nothing from modules)
RUN_CONFIG_KEY = "run_config"


class RunConfigRecord(Callback):
    """Write ``config_yaml`` (the resolved config) under ``checkpoint["run_config"]``, checked on resume.

    Args:
        config_yaml: The resolved config.

    Raises:
        TypeError: when ``config_yaml`` is not a string.
    """

    def __init__(self, config_yaml: str) -> None:
        super().__init__()
        if not isinstance(config_yaml, str):
            raise TypeError(f"config_yaml: YAML text expected, got {type(config_yaml).__name__}")
        self.config_yaml = config_yaml

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[RUN_CONFIG_KEY] = self.config_yaml
