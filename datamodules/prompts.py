"""Prompts (with optional reference answers) for the games: generated arithmetic problems, a local file or a hub set."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader
from typing_extensions import override

from alignment_games.datamodules.files import iter_rows, open_table
from alignment_games.datamodules.formats import as_messages, is_messages
from alignment_games.datamodules.resumable import split_loader
from alignment_games.datamodules.validation import require_text
from alignment_games.modules.algorithms.answers import extract_final_answer, extract_gsm8k_answer
from alignment_games.modules.algorithms.arithmetic import generate_problems
from alignment_games.modules.algorithms.checks import require_positive

REFERENCE_FORMATS = {"plain": lambda s: s, "gsm8k": extract_gsm8k_answer, "boxed": extract_final_answer}


@dataclass(frozen=True)
class PromptSource:
    """Where a game's prompts come from: a local file, a hub dataset, or neither (generated arithmetic problems).

    Attributes:
        path: Local jsonl/json/parquet/csv (e.g. GSM8K's ``question``/``answer``); takes precedence over ``name``.
        name: Hub dataset name (used when ``path`` is ``None``).
        config_name: Hub subset (GSM8K needs ``"main"``).
        revision: Hub revision (a tag or commit).
        split: Hub split.
        prompt_column: Column with the prompt: text, or one user message (after an optional system message).
        reference_column: Column with the reference answer (optional); a null or unparsable value gives ``None``.
        reference_format: ``plain`` (the answer), ``gsm8k`` (after ``####``) or ``boxed`` (the last ``\\boxed{}``).
        category_column: Column with each prompt's category (optional), carried in rows and batches as ``category``.

    Raises:
        ValueError: for an unknown ``reference_format``.
    """

    path: str | None = None
    name: str | None = None
    config_name: str | None = None
    revision: str | None = None
    split: str = "train"
    prompt_column: str = "prompt"
    reference_column: str | None = None
    reference_format: str = "plain"
    category_column: str | None = None

    def __post_init__(self) -> None:
        if self.reference_format not in REFERENCE_FORMATS:
            raise ValueError(
                f"reference_format must be one of {sorted(REFERENCE_FORMATS)}, got {self.reference_format!r}"
            )

    @classmethod
    def coerce(cls, value: PromptSource | dict[str, Any]) -> PromptSource:
        """``value`` itself, or a source from a dict of its fields (as a checkpoint's hparams hold it)."""
        return value if isinstance(value, cls) else cls(**value)

    @property
    def generated(self) -> bool:
        """Whether neither a file nor a hub set is named."""
        return self.path is None and self.name is None

    def load(self) -> list[dict[str, Any]]:
        """Rows ``{"prompt", "reference"}`` (and ``"category"``) of the file or hub split.

        Raises:
            ValueError: naming the file, row and column of a bad prompt, reference or category.
        """
        columns = [self.prompt_column, self.reference_column, self.category_column]
        ds, where = open_table(self.path, self.name, self.split, columns, self.config_name, self.revision)
        extract, rows = REFERENCE_FORMATS[self.reference_format], []
        for i, rec in iter_rows(ds, where):
            row = {"prompt": prompt_text(rec[self.prompt_column], self.prompt_column, where, i), "reference": None}
            if self.reference_column is not None and rec[self.reference_column] is not None:
                row["reference"] = extract(scalar_text(rec[self.reference_column], self.reference_column, where, i))
            if self.category_column is not None:
                row["category"] = scalar_text(rec[self.category_column], self.category_column, where, i)
            rows.append(row)
        return rows


def prompt_text(value: Any, field: str, where: str, row: int) -> str:
    """A prompt as text: text itself, or the content of a conversation of one user message (after a system one).

    Raises:
        ValueError: naming the file, row and field of a missing, empty or non-text prompt or another conversation.
    """
    if is_messages(value):
        at = f"{where}: row {row}: field {field!r}"
        messages = [m for m in as_messages(value, at) if m["role"] != "system"]
        if len(messages) != 1 or messages[0]["role"] != "user":
            roles = [m["role"] for m in value]
            raise ValueError(f"{at}: a conversational prompt must be one user message (roles here: {roles})")
        value = messages[0]["content"]
    return require_text(value, field, where, row)


def scalar_text(value: Any, field: str, where: str, row: int) -> str:
    """A reference or category as non-empty text; a finite number is written out (``7`` → ``"7"``).

    Raises:
        ValueError: naming the file, row and field of a missing, empty, non-finite or non-scalar value.
    """
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: row {row}: field {field!r} = {value!r} is not finite (a missing value is null)")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{where}: row {row}: field {field!r} must be text or a number, got {value!r:.80}")
    return require_text(value, field, where, row)


def shuffled_cuts(items: Sequence[Any], seed: int, *fractions: float) -> list[list[Any]]:
    """``items`` shuffled with ``seed``, cut into ``round(n · f)`` items for each fraction in turn, then the rest."""
    items = list(items)
    random.Random(seed).shuffle(items)
    ends = list(itertools.accumulate(round(len(items) * f) for f in fractions))
    return [items[a:b] for a, b in zip([0, *ends], [*ends, len(items)])]


def generated_rows(num: int, seed: int) -> list[dict[str, Any]]:
    """``num`` generated arithmetic problems as rows ``{"prompt", "reference"}``."""
    return [{"prompt": p.question, "reference": str(p.answer)} for p in generate_problems(num, seed=seed)]


def index_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of ``rows``, each with its position under ``"index"`` (the items :func:`collate_prompts` batches)."""
    return [{**r, "index": i} for i, r in enumerate(rows)]


def collate_prompts(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Batch indexed rows as ``{"prompt": [...], "reference": [...], "index": tensor}`` (and ``"category"`` if any)."""
    batch = {
        "prompt": [it["prompt"] for it in items],
        "reference": [it["reference"] for it in items],
        "index": torch.tensor([it["index"] for it in items], dtype=torch.long),
    }
    if any("category" in it for it in items):
        batch["category"] = [it.get("category") for it in items]
    return batch


class PromptDataModule(L.LightningDataModule):
    """Train/validation/test prompts for a game, split disjointly by prompt and deterministically for a seed.

    Args:
        source: Where the prompts come from (:class:`PromptSource`: a file, a hub set, or generated problems).
        num_prompts: Generated problems when the source names no file or hub set.
        val_fraction: Share of prompts for validation (held-out evaluation of the game).
        test_fraction: Share of prompts for test.
        batch_size: Prompts per step (the paper's B).
        eval_batch_size: Prompts per validation or test batch (no group forks: more fit); default ``batch_size``.
        seed: Seed of generation and splitting.
        generation_seed_offset: Generated problems use ``seed + offset``, unseen by the preference ensemble.
    """

    def __init__(
        self,
        source: PromptSource = PromptSource(),
        num_prompts: int = 400,
        val_fraction: float = 0.25,
        test_fraction: float = 0.0,
        batch_size: int = 4,
        eval_batch_size: int | None = None,
        seed: int = 0,
        generation_seed_offset: int = 1_000_003,
    ) -> None:
        super().__init__()
        if not 0 <= val_fraction < 1 or not 0 <= test_fraction < 1 or val_fraction + test_fraction >= 1:
            raise ValueError(
                f"val_fraction={val_fraction} and test_fraction={test_fraction} must be in [0, 1) and sum below 1"
            )
        require_positive(batch_size=batch_size)
        if eval_batch_size is not None:
            require_positive(eval_batch_size=eval_batch_size)
        self.source = PromptSource.coerce(source)
        self.save_hyperparameters(ignore=["source"], logger=False)
        self.hparams["source"] = dataclasses.asdict(self.source)  # plain values: checkpoints load weights-only
        self.splits: dict[str, list[dict[str, Any]]] = {}

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        hp = self.hparams
        if self.source.generated:
            rows = generated_rows(hp.num_prompts, hp.seed + hp.generation_seed_offset)
        else:
            rows = self.source.load()
        first: dict[str, dict[str, Any]] = {}  # each prompt's first row
        for r in rows:
            first.setdefault(r["prompt"], r)
        val, test, _ = shuffled_cuts(sorted(first), hp.seed, hp.val_fraction, hp.test_fraction)
        split_of = {x: "val" for x in val} | {x: "test" for x in test}
        self.splits = {"train": [], "val": [], "test": []}
        for x, r in first.items():
            self.splits[split_of.get(x, "train")].append(r)
        if not self.splits["train"]:
            raise ValueError("no training prompts left after the validation/test split")

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        rows, hp, train = index_rows(self.splits[split]), self.hparams, split == "train"
        size = hp.batch_size if train or hp.get("eval_batch_size") is None else hp.eval_batch_size
        return split_loader(rows, size, collate_prompts, train=train, shuffle=shuffle, seed=hp.seed)

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader("train", True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader("val", False)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader("test" if self.splits["test"] else "val", False)

    predict_dataloader = test_dataloader
