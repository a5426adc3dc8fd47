"""A callback that writes the state a run ends with, for the outside-kill harness to compare.

Lightning's ``ModelCheckpoint(save_last=True)`` writes ``last.ckpt`` at the end of training only when the process
has not written one before (``on_train_end`` checks ``_last_checkpoint_saved``), so a finished run's ``last.ckpt``
holds its final state or that of its last periodic save, depending on which process of a chain ran the end.
"""

from __future__ import annotations

import os

from lightning.pytorch.callbacks import Callback


class FinalState(Callback):
    """Write ``<logger folder>/checkpoints/final.ckpt`` with ``trainer.save_checkpoint`` when training ends."""

    def on_train_end(self, trainer, pl_module):
        folder = trainer.logger.log_dir if trainer.logger is not None else trainer.default_root_dir
        trainer.save_checkpoint(os.path.join(folder, "checkpoints", "final.ckpt"))
