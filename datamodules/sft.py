"""(prompt, response) pairs for a supervised warm start: generated arithmetic problems with solutions of every kind.

A mix of correct and corrupted solutions keeps the warm-started reference policy diverse, so the games start from a
policy whose replies the preference ensemble actually disagrees about sometimes.
"""

from __future__ import annotations

import random

import lightning as L
from torch.utils.data import DataLoader

from datamodules.arithmetic import CORRUPTIONS, generate_problems, make_response
from datamodules.resumable import ResumableDataLoader
from modules.deep_smida import FOLLOWER_SYSTEM, QWEN_SYSTEM
from modules.lm.text import fill_template

__all__ = ["ArithmeticSFTDataModule"]


def _collate(items):
    systems, prompts, responses = zip(*items)
    return {"system": list(systems), "prompt": list(prompts), "response": list(responses)}


class ArithmeticSFTDataModule(L.LightningDataModule):
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
        self.train_pairs: list[tuple[str, str, str]] = []
        self.val_pairs: list[tuple[str, str, str]] = []

    def setup(self, stage: str | None = None) -> None:  # noqa: D102
        if self.train_pairs:
            return
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
