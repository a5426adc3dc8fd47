"""(system, prompt, response) triples for a supervised warm start of a game's players.

* :class:`ArithmeticSFTDataModule`: correct and corrupted solutions keep the warm-started reference diverse, so the
  ensemble sometimes disagrees about its replies.
* :class:`SingleStepSFTDataModule`: filler sentences independent of correctness give a biased judge a behaviour to
  reward that is unrelated to being right (the reward-hacking study).
"""

from __future__ import annotations

import random

import lightning as L
from torch.utils.data import DataLoader
from typing_extensions import override

from datamodules.arithmetic import _FILLER, CORRUPTIONS, generate_problems, make_response
from datamodules.debate import single_step_problems, single_step_solution
from datamodules.resumable import ResumableDataLoader
from modules.lm.prompts import FOLLOWER_SYSTEM, QWEN_SYSTEM
from modules.lm.text import fill_template

__all__ = ["ArithmeticSFTDataModule", "SingleStepSFTDataModule"]

Triple = tuple[str, str, str]


def _collate(items: list[Triple]) -> dict[str, list[str]]:
    systems, prompts, responses = zip(*items)
    return {"system": list(systems), "prompt": list(prompts), "response": list(responses)}


class _TriplesDataModule(L.LightningDataModule):
    """Triples made once by :meth:`triples`; the first ``val_fraction`` of them (at least one) validate.

    A subclass calls ``save_hyperparameters`` with ``val_fraction``, ``batch_size`` and ``seed`` among its arguments.
    """

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

    @override
    def train_dataloader(self) -> ResumableDataLoader:
        return ResumableDataLoader(
            self.train_pairs,
            batch_size=self.hparams.batch_size,
            shuffle=True,
            seed=self.hparams.seed,
            collate_fn=_collate,
        )

    @override
    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_pairs, batch_size=self.hparams.batch_size, shuffle=False, collate_fn=_collate)


class ArithmeticSFTDataModule(_TriplesDataModule):
    """Generated (question, solution) pairs.

    Args:
        num_prompts: Problems generated.
        kinds: Solution kinds to sample from (see :data:`datamodules.arithmetic.CORRUPTIONS`).
        weights: Sampling weights of the kinds (same length).
        val_fraction: Share of problems for validation.
        batch_size: Pairs per batch.
        seed: Seed (problems use ``seed + 2_000_003`` so they differ from the ensemble's and the game's).
        follower_fraction: Share of examples in the follower's format (App. E.4): another solution of the same
            problem in the system message, so a warm-started follower answers in kind instead of babbling.
        system_prompt: The leader's system message (the game's default).
        follower_system_template: The follower's system message with ``{leader_response}``.
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
    ) -> None:
        super().__init__()
        kinds = list(kinds or CORRUPTIONS)
        weights = list(weights or [1.0] * len(kinds))
        unknown = [k for k in kinds if k not in CORRUPTIONS]
        if unknown:
            raise ValueError(f"kinds: unknown {unknown}; expected some of {CORRUPTIONS}")
        if not 0.0 <= follower_fraction <= 1.0:
            raise ValueError(f"follower_fraction must be in [0, 1], got {follower_fraction}")
        if len(weights) != len(kinds) or min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(f"weights must be {len(kinds)} non-negative numbers with a positive sum, got {weights}")
        self.save_hyperparameters(logger=False)
        self.kinds, self.weights = kinds, weights

    @override
    def triples(self) -> list[Triple]:
        hp = self.hparams
        rng = random.Random(hp.seed)
        pairs = []
        for p in generate_problems(hp.num_prompts, seed=hp.seed + 2_000_003):
            kind = rng.choices(self.kinds, weights=self.weights)[0]
            system = hp.system_prompt
            if rng.random() < hp.follower_fraction:
                shown = make_response(p, rng.choices(self.kinds, weights=self.weights)[0], rng)
                system = fill_template(hp.follower_system_template, leader_response=shown)
            pairs.append((system, p.question, make_response(p, kind, rng)))
        return pairs


class SingleStepSFTDataModule(_TriplesDataModule):
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

    @override
    def triples(self) -> list[Triple]:
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
        return pairs
