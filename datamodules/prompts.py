"""Prompts (with optional reference answers) for the games: generated arithmetic problems, a local file or a hub set.

Batches are :func:`collate_prompts`'s; splits are disjoint at the prompt level and deterministic for a seed.
"""

from __future__ import annotations

import random
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader
from typing_extensions import override

from datamodules.arithmetic import generate_problems
from datamodules.files import iter_rows, open_table
from datamodules.resumable import split_loader
from modules.algorithms.answers import extract_final_answer, extract_gsm8k_answer

__all__ = ["PromptDataModule", "collate_prompts", "index_rows", "load_prompt_rows"]


def load_prompt_rows(
    path: str | None,
    name: str | None,
    split: str,
    prompt_column: str,
    reference_column: str | None,
    reference_format: str = "plain",
) -> list[dict[str, Any]]:
    """Rows ``{"prompt", "reference"}`` from a local file or hub dataset; errors name the column or row.

    ``reference_format``: ``plain`` (the column is the answer), ``gsm8k`` (after ``####``) or ``boxed`` (the last
    ``\\boxed{}`` of a worked solution, as in MATH).
    """
    ds, where = open_table(path, name, split, [prompt_column, reference_column])
    extract = {"plain": lambda s: s, "gsm8k": extract_gsm8k_answer, "boxed": extract_final_answer}
    if reference_format not in extract:
        raise ValueError(f"reference_format must be one of {sorted(extract)}, got {reference_format!r}")
    rows = []
    for i, rec in iter_rows(ds, where):
        prompt = rec[prompt_column]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{where}: row {i}: field {prompt_column!r} is missing or empty")
        ref = None
        if reference_column is not None and rec[reference_column] is not None:
            ref = extract[reference_format](str(rec[reference_column]))
        rows.append({"prompt": prompt, "reference": ref})
    return rows


def index_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of ``rows``, each with its position under ``"index"`` (the items :func:`collate_prompts` batches)."""
    return [{**r, "index": i} for i, r in enumerate(rows)]


def collate_prompts(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Batch indexed rows as ``{"prompt": [...], "reference": [...], "index": tensor}``."""
    return {
        "prompt": [it["prompt"] for it in items],
        "reference": [it["reference"] for it in items],
        "index": torch.tensor([it["index"] for it in items], dtype=torch.long),
    }


class PromptDataModule(L.LightningDataModule):
    """Train/validation/test prompts for a game.

    Args:
        path: Local jsonl/json/parquet/csv of prompts (e.g. GSM8K's ``question``/``answer``).
        name: Hub dataset name (used when ``path`` is ``None``); neither: generated arithmetic problems.
        split: Hub split.
        prompt_column: Column with the prompt.
        reference_column: Column with the reference answer (optional).
        reference_format: ``plain``, ``gsm8k`` or ``boxed``.
        num_prompts: Generated problems when no file or hub set is given.
        val_fraction: Share of prompts for validation (held-out evaluation of the game).
        test_fraction: Share of prompts for test.
        batch_size: Prompts per step (the paper's B).
        seed: Seed of generation and splitting.
        generation_seed_offset: Generated problems use ``seed + offset`` so that game prompts differ from the
            preference ensemble's training prompts (the paper trains the game on unseen prompts).
    """

    def __init__(
        self,
        path: str | None = None,
        name: str | None = None,
        split: str = "train",
        prompt_column: str = "prompt",
        reference_column: str | None = None,
        reference_format: str = "plain",
        num_prompts: int = 400,
        val_fraction: float = 0.25,
        test_fraction: float = 0.0,
        batch_size: int = 4,
        seed: int = 0,
        generation_seed_offset: int = 1_000_003,
    ) -> None:
        super().__init__()
        if not 0 <= val_fraction < 1 or not 0 <= test_fraction < 1 or val_fraction + test_fraction >= 1:
            raise ValueError(
                f"val_fraction={val_fraction} and test_fraction={test_fraction} must be in [0, 1) and sum below 1"
            )
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.save_hyperparameters(logger=False)
        self.splits: dict[str, list[dict[str, Any]]] = {}

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        hp = self.hparams
        if hp.path is None and hp.name is None:
            rows = [
                {"prompt": p.question, "reference": str(p.answer)}
                for p in generate_problems(hp.num_prompts, seed=hp.seed + hp.generation_seed_offset)
            ]
        else:
            rows = load_prompt_rows(
                hp.path, hp.name, hp.split, hp.prompt_column, hp.reference_column, hp.reference_format
            )
        unique = sorted({r["prompt"] for r in rows})
        random.Random(hp.seed).shuffle(unique)
        n_val, n_test = round(len(unique) * hp.val_fraction), round(len(unique) * hp.test_fraction)
        split_of = {x: "val" for x in unique[:n_val]}
        split_of.update({x: "test" for x in unique[n_val : n_val + n_test]})
        self.splits = {"train": [], "val": [], "test": []}
        seen = set()
        for r in rows:
            if r["prompt"] in seen:
                continue
            seen.add(r["prompt"])
            self.splits[split_of.get(r["prompt"], "train")].append(r)
        if not self.splits["train"]:
            raise ValueError("no training prompts left after the validation/test split")

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        return split_loader(
            index_rows(self.splits[split]),
            self.hparams.batch_size,
            collate_prompts,
            train=split == "train",
            shuffle=shuffle,
            seed=self.hparams.seed,
        )

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader("train", True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader("val", False)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader("test" if self.splits["test"] else "val", False)

    @override
    def predict_dataloader(self) -> DataLoader:
        return self._loader("test" if self.splits["test"] else "val", False)
