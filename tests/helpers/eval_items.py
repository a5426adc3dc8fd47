"""In-training evaluation counts of GRPO, the pool and deep-SMIDA on a set whose items a sampler repeats.

``ITEMS`` = 5 held-out prompts ``"item <i>"`` with reference ``str(i)``. The policies' greedy replies are replaced by
known ones (the counting, not the model, is under test): GRPO answers items ``GRPO_RIGHT`` right, the pool's model
``m<j>`` items ``POOL_RIGHT[j]``; deep-SMIDA's oracle gives no valid verdict on items ``ORACLE_BLIND``. Counted once
per item, the figures are the hand values of :func:`exact_figures`; a repeat of item 0 (one process: the loader
repeats it; two processes: Lightning's distributed sampler pads 5 items to 6 with item 0) must not change them.
Run as a script (``python eval_items.py OUTDIR TINY_LM``), each of two DDP ranks writes its figures to
``OUTDIR/rank<r>.json``.
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
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from alignment_games.datamodules.prompts import collate_prompts, index_rows
from alignment_games.modules.algorithms.rl_losses import PolicyGradient
from alignment_games.modules.scorers.oracle import PreferenceOracle
from alignment_games.modules.scorers.utility import Utility

ITEMS = 5
GRPO_RIGHT = {0, 3}
POOL_RIGHT = ({0}, {1, 2}, {0, 1, 2, 3})
ORACLE_BLIND = {"0", "1"}
REPO_ROOT = Path(__file__).resolve().parents[2]


def rows() -> list[dict[str, Any]]:
    """The held-out prompts, each with its dataset index."""
    return index_rows([{"prompt": f"item {i}", "reference": str(i)} for i in range(ITEMS)])


def loader(repeat_first: bool) -> DataLoader:
    """Batches of two; with ``repeat_first`` item 0 comes again at the end, as a distributed sampler pads."""
    data = rows()
    return DataLoader(data + data[:1] if repeat_first else data, batch_size=2, collate_fn=collate_prompts)


def exact_figures() -> dict[str, float]:
    """Each item once, by hand: shares of the right answers and the oracle's left-out verdicts.

    The oracle's counts: 2 pairs (trained and reference) x ``eval_pairs`` = 2 rows x 1 query per blind item.
    """
    return {
        "grpo/val/accuracy": len(GRPO_RIGHT) / ITEMS,
        "grpo/val/reward": len(GRPO_RIGHT) / ITEMS,
        "pool/val/acc/m0": len(POOL_RIGHT[0]) / ITEMS,
        "pool/val/acc/m1": len(POOL_RIGHT[1]) / ITEMS,
        "pool/val/acc/m2": len(POOL_RIGHT[2]) / ITEMS,
        "pool/val/acc_macro": sum(len(r) for r in POOL_RIGHT) / (len(POOL_RIGHT) * ITEMS),
        "deep/oracle_invalid_verdicts": 2 * 2 * len(ORACLE_BLIND),
        "deep/oracle_unlabelled_rows": 2 * 2 * len(ORACLE_BLIND),
        "deep/oracle_timeouts": 0,
        "deep/n_prompts": ITEMS,
    }


def _item(text: str) -> int:
    return int(re.search(r"item (\d+)", text).group(1))


def replies(right: dict[str, set[int]]):
    """A stand-in for ``PolicyBank.generate``: ``\\boxed{i}`` (right) for the player's items in ``right``, else 99."""

    def generate(player, prompts, n, sampling, greedy=False):
        hits = right[player]
        return SimpleNamespace(texts=[rf"\boxed{{{_item(x) if _item(x) in hits else 99}}}" for x in prompts])

    return generate


class BlindOracle(PreferenceOracle):
    """No valid verdict (NaN) on the rows whose reference is in ``ORACLE_BLIND``; 0.5 elsewhere."""

    def first_wins_probability(self, prompts, firsts, seconds, references):
        return torch.tensor([float("nan") if r in ORACLE_BLIND else 0.5 for r in references], dtype=torch.float64)


class LengthUtility(Utility):
    """u = the follower's reply length over 50 (a real function of the replies)."""

    def forward(self, prompts, leader, follower):
        return torch.tensor([len(y2) / 50.0 for y2 in follower], dtype=torch.float32)


def grpo(tiny_lm_dir: str) -> pl.LightningModule:
    """GRPO rewarded by answer match, its greedy replies :func:`replies` of ``GRPO_RIGHT``."""
    from alignment_games.modules.grpo import GRPO
    from alignment_games.modules.lm.model_config import ModelConfig

    model = GRPO(
        lm=ModelConfig(tiny_lm_dir, lora_r=4), policy_gradient=PolicyGradient(group_size=2), chat_template=False
    )
    model.players.generate = replies({"policy": GRPO_RIGHT})
    return model


def pool(tiny_lm_dir: str) -> pl.LightningModule:
    """A pool of three models, model ``m<j>``'s greedy replies :func:`replies` of ``POOL_RIGHT[j]``."""
    from alignment_games.modules.lm.sampling import Sampling
    from alignment_games.modules.pool import StackelbergPool
    from alignment_games.modules.scorers.peer_judges import PeerJudging

    model = StackelbergPool(
        lm={"name_or_path": str(tiny_lm_dir), "lora_r": 4},
        num_players=len(POOL_RIGHT),
        judging=PeerJudging(template="{prompt} {response}", mode="constrained", max_new_tokens=6),
        sampling=Sampling(max_new_tokens=6),
    )
    model.bank("m0").generate = replies(dict(zip(model.player_names, POOL_RIGHT)))  # one bank holds every model
    return model


def deep_smida(tiny_lm_dir: str) -> pl.LightningModule:
    """Deep-SMIDA (tiny LM players) with the :class:`BlindOracle`, one query a label."""
    from alignment_games.modules.deep_smida import DeepSMIDA
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.sampling import Sampling

    return DeepSMIDA(
        lm=ModelConfig(tiny_lm_dir, lora_r=4),
        utility=LengthUtility(),
        samples_per_prompt=2,
        follower_samples=2,
        sampling=Sampling(temperature=0.6, max_new_tokens=4),
        oracle=BlindOracle(num_queries=1),
    )


def figures(root: str | os.PathLike, tiny_lm_dir: str, repeat_first: bool, **trainer_kw: Any) -> dict[str, float]:
    """Validate the three modules once each; their logged figures and deep-SMIDA's oracle counts, by name."""
    out: dict[str, float] = {}
    for name, build in (("grpo", grpo), ("pool", pool), ("deep", deep_smida)):
        pl.seed_everything(0)
        model = build(tiny_lm_dir)
        trainer = pl.Trainer(
            accelerator="cpu",
            default_root_dir=os.fspath(root),
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            **trainer_kw,
        )
        trainer.validate(model, dataloaders=loader(repeat_first), verbose=False)
        out.update({f"{name}/{k}": float(v) for k, v in trainer.callback_metrics.items() if "/" in k})
        if name == "deep":
            ev = model.last_eval
            keys = ("oracle_invalid_verdicts", "oracle_timeouts", "oracle_unlabelled_rows", "n_prompts")
            out.update({f"deep/{k}": float(ev[k]) for k in keys})
    return out


def _main(outdir: str, tiny_lm_dir: str) -> None:
    torch.set_num_threads(1)
    result = figures(outdir, tiny_lm_dir, repeat_first=False, devices=2, strategy="ddp")
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    result["world_size"] = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():  # a clean exit of the gloo threads
        torch.distributed.destroy_process_group()


@functools.cache
def ddp_figures(tiny_lm_dir: str) -> list[dict[str, float]]:
    """Run the two-process job once per test session; both ranks' figures."""
    outdir = tempfile.mkdtemp(prefix="eval-items-ddp-")
    atexit.register(shutil.rmtree, outdir, ignore_errors=True)
    paths = [str(REPO_ROOT), str(REPO_ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), outdir, str(tiny_lm_dir)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"DDP job failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return [json.loads(Path(outdir, f"rank{r}.json").read_text()) for r in (0, 1)]


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
