"""A two-process DDP job on a validation set whose size does not divide by the number of processes.

A plain ``LightningModule`` (nothing of the suite but the callbacks) validates ``ITEMS`` = 101 items on 2 CPU
processes (gloo): Lightning's distributed sampler pads the set to 102, so one item is validated twice. The job runs
``MCCTracker`` and ``PeakCheckpoint`` with item ids (each item counted once) and, as the control that shows the
padding, an ``MCCTracker`` without them. Run as a script (``python item_ddp.py OUTDIR``), each rank writes its
callbacks' states to ``OUTDIR/rank<r>.json``.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

from alignment_games.callbacks import MCCTracker, PeakCheckpoint
from helpers.callback_helpers import REPO_ROOT, IndexDataset, make_trainer, val_tables

ITEMS = 101
EPOCHS = 2


class ItemModule(pl.LightningModule):
    """Returns each validation item's judge verdict, truth and id (its dataset index)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return self.layer(batch["x"]).pow(2).mean()

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, torch.Tensor]:
        judge, truth = val_tables(self.current_epoch, ITEMS)
        index = batch["index"]
        return {"judge": judge[index], "truth": truth[index], "item": index}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexDataset(8), batch_size=2)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(IndexDataset(ITEMS, seed=1), batch_size=8)


def item_callbacks(peak_dir: str | os.PathLike) -> list[pl.Callback]:
    """The callbacks of the job: with item ids, and the control without them."""
    return [
        MCCTracker("judge", "truth", stage="val", id_key="item"),
        MCCTracker("judge", "truth", stage="val", name="mcc_padded"),
        PeakCheckpoint(success_key="truth", id_key="item", window=1, dirpath=peak_dir),
    ]


def _main(outdir: str) -> None:
    pl.seed_everything(0, workers=True)
    callbacks = item_callbacks(os.path.join(outdir, "peak"))
    trainer = make_trainer(outdir, callbacks, devices=2, strategy="ddp", max_epochs=EPOCHS, limit_train_batches=1)
    trainer.fit(ItemModule())
    result = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "states": {cb.state_key: cb.state_dict() for cb in callbacks},
    }
    Path(outdir, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():  # a clean exit of the gloo threads
        torch.distributed.destroy_process_group()


@functools.cache
def item_ddp_results() -> list[dict[str, Any]]:
    """Run the job once per test session; both ranks' results."""
    outdir = tempfile.mkdtemp(prefix="items-ddp-")
    atexit.register(shutil.rmtree, outdir, ignore_errors=True)
    # the repository, and tests/ for `helpers` (pytest puts the folder of tests/conftest.py on the path)
    paths = [str(REPO_ROOT), str(REPO_ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    env["OMP_NUM_THREADS"] = "1"
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
    return [json.loads(Path(outdir, f"rank{r}.json").read_text()) for r in (0, 1)]


if __name__ == "__main__":
    _main(sys.argv[1])
