"""Problems for the debate game, and a warm start on problems a tiny CPU model can actually solve.

:class:`datamodules.prompts.PromptDataModule` already serves the debate (a hub set or a local file with GSM8K's
``#### n`` or MATH's ``\\boxed{}`` references, generated arithmetic problems by default; ``val_fraction: 0.5`` is the
paper's 50% IID split). What it lacks is a task on which a tiny byte-level policy is right *sometimes*: on the
default 2–4-step problems the warm-started tiny policy is right about 1% of the time, so the judge's MCC against
the truth would be measured on one class. Here:

* :func:`single_step_problems`: ``a + b`` word problems with one-digit operands, in the default problems' wording;
* :class:`DebateDataModule`: ``PromptDataModule`` plus ``problems: single_step`` (its training loader is
  :class:`datamodules.resumable.ResumableDataLoader`, as every training loader here: exact mid-epoch resumes);
* :class:`SingleStepSFTDataModule`: (system, prompt, response) pairs for :class:`modules.sft.CausalLMSFT` with a
  mix of right and wrong solutions and, independently of correctness, filler sentences (so that a judge biased by
  such a phrase has a behaviour to reward that is unrelated to being right: the reward-hacking study).
"""

from __future__ import annotations

import random
from typing import Any

import lightning as L
from torch.utils.data import DataLoader

from datamodules.arithmetic import _FILLER, _ITEMS, _NAMES
from datamodules.prompts import PromptDataModule
from datamodules.resumable import ResumableDataLoader

__all__ = ["DebateDataModule", "SingleStepSFTDataModule", "single_step_problems", "single_step_solution"]


def single_step_problems(n: int, seed: int = 0, max_operand: int = 9) -> list[dict[str, Any]]:
    """``n`` problems ``{"prompt", "reference", "a", "b", "name", "item"}``: start with ``a``, get ``b`` more.

    Raises:
        ValueError: for ``n < 0`` or ``max_operand < 1``.
    """
    if n < 0 or max_operand < 1:
        raise ValueError(f"need n >= 0 and max_operand >= 1, got n={n}, max_operand={max_operand}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
        prompt = f"{name} has {a} {item}. Then, {name} buys {b} more. How many {item} does {name} have now?"
        out.append({"prompt": prompt, "reference": str(a + b), "a": a, "b": b, "name": name, "item": item})
    return out


def single_step_solution(problem: dict[str, Any], result: int, filler: str | None = None) -> str:
    """A worked solution in the default problems' style whose (possibly wrong) result is ``result``."""
    p = problem
    sentences = [
        f"{p['name']} starts with {p['a']} {p['item']}.",
        f"After adding {p['b']}, {p['name']} has {p['a']} + {p['b']} = {result} {p['item']}.",
        f"The answer is \\boxed{{{result}}}.",
    ]
    if filler:
        sentences.insert(1, filler)
    return " ".join(sentences)


class DebateDataModule(PromptDataModule):
    """:class:`~datamodules.prompts.PromptDataModule` with a choice of generated problems.

    Args:
        problems: Generated problems when no ``path``/``name`` is given: ``arithmetic`` (2–4 steps, the default
            of the suite) or ``single_step`` (one addition of one-digit numbers).
        max_operand: Largest operand of ``single_step`` problems.
        **kwargs: Everything :class:`~datamodules.prompts.PromptDataModule` takes (``val_fraction: 0.5`` for the
            paper's split).
    """

    def __init__(self, problems: str = "arithmetic", max_operand: int = 9, **kwargs: Any) -> None:
        if problems not in ("arithmetic", "single_step"):
            raise ValueError(f"problems must be 'arithmetic' or 'single_step', got {problems!r}")
        super().__init__(**kwargs)
        self.problems, self.max_operand = problems, max_operand

    def setup(self, stage: str | None = None) -> None:  # noqa: D102
        hp = self.hparams
        if self.splits or self.problems == "arithmetic" or hp.path is not None or hp.name is not None:
            super().setup(stage)
            return
        rows = single_step_problems(
            hp.num_prompts, seed=hp.seed + hp.generation_seed_offset, max_operand=self.max_operand
        )
        unique, seen = [], set()
        for r in rows:
            if r["prompt"] not in seen:
                seen.add(r["prompt"])
                unique.append({"prompt": r["prompt"], "reference": r["reference"]})
        random.Random(hp.seed).shuffle(unique)
        n_val, n_test = round(len(unique) * hp.val_fraction), round(len(unique) * hp.test_fraction)
        self.splits = {
            "val": unique[:n_val],
            "test": unique[n_val : n_val + n_test],
            "train": unique[n_val + n_test :],
        }
        if not self.splits["train"]:
            raise ValueError("no training prompts left after the validation/test split")


def _collate(items):
    systems, prompts, responses = zip(*items)
    return {"system": list(systems), "prompt": list(prompts), "response": list(responses)}


class SingleStepSFTDataModule(L.LightningDataModule):
    """Warm-start pairs on single-step problems: right and wrong solutions, some with a filler sentence.

    Args:
        num_prompts: Problems generated (seed offset 3_000_017, so they differ from the game's).
        correct_fraction: Share of solutions whose result is right; the others are off by 1 or 2.
        filler_fraction: Share of solutions (right or wrong alike) with one filler sentence from
            :data:`datamodules.arithmetic._FILLER`.
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
        for name, v in (("correct_fraction", correct_fraction), ("filler_fraction", filler_fraction)):
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {v}")
        self.save_hyperparameters(logger=False)
        self.train_pairs: list[tuple[str, str, str]] = []
        self.val_pairs: list[tuple[str, str, str]] = []

    def setup(self, stage: str | None = None) -> None:  # noqa: D102
        if self.train_pairs:
            return
        hp = self.hparams
        rng = random.Random(hp.seed)
        pairs = []
        for p in single_step_problems(hp.num_prompts, seed=hp.seed + 3_000_017, max_operand=hp.max_operand):
            result = int(p["reference"])
            if rng.random() >= hp.correct_fraction:
                result = max(0, result + rng.choice([-2, -1, 1, 2]))
                result = result if result != int(p["reference"]) else result + 1
            filler = rng.choice(_FILLER) if rng.random() < hp.filler_fraction else None
            pairs.append((hp.system_prompt, p["prompt"], single_step_solution(p, result, filler)))
        n_val = max(1, round(len(pairs) * hp.val_fraction))
        self.val_pairs, self.train_pairs = pairs[:n_val], pairs[n_val:]

    def train_dataloader(self):  # noqa: D102
        # resumes mid-epoch: the order comes from seed + epoch, the position is checkpointed
        return ResumableDataLoader(
            self.train_pairs,
            batch_size=self.hparams.batch_size,
            shuffle=True,
            seed=self.hparams.seed,
            collate_fn=_collate,
        )

    def val_dataloader(self):  # noqa: D102
        return DataLoader(self.val_pairs, batch_size=self.hparams.batch_size, shuffle=False, collate_fn=_collate)
