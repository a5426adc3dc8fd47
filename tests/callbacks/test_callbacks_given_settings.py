"""A resume with other optimizer settings trains with them: ``GivenOptimizerSettings`` after Lightning's restore."""

from __future__ import annotations

import lightning as L
import torch
from helpers.callback_helpers import make_trainer

from alignment_games.callbacks.given_settings import GivenOptimizerSettings


def _factor(step: int) -> float:
    return 1.0 / (1.0 + step)


class _Scheduled(L.LightningModule):
    """One linear layer, AdamW at ``lr`` with ``weight_decay``, the rate scaled by ``1 / (1 + step)`` each step."""

    def __init__(self, lr: float, weight_decay: float) -> None:
        super().__init__()
        self.lr, self.weight_decay = lr, weight_decay
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).pow(2).mean()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(8, 2), batch_size=2)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _trainer(tmp_path, steps: int, callbacks=()) -> L.Trainer:
    return make_trainer(tmp_path, list(callbacks), max_steps=steps, max_epochs=None)


def test_a_resume_takes_the_given_rate_and_weight_decay_and_keeps_the_schedule_position(tmp_path):
    first = _trainer(tmp_path, 2)
    first.fit(_Scheduled(lr=0.1, weight_decay=0.01))
    first.save_checkpoint(tmp_path / "a.ckpt")
    # resumed with a new rate and weight decay, one step: the schedule stepped twice before, three times after it
    trainer = _trainer(tmp_path, 3, [GivenOptimizerSettings()])
    trainer.fit(_Scheduled(lr=0.5, weight_decay=0.2), ckpt_path=tmp_path / "a.ckpt")
    ((group,),) = [opt.param_groups for opt in trainer.optimizers]
    assert group["lr"] == 0.5 * _factor(3) and group["initial_lr"] == 0.5 and group["weight_decay"] == 0.2
    assert trainer.lr_scheduler_configs[0].scheduler.base_lrs == [0.5]
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 3  # the restored position went on
    assert {float(s["step"]) for s in trainer.optimizers[0].state.values()} == {3.0}  # the stored moments went on
    # without the callback Lightning's restore keeps the stored rate and decay
    plain = _trainer(tmp_path, 3)
    plain.fit(_Scheduled(lr=0.5, weight_decay=0.2), ckpt_path=tmp_path / "a.ckpt")
    ((group,),) = [opt.param_groups for opt in plain.optimizers]
    assert group["lr"] == 0.1 * _factor(3) and group["weight_decay"] == 0.01
