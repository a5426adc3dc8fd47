"""Problems for the debate game that a tiny CPU model can solve (``a + b``), so the judge's MCC sees both classes."""

from __future__ import annotations

import random
from typing import Any

from typing_extensions import override

from alignment_games.datamodules.prompts import PromptDataModule, shuffled_cuts
from alignment_games.modules.algorithms.arithmetic import _ITEMS, _NAMES


def single_step_problems(n: int, seed: int = 0, max_operand: int = 9) -> list[dict[str, Any]]:
    """``n`` problems ``{"prompt", "reference", "a", "b", "name", "item"}``: start with ``a``, get ``b`` more.

    Raises:
        ValueError: for ``n < 0`` or ``max_operand < 1``.
    """
    if n < 0 or max_operand < 1:
        raise ValueError(f"need n >= 0 and max_operand >= 1, got n={n}, max_operand={max_operand}")
    rng, out = random.Random(seed), []
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
    """:class:`~alignment_games.datamodules.prompts.PromptDataModule` with a choice of generated problems.

    Args:
        problems: Generated problems without ``path``/``name``: ``arithmetic`` (2–4 steps) or ``single_step``.
        max_operand: Largest operand of ``single_step`` problems.
        **kwargs: Everything :class:`~alignment_games.datamodules.prompts.PromptDataModule` takes.
    """

    def __init__(self, problems: str = "arithmetic", max_operand: int = 9, **kwargs: Any) -> None:
        if problems not in ("arithmetic", "single_step"):
            raise ValueError(f"problems must be 'arithmetic' or 'single_step', got {problems!r}")
        super().__init__(**kwargs)
        self.problems, self.max_operand = problems, max_operand

    @override
    def setup(self, stage: str | None = None) -> None:
        hp = self.hparams
        if self.splits or self.problems == "arithmetic" or not self.source.generated:
            super().setup(stage)
            return
        rows = single_step_problems(hp.num_prompts, hp.seed + hp.generation_seed_offset, self.max_operand)
        first = {r["prompt"]: r["reference"] for r in rows}  # each prompt once, where it first came; its sum is its own
        unique = [{"prompt": prompt, "reference": reference} for prompt, reference in first.items()]
        val, test, train = shuffled_cuts(unique, hp.seed, hp.val_fraction, hp.test_fraction)
        self.splits = {"val": val, "test": test, "train": train}
        if not train:
            raise ValueError("no training prompts left after the validation/test split")
