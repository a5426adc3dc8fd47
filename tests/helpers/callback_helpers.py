"""Shared helpers of the callback tests: a tiny two-player module, a one-player series module, a trainer factory,
a tensor that records host-device synchronisations, and a two-process DDP job.

Everything a callback observes here (duels, judge verdicts, truths, accuracy counts) is a deterministic function
of the epoch, the batch index, the sample index and the rank, never of the weights: a run resumed mid-epoch (whose
data order restarts) must then leave every callback in exactly the state of the uninterrupted run.

Run as a script (``python callback_helpers.py OUTDIR``) it is the DDP job of the tests: two CPU processes, every
callback, each rank writing its callbacks' states to ``OUTDIR/rank<r>.json``.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

REPO_ROOT = Path(__file__).resolve().parents[2]

from alignment_games.callbacks import EloRating, MCCTracker, PeakCheckpoint, TwoTimescaleWarmup  # noqa: E402

PLAYERS = ["alice", "bob", "carol"]


class IndexDataset(Dataset):
    """``size`` items ``{"x": features, "index": i}`` with fixed random features."""

    def __init__(self, size: int, features: int = 4, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, features, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "index": i}


def val_tables(epoch: int, size: int, degenerate_epochs: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Judge verdicts and truths (0/1 longs) of the whole validation set at ``epoch``.

    In a degenerate epoch every answer is correct (a single class in the truth), where MCC must be 0.
    """
    generator = torch.Generator().manual_seed(1000 + epoch)
    truth = (torch.rand(size, generator=generator) < 0.3 + 0.1 * (epoch % 4)).long()
    agree = torch.rand(size, generator=generator) < 0.8  # an informative but imperfect judge
    judge = torch.where(agree, truth, 1 - truth)
    if epoch in degenerate_epochs:
        truth = torch.ones_like(truth)
    return judge, truth


def train_labels(epoch: int, batch_idx: int, rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Judge verdicts and truths of one training batch of one rank."""
    generator = torch.Generator().manual_seed(10_000 * (rank + 1) + 100 * epoch + batch_idx)
    truth = (torch.rand(n, generator=generator) < 0.5).long()
    judge = torch.where(torch.rand(n, generator=generator) < 0.7, truth, 1 - truth)
    return judge, truth


def duel_of(epoch: int, batch_idx: int, rank: int) -> tuple[str, str, float]:
    """The duel a rank reports in one training batch: players and a score in {0, .25, .5, .75, 1}."""
    t = 100 * epoch + batch_idx
    a = PLAYERS[(t + rank) % 3]
    b = PLAYERS[(t + rank + 1) % 3]
    return a, b, ((7 * t + 3 * rank) % 5) / 4


class GameModule(pl.LightningModule):
    """A two-player game under manual optimization (like Lightning's GAN example), as small as it gets.

    The leader's optimizer has two parameter groups, the follower's one. ``training_step`` records the rates of
    every group, reports a duel to the :class:`EloRating` callback if there is one, and returns judge verdicts and
    truths; ``validation_step`` returns the validation tables and logs the summed accuracy counts of the answers.
    """

    def __init__(
        self,
        train_size: int = 48,
        val_size: int = 32,
        batch_size: int = 4,
        val_batch_size: int = 8,
        degenerate_epochs: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.leader = nn.Linear(4, 1)
        self.follower = nn.Linear(4, 1)
        self.train_size, self.val_size = train_size, val_size
        self.batch_size, self.val_batch_size = batch_size, val_batch_size
        self.degenerate_epochs = tuple(degenerate_epochs)
        self.lr_history: list[tuple[list[float], list[float]]] = []

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        leader = torch.optim.SGD(
            [{"params": self.leader.weight}, {"params": self.leader.bias, "momentum": 0.5}], lr=0.123
        )
        follower = torch.optim.SGD(self.follower.parameters(), lr=0.456)
        return [leader, follower]

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, torch.Tensor]:
        opt_leader, opt_follower = self.optimizers()
        optimizers = self.trainer.optimizers
        self.lr_history.append(tuple([g["lr"] for g in opt.param_groups] for opt in optimizers))
        x = batch["x"]
        # Zero-sum toy game: the leader descends what the follower ascends. One backward (DDP-friendly), then the
        # follower's gradients change sign.
        opt_leader.zero_grad()
        opt_follower.zero_grad()
        self.manual_backward((self.leader(x) * self.follower(x)).mean())
        for p in self.follower.parameters():
            p.grad.neg_()
        opt_leader.step()
        opt_follower.step()
        if any(isinstance(cb, EloRating) for cb in self.trainer.callbacks):
            EloRating.find(self.trainer).report(*duel_of(self.current_epoch, batch_idx, self.global_rank))
        judge, truth = train_labels(self.current_epoch, batch_idx, self.global_rank, len(x))
        return {"judge": judge, "truth": truth}

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, torch.Tensor]:
        judge, truth = val_tables(self.current_epoch, self.val_size, self.degenerate_epochs)
        index = batch["index"]
        self.log("val/correct", truth[index].sum().float(), on_epoch=True, reduce_fx="sum", sync_dist=True)
        self.log("val/total", float(len(index)), on_epoch=True, reduce_fx="sum", sync_dist=True)
        return {"judge": judge[index], "truth": truth[index]}

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, torch.Tensor]:
        return self.validation_step(batch, batch_idx)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexDataset(self.train_size, seed=0), batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(IndexDataset(self.val_size, seed=1), batch_size=self.val_batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()


class SeriesModule(pl.LightningModule):
    """A BoringModel-like one-player module whose ``e``-th validation reports ``series[e]`` = (correct, total)."""

    def __init__(self, series: list[tuple[int, int]]) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.series = list(series)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return self.layer(batch["x"]).pow(2).mean()

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        correct, total = self.series[self.current_epoch]
        self.log("val/correct", float(correct), on_epoch=True, reduce_fx="sum")
        self.log("val/total", float(total), on_epoch=True, reduce_fx="sum")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexDataset(8), batch_size=4)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(IndexDataset(4), batch_size=4)


def make_trainer(root: str | os.PathLike, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    """A quiet single-CPU trainer writing under ``root``; keyword arguments override the defaults."""
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "default_root_dir": os.fspath(root),
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "max_epochs": 2,
    }
    options.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **options)


def all_callbacks(peak_dir: str | os.PathLike, elo_every: int = 1) -> list[pl.Callback]:
    """One instance of every callback (two MCC trackers), configured as the resume and DDP tests use them."""
    return [
        TwoTimescaleWarmup(
            leader_lr=8e-3, follower_lr=2e-2, initial_lr=1e-3, warmup_steps=10, tau_leader=1.0, tau_follower=1.0
        ),
        EloRating(PLAYERS, k_factor=32.0, k_decay=4.0, volatility_window=3, apply_every_n_batches=elo_every),
        MCCTracker("judge", "truth", stage="val", trend_window=3),
        MCCTracker("judge", "truth", stage="train", trend_window=3, name="judge_mcc"),
        PeakCheckpoint("val/correct", "val/total", window=2, dirpath=peak_dir),
    ]


def callback_states(trainer: pl.Trainer) -> dict[str, Any]:
    """``state_dict()`` of every callback of this suite on ``trainer``, by state key."""
    suite = (TwoTimescaleWarmup, EloRating, MCCTracker, PeakCheckpoint)
    return {cb.state_key: cb.state_dict() for cb in trainer.callbacks if isinstance(cb, suite)}


def docs_block(must_contain: str, language: str = "python") -> str:
    """The code block of the callbacks' guide (``docs/callbacks.md``, linked from ``README.md``) that contains
    ``must_contain``."""
    for path in (REPO_ROOT / "docs" / "callbacks.md",):
        if path.exists():
            for block in re.findall(rf"```{language}\n(.*?)```", path.read_text(), flags=re.S):
                if must_contain in block:
                    return block
    raise LookupError(f"No {language} block with {must_contain!r} in the callbacks' guide (docs/callbacks.md).")


def run_docs_example(must_contain: str) -> dict[str, Any]:
    """Execute the callbacks' guide's example that contains ``must_contain``; returns its global names."""
    namespace: dict[str, Any] = {"__name__": "readme_example"}
    exec(compile(docs_block(must_contain), "docs/callbacks.md", "exec"), namespace)
    return namespace


class SyncSpy(torch.Tensor):
    """A tensor that records every call that would read a value back to the host (a device synchronisation)."""

    calls: list[str] = []
    _SYNCING = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu", "nonzero"}

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in cls._SYNCING:
            cls.calls.append(name)
        return super().__torch_function__(func, types, args, kwargs or {})


# --------------------------------------------------------------------------------------------------------------------
# The DDP job
# --------------------------------------------------------------------------------------------------------------------

DDP_EPOCHS = 3
DDP_ELO_EVERY = 3
DDP_CKPT_EVERY_STEPS = 4  # global_step advances twice per batch (two optimizers): a checkpoint every 2 batches


def _ddp_main(outdir: str) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    pl.seed_everything(0, workers=True)
    module = GameModule(degenerate_epochs=(1,))
    callbacks = all_callbacks(os.path.join(outdir, "peak"), elo_every=DDP_ELO_EVERY)
    steps = ModelCheckpoint(
        dirpath=os.path.join(outdir, "steps"), every_n_train_steps=DDP_CKPT_EVERY_STEPS, save_top_k=-1
    )
    trainer = make_trainer(
        outdir, [*callbacks, steps], devices=2, strategy="ddp", max_epochs=DDP_EPOCHS, enable_checkpointing=True
    )
    trainer.fit(module)
    result = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "states": callback_states(trainer),
        "lr_history": module.lr_history,
        "global_step": trainer.global_step,
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }
    Path(outdir, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():  # a clean exit of the gloo threads
        torch.distributed.destroy_process_group()


@functools.cache
def ddp_results() -> tuple[str, list[dict[str, Any]]]:
    """Run the DDP job once per test session; returns its output folder and both ranks' results."""
    outdir = tempfile.mkdtemp(prefix="callbacks-ddp-")
    atexit.register(shutil.rmtree, outdir, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), outdir],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"DDP job failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return outdir, [json.loads(Path(outdir, f"rank{r}.json").read_text()) for r in (0, 1)]


if __name__ == "__main__":
    _ddp_main(sys.argv[1])
