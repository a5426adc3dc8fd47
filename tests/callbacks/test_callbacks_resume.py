"""Stop mid-run, resume with ``ckpt_path``: every callback must continue exactly as if never stopped."""

import shutil
import warnings

import pytest
import torch
from helpers.callback_helpers import GameModule, all_callbacks, callback_states, make_trainer
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from alignment_games.callbacks import EloRating, MCCTracker, PeakCheckpoint, TwoTimescaleWarmup

EPOCHS = 3  # 12 training batches per epoch, two optimizer steps per batch


class StateProbe(Callback):
    """Records the suite's callback states once training starts, i.e. after the checkpoint was restored."""

    def __init__(self):
        self.at_train_start = None

    def on_train_start(self, trainer, pl_module):
        self.at_train_start = callback_states(trainer)


def fit(root, peak_dir, ckpt_path=None, max_epochs=EPOCHS):
    module = GameModule(degenerate_epochs=(1,))
    probe = StateProbe()
    checkpoints = [
        ModelCheckpoint(dirpath=root / "steps", every_n_train_steps=10, save_top_k=-1),
        ModelCheckpoint(dirpath=root / "epochs", filename="{epoch}", every_n_epochs=1, save_top_k=-1),
    ]
    trainer = make_trainer(
        root, [*all_callbacks(peak_dir), *checkpoints, probe], max_epochs=max_epochs, enable_checkpointing=True
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # mid-epoch resumption and manual-optimization checkpoint notices
        trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, module, probe


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    trainer, module, _ = fit(root, root / "peak")
    shutil.copy(root / "peak" / "peak.ckpt", root / "peak.ckpt")  # later runs overwrite the peak file
    return root, callback_states(trainer), module.lr_history


def test_the_reference_run_exercises_every_callback(uninterrupted):
    root, states, lr_history = uninterrupted
    by_type = {key.split("{")[0]: state for key, state in states.items()}
    assert set(by_type) == {"TwoTimescaleWarmup", "EloRating", "MCCTracker", "PeakCheckpoint"}
    assert by_type["TwoTimescaleWarmup"]["batches_seen"] == 36 == len(lr_history)
    elo = states[EloRating(["alice", "bob", "carol"]).state_key]
    assert sum(elo["games"]) == 72 and len(set(elo["ratings"])) == 3
    assert len(states[MCCTracker("judge", "truth").state_key]["history"]) == EPOCHS
    assert len(states[MCCTracker("judge", "truth", stage="train", name="judge_mcc").state_key]["history"]) == EPOCHS
    assert len(states[PeakCheckpoint("val/correct", "val/total").state_key]["evaluations"]) == EPOCHS


@pytest.mark.parametrize(
    ("checkpoint", "batches_done", "running_epoch_batches"),
    [
        ("steps/epoch=1-step=30.ckpt", 15, 3),  # mid-epoch: after batch 3 of 12 of the second epoch
        ("epochs/epoch=0.ckpt", 12, 0),  # saved at the end of the first training epoch
        ("peak.ckpt", 36, 12),  # the peak, saved at validation end: before the training epoch ends
    ],
)
def test_resume_restores_and_continues_every_callback_exactly(
    uninterrupted, tmp_path, checkpoint, batches_done, running_epoch_batches
):
    root, final_states, lr_history = uninterrupted
    ckpt_path = root / checkpoint
    saved = torch.load(ckpt_path, weights_only=False)
    assert saved["global_step"] == 2 * batches_done

    trainer, module, probe = fit(tmp_path, root / "peak", ckpt_path=ckpt_path)

    # 1. Right after the restore, every callback holds exactly the state written in the checkpoint.
    assert probe.at_train_start == {key: saved["callbacks"][key] for key in probe.at_train_start}
    warmup_key = TwoTimescaleWarmup(1.0, 2.0, 0.1, 1).state_key
    assert probe.at_train_start[warmup_key]["batches_seen"] == batches_done
    train_mcc_key = MCCTracker("judge", "truth", stage="train", name="judge_mcc").state_key
    partial = saved["callbacks"][train_mcc_key]["partial_counts"]
    assert sum(partial) == 4 * running_epoch_batches  # the running epoch's counts travel with the checkpoint

    # 2. At the end, every callback is in the uninterrupted run's state, number for number.
    assert callback_states(trainer) == final_states
    # 3. The warm-up picked up its schedule where it stopped.
    assert module.lr_history == lr_history[batches_done:]


def test_stopped_run_resumes_to_the_same_end(uninterrupted, tmp_path):
    root, final_states, _ = uninterrupted
    stopped, _, _ = fit(tmp_path / "first", root / "peak", max_epochs=1)
    last = tmp_path / "first" / "epochs" / "epoch=0.ckpt"
    assert callback_states(stopped) == {
        key: value for key, value in torch.load(last, weights_only=False)["callbacks"].items() if key in final_states
    }
    resumed, _, _ = fit(tmp_path / "second", root / "peak", ckpt_path=last)
    assert callback_states(resumed) == final_states
