"""(system, prompt, response) triples for a supervised warm start of a game's players."""

from __future__ import annotations

import random
from typing import Any

import lightning as L
from torch.utils.data import DataLoader
from typing_extensions import override

from alignment_games.datamodules.debate import single_step_problems, single_step_solution
from alignment_games.datamodules.files import _TableDataModule, check_columns, iter_rows, open_table
from alignment_games.datamodules.formats import as_messages, split_last_reply
from alignment_games.datamodules.resumable import ResumableDataLoader
from alignment_games.datamodules.validation import require_text
from alignment_games.modules.algorithms.arithmetic import (
    _FILLER,
    CORRUPTIONS,
    ArithmeticProblem,
    generate_problems,
    make_response,
    make_think_response,
)
from alignment_games.modules.algorithms.checks import require_in_range, require_positive
from alignment_games.modules.lm.prompts import FOLLOWER_SYSTEM, QWEN_SYSTEM
from alignment_games.modules.lm.text import fill_template

Triple = tuple[str | None, str | list[dict[str, Any]], str]
SFT_FORMATS = ("auto", "prompt_completion", "messages")
#: ``worded`` sentences; ``think``: bare equations in ``<think>…</think>`` and the boxed answer (correct only);
#: ``think_padded``: numbers zero-padded to three digits; ``think_reversed``: padded, least-significant digit first
SOLUTION_STYLES = ("worded", "think", "think_padded", "think_reversed")
THINK_WIDTH = {"think": 0, "think_padded": 3, "think_reversed": 3}


def _collate(items: list[Triple]) -> dict[str, list[str]]:
    systems, prompts, responses = zip(*items)
    return {"system": list(systems), "prompt": list(prompts), "response": list(responses)}


def _chars(triple: Triple) -> int:
    """A triple's length in characters (its system, prompt and response): the bucketing's proxy for tokens."""
    system, prompt, response = triple
    text = prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt)
    return len(system or "") + len(text) + len(response)


class _TriplesDataModule(L.LightningDataModule):
    """Triples made once by :meth:`triples`; the first ``val_fraction`` of them (at least one) validate."""

    def __init__(self) -> None:
        super().__init__()
        self.train_pairs: list[Triple] = []
        self.val_pairs: list[Triple] = []

    def triples(self) -> list[Triple]:
        """Every (system, prompt, response) triple, validation first."""
        raise NotImplementedError

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.train_pairs:
            return
        pairs = self.triples()
        n_val = max(1, round(len(pairs) * self.hparams.val_fraction))
        self.val_pairs, self.train_pairs = pairs[:n_val], pairs[n_val:]
        if not self.train_pairs:
            raise ValueError(f"{len(pairs)} example(s) leave none for training after {n_val} for validation")

    @override
    def train_dataloader(self) -> ResumableDataLoader:
        hp, window = self.hparams, self.hparams.get("bucket_window", 0)
        lengths = [_chars(t) for t in self.train_pairs] if window else None
        return ResumableDataLoader(
            self.train_pairs, hp.batch_size, True, hp.seed, _collate, lengths=lengths, bucket_window=window
        )

    @override
    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_pairs, batch_size=self.hparams.batch_size, shuffle=False, collate_fn=_collate)


class ArithmeticSFTDataModule(_TriplesDataModule):
    """Generated (question, solution) pairs.

    Args:
        num_prompts: Problems generated.
        kinds: Solution kinds to sample from (see :data:`alignment_games.modules.algorithms.arithmetic.CORRUPTIONS`).
        weights: Sampling weights of the kinds (same length).
        val_fraction: Share of problems for validation.
        batch_size: Pairs per batch.
        seed: Seed (problems use ``seed + 2_000_003`` so they differ from the ensemble's and the game's).
        follower_fraction: Share of examples in the follower's format: another solution as system message (App. E.4).
        system_prompt: The leader's system message (the game's default).
        follower_system_template: The follower's system message with ``{leader_response}``.
        style: How solutions are written (:data:`SOLUTION_STYLES`); ``think*`` styles need ``kinds: [correct]``.
        min_steps: Fewest operations of a problem.
        max_steps: Most operations of a problem.
        bucket_window: Sort the shuffled order by length within runs of this many batches (less padding); 0: off.

    Raises:
        ValueError: for an unknown kind or style, ``think`` with a corrupted kind, bad weights or
            ``follower_fraction``, a negative ``bucket_window``, or a bad step range.
    """

    def __init__(
        self,
        num_prompts: int = 2000,
        kinds: list[str] | None = None,
        weights: list[float] | None = None,
        val_fraction: float = 0.05,
        batch_size: int = 32,
        seed: int = 0,
        follower_fraction: float = 0.5,
        system_prompt: str = QWEN_SYSTEM,
        follower_system_template: str = FOLLOWER_SYSTEM,
        style: str = "worded",
        min_steps: int = 2,
        max_steps: int = 4,
        bucket_window: int = 0,
    ) -> None:
        super().__init__()
        kinds = list(kinds or CORRUPTIONS)
        if bucket_window < 0:
            raise ValueError(f"bucket_window must be non-negative, got {bucket_window}")
        if style not in SOLUTION_STYLES:
            raise ValueError(f"style must be one of {list(SOLUTION_STYLES)}, got {style!r}")
        if style in THINK_WIDTH and kinds != ["correct"]:
            raise ValueError(f"style {style!r} writes correct solutions only: set kinds: [correct], got {kinds}")
        if not 1 <= min_steps <= max_steps:
            raise ValueError(f"need 1 <= min_steps <= max_steps, got {min_steps}, {max_steps}")
        weights = list(weights or [1.0] * len(kinds))
        if unknown := [k for k in kinds if k not in CORRUPTIONS]:
            raise ValueError(f"kinds: unknown {unknown}; expected some of {CORRUPTIONS}")
        require_in_range("follower_fraction", follower_fraction, 0, 1)
        if len(weights) != len(kinds) or min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(f"weights must be {len(kinds)} non-negative numbers with a positive sum, got {weights}")
        self.save_hyperparameters(logger=False)
        self.kinds, self.weights = kinds, weights

    @override
    def triples(self) -> list[Triple]:
        hp = self.hparams
        rng, pairs = random.Random(hp.seed), []
        for p in generate_problems(hp.num_prompts, hp.seed + 2_000_003, hp.min_steps, hp.max_steps):
            kind = rng.choices(self.kinds, weights=self.weights)[0]
            system = hp.system_prompt
            if rng.random() < hp.follower_fraction:
                shown = self._write(p, rng.choices(self.kinds, weights=self.weights)[0], rng)
                system = fill_template(hp.follower_system_template, leader_response=shown)
            pairs.append((system, p.question, self._write(p, kind, rng)))
        return pairs

    def _write(self, problem: ArithmeticProblem, kind: str, rng: random.Random) -> str:
        """A solution of ``kind`` in the configured style."""
        if (style := self.hparams.style) in THINK_WIDTH:
            return make_think_response(problem, THINK_WIDTH[style], reverse=style == "think_reversed")
        return make_response(problem, kind, rng)


class SingleStepSFTDataModule(_TriplesDataModule):
    """Warm-start pairs on single-step problems: right and wrong solutions, some with a filler sentence.

    Args:
        num_prompts: Problems generated (seed offset 3_000_017, so they differ from the game's).
        correct_fraction: Share of solutions whose result is right; the others are off by 1 or 2.
        filler_fraction: Share of solutions (right or wrong alike) with one filler sentence.
        max_operand: Largest operand.
        val_fraction: Share of pairs for validation.
        batch_size: Pairs per batch.
        seed: Seed.
        system_prompt: System message of every pair.
    """

    def __init__(
        self,
        num_prompts: int = 3000,
        correct_fraction: float = 0.6,
        filler_fraction: float = 0.3,
        max_operand: int = 9,
        val_fraction: float = 0.05,
        batch_size: int = 32,
        seed: int = 0,
        system_prompt: str = "You are a helpful assistant.",
    ) -> None:
        super().__init__()
        require_in_range("correct_fraction", correct_fraction, 0, 1)
        require_in_range("filler_fraction", filler_fraction, 0, 1)
        self.save_hyperparameters(logger=False)

    @override
    def triples(self) -> list[Triple]:
        hp = self.hparams
        rng, pairs = random.Random(hp.seed), []
        for p in single_step_problems(hp.num_prompts, seed=hp.seed + 3_000_017, max_operand=hp.max_operand):
            result = int(p["reference"])
            if rng.random() >= hp.correct_fraction:
                result = max(0, result + rng.choice([-2, -1, 1, 2]))
                result = result if result != int(p["reference"]) else result + 1
            filler = rng.choice(_FILLER) if rng.random() < hp.filler_fraction else None
            pairs.append((hp.system_prompt, p["prompt"], single_step_solution(p, result, filler)))
        return pairs


def sft_example(
    rec: dict[str, Any], data_format: str, columns: dict[str, str], where: str, row: int
) -> tuple[str | list[dict[str, Any]], str]:
    """One record as ``(prompt, completion)``: the prompt text or messages, the completion text.

    Raises:
        ValueError: naming ``where``, the row and the field of a bad prompt, completion or conversation.
    """
    at = f"{where}: row {row}"
    if data_format == "messages":
        at = f"{at}: field {columns['messages']!r}"
        context, reply = split_last_reply(as_messages(rec[columns["messages"]], at), at)
        if not reply[0]["content"].strip():
            raise ValueError(f"{at}: the completion is empty")
        return context, reply[0]["content"]
    prompt, completion = rec[columns["prompt"]], rec[columns["completion"]]
    if isinstance(prompt, (list, tuple)):
        prompt = as_messages(prompt, f"{at}: field {columns['prompt']!r}")
    else:
        prompt = require_text(prompt, columns["prompt"], where, row)
    if isinstance(completion, (list, tuple)):
        reply = as_messages(completion, f"{at}: field {columns['completion']!r}")
        if len(reply) != 1 or reply[0]["role"] != "assistant":
            roles = [m["role"] for m in reply]
            raise ValueError(
                f"{at}: field {columns['completion']!r} must be one assistant message (roles here: {roles})"
            )
        completion = reply[0]["content"]
    return prompt, require_text(completion, columns["completion"], where, row)


class SFTFileDataModule(_TableDataModule, _TriplesDataModule):
    """Your own SFT data: a jsonl/json/parquet/csv file or a hub set in TRL's prompt-completion or messages format.

    Args:
        format: ``prompt_completion``, ``messages`` (trained on the last assistant reply) or ``auto`` (by the columns).
        prompt_column: Column with the prompt.
        completion_column: Column with the completion.
        messages_column: Column with the conversation (``messages`` format).
        system_prompt: System message of examples without their own; ``None``: the model's ``system_prompt``.
        val_fraction: Share of examples for validation.
        batch_size: Examples per batch.
        seed: Seed of the shuffle.
        **table: The file or hub set (:class:`~alignment_games.datamodules.files._TableDataModule`'s arguments; one
            is needed).

    Raises:
        ValueError: for an unknown ``format`` or ``val_fraction`` outside [0, 1); reading, a missing column (listing
            those present) or a bad row (naming row and field).
    """

    def __init__(
        self,
        format: str = "auto",
        prompt_column: str = "prompt",
        completion_column: str = "completion",
        messages_column: str = "messages",
        system_prompt: str | None = None,
        val_fraction: float = 0.05,
        batch_size: int = 16,
        seed: int = 0,
        **table: Any,
    ) -> None:
        super().__init__(**table)
        if format not in SFT_FORMATS:
            raise ValueError(f"data.format must be one of {list(SFT_FORMATS)}, got {format!r}")
        if not self.table_given:
            raise ValueError("SFTFileDataModule needs data.path (a local file) or data.name (a hub dataset)")
        require_in_range("val_fraction", val_fraction, 0, 1, open_high=True)
        require_positive(batch_size=batch_size)
        self.save_hyperparameters(logger=False)
        self.hparams.update(self.table)

    @override
    def triples(self) -> list[Triple]:
        hp = self.hparams
        ds, where = open_table(columns={}, **self.table)
        data_format = hp.format
        if data_format == "auto":
            messages_only = hp.messages_column in ds.column_names and hp.prompt_column not in ds.column_names
            data_format = "messages" if messages_only else "prompt_completion"
        columns = {"prompt": hp.prompt_column, "completion": hp.completion_column, "messages": hp.messages_column}
        needed = ("messages",) if data_format == "messages" else ("prompt", "completion")
        check_columns(ds.column_names, where, {k: columns[k] for k in needed})
        triples = [
            (hp.system_prompt, *sft_example(rec, data_format, columns, where, i)) for i, rec in iter_rows(ds, where)
        ]
        random.Random(hp.seed).shuffle(triples)
        return triples
