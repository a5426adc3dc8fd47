"""The instruction pool of the multi-LLM game (App. E): a development split cut 80/20, a test set kept apart."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from alignment_games.datamodules.prompts import PromptSource, collate_prompts, generated_rows, index_rows, shuffled_cuts
from alignment_games.datamodules.resumable import ResumableDataLoader
from alignment_games.modules.algorithms.checks import require_in_range, require_positive


def split_pool(
    rows: list[dict[str, Any]], val_fraction: float, seed: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Deduplicate by prompt (first occurrence kept), shuffle with ``seed``, cut off ``val_fraction`` for validation.

    Raises:
        ValueError: when fewer than two distinct prompts would remain as candidate instructions.
    """
    first: dict[str, dict[str, Any]] = {}
    for r in rows:
        first.setdefault(r["prompt"], r)
    unique = list(first.values())
    val, train = shuffled_cuts(unique, seed, val_fraction)
    if len(train) < 2:
        raise ValueError(
            f"the instruction pool needs at least two candidate instructions, got {len(train)} of {len(unique)} "
            f"distinct prompts after the {val_fraction:.0%} validation split"
        )
    return train, val


class _WholePool(Dataset):
    """``iterations`` items, each the whole pool (one item = one game iteration)."""

    def __init__(self, rows: list[dict[str, Any]], iterations: int = 1) -> None:
        self.rows, self.iterations = rows, iterations

    def __len__(self) -> int:
        return self.iterations

    def __getitem__(self, i: int) -> list[dict[str, Any]]:
        return index_rows(self.rows)


class InstructionPoolDataModule(L.LightningDataModule):
    """Candidate instructions (80% of a development split), validation (20%) and a separate test set.

    Args:
        source: The development split (:class:`~alignment_games.datamodules.prompts.PromptSource`); default: generated.
        test_source: The test set; ``None``: generated test problems when ``source`` is generated, else no test set.
        num_problems: Generated development problems (when ``source`` names no file or hub set).
        num_test_problems: Generated test problems.
        val_fraction: Share of the development split held out for validation (paper: 0.2).
        batch_size: Validation/test prompts per batch.
        iterations_per_epoch: Game iterations (training batches, each the whole pool) per epoch (paper: 1).
        seed: Seed of generation and splitting.
        generation_seed_offset: Generated problems use ``seed + offset`` (test: ``+ 1``), unlike the SFT warm start's.
    """

    def __init__(
        self,
        source: PromptSource = PromptSource(),
        test_source: PromptSource | None = None,
        num_problems: int = 200,
        num_test_problems: int = 100,
        val_fraction: float = 0.2,
        batch_size: int = 8,
        iterations_per_epoch: int = 1,
        seed: int = 0,
        generation_seed_offset: int = 2_000_003,
    ) -> None:
        super().__init__()
        require_in_range("val_fraction", val_fraction, 0, 1, open_high=True)
        if isinstance(iterations_per_epoch, bool) or int(iterations_per_epoch) != iterations_per_epoch:
            raise ValueError(f"iterations_per_epoch must be an integer, got {iterations_per_epoch!r}")
        require_positive(batch_size=batch_size, iterations_per_epoch=iterations_per_epoch)
        self.source = PromptSource.coerce(source)
        self.test_source = None if test_source is None else PromptSource.coerce(test_source)
        self.splits: dict[str, list[dict[str, Any]]] = {}
        self.save_hyperparameters(ignore=["source", "test_source"], logger=False)
        # plain values: checkpoints load weights-only
        test = None if self.test_source is None else dataclasses.asdict(self.test_source)
        self.hparams.update(source=dataclasses.asdict(self.source), test_source=test)

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        hp = self.hparams
        base, generated = hp.seed + hp.generation_seed_offset, self.source.generated
        rows = generated_rows(hp.num_problems, base) if generated else self.source.load()
        train, val = split_pool(rows, hp.val_fraction, hp.seed)
        test = []
        if generated or self.test_source is not None:
            test_rows = self.test_source.load() if self.test_source else generated_rows(hp.num_test_problems, base + 1)
            dev = {r["prompt"] for r in train + val}
            test = [r for r in test_rows if r["prompt"] not in dev]  # the test set never overlaps the pool
        self.splits = {"train": train, "val": val, "test": test}

    @override
    def train_dataloader(self) -> DataLoader:
        # resumable, so a mid-epoch checkpoint does not replay an iteration; replicated: StackelbergPool splits the
        # duels across ranks itself
        pool = _WholePool(self.splits["train"], int(self.hparams.iterations_per_epoch))
        return ResumableDataLoader(pool, None, False, self.hparams.seed, collate_prompts, replicated=True)

    def _loader(self, split: str) -> DataLoader:
        rows = index_rows(self.splits[split])
        return DataLoader(rows, batch_size=self.hparams.batch_size, collate_fn=collate_prompts)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    @override
    def test_dataloader(self) -> DataLoader:
        if not self.splits["test"]:
            warnings.warn("no test set was given (test_source): testing on the validation split", stacklevel=2)
        return self._loader("test" if self.splits["test"] else "val")
