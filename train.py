"""Entry point of the suite: one LightningCLI in subclass mode for every model and data family.

    python train.py fit --config configs/preference_ensemble.yaml
    python train.py test --config configs/preference_ensemble.yaml --ckpt_path runs/.../checkpoints/last.ckpt
    python train.py fit --help                    # every option of every family, with its documentation
    python train.py fit --config configs/preference_ensemble.yaml --print_config

Logs go to TensorBoard under ``runs/`` by default (``tensorboard --logdir runs``); the resolved config is saved next
to the logs. After ``fit`` the held-out set is tested (``--test_after_fit false`` turns it off).
"""

from __future__ import annotations

import os
import sys

import lightning as L
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.model_helpers import is_overridden

ROOT = os.path.dirname(os.path.abspath(__file__))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


class AlignmentCLI(LightningCLI):
    """LightningCLI with ``--test_after_fit`` and TensorBoard as the default logger."""

    def add_arguments_to_parser(self, parser) -> None:  # noqa: D102
        parser.add_argument(
            "--test_after_fit",
            type=bool,
            default=True,
            help="After fit, run test on the datamodule's held-out set (best checkpoint when one is tracked).",
        )

    def after_fit(self) -> None:
        """Test on the held-out set with the best checkpoint (or the final weights) when the family has a test set."""
        if not self.config[self.subcommand].get("test_after_fit", True) or self.trainer.interrupted:
            return
        if not is_overridden("test_step", self.model) or not is_overridden("test_dataloader", self.datamodule):
            return
        ckpt = self.trainer.checkpoint_callback
        best = ckpt.best_model_path if ckpt is not None and getattr(ckpt, "best_model_path", "") else None
        self.trainer.test(self.model, datamodule=self.datamodule, ckpt_path=best, weights_only=False)


def main(args: list[str] | None = None, run: bool = True) -> AlignmentCLI:
    """Build (and by default run) the CLI; ``args`` replaces ``sys.argv[1:]`` (tests call it this way)."""
    return AlignmentCLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
        trainer_defaults={
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": "runs", "name": "default"},
            }
        },
    )


if __name__ == "__main__":
    main()
