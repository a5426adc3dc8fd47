"""The run's resolved config recorded in every checkpoint, so a resume can tell whether it continues the same run."""

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

#: the checkpoint keys (also in ``alignment_games.modules.checkpoints``: callbacks import nothing from modules)
RUN_CONFIG_KEY = "run_config"
RUN_INPUTS_KEY = "run_inputs"  # the identities of the run's inputs


class RunConfigRecord(Callback):
    """Write ``config_yaml`` (the resolved config) and ``inputs`` (what the run reads) into checkpoints, for resumes.

    Args:
        config_yaml: The resolved config, under ``checkpoint["run_config"]``.
        inputs: The sha256 of each model folder and file the run reads, by config key, under
            ``checkpoint["run_inputs"]`` (``alignment_games.modules.checkpoints.run_identity.run_inputs``).

    Raises:
        TypeError: when ``config_yaml`` is not a string or ``inputs`` not a dict.
    """

    def __init__(self, config_yaml: str, inputs: dict[str, Any] | None = None) -> None:
        super().__init__()
        if not isinstance(config_yaml, str):
            raise TypeError(f"config_yaml: YAML text expected, got {type(config_yaml).__name__}")
        if not isinstance(inputs, (dict, type(None))):
            raise TypeError(f"inputs: a dict expected, got {type(inputs).__name__}")
        self.config_yaml = config_yaml
        self.inputs = {} if inputs is None else inputs

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[RUN_CONFIG_KEY] = self.config_yaml
        checkpoint[RUN_INPUTS_KEY] = {key: dict(identity) for key, identity in self.inputs.items()}
