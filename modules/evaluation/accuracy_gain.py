"""How much a game raised a policy's greedy held-out accuracy: per seed, paired over problems, and across seeds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from alignment_games.modules.algorithms.answers import extract_final_answer
from alignment_games.modules.evaluation.intervals import crossed_bootstrap_interval, seed_intervals
from alignment_games.modules.evaluation.policy_accuracy import greedy_replies

#: problems no game trains on: the games draw theirs from ``seed + 1_000_003`` (GRPO trains on most of that set) and
#: the SFT warm starts from ``seed + 2_000_003``, for small seeds
HELD_OUT_SEED = 7_000_003


def paired_gain(
    before: Sequence[bool], after: Sequence[bool], n_boot: int = 2000, seed: int = 0, confidence: float = 0.95
) -> dict[str, Any]:
    """Accuracy before and after on the same problems, and the gain with a paired problem-bootstrap interval.

    Example:
        >>> paired_gain([True, False, False, False], [True, True, False, True])["gain"]
        0.5

    Raises:
        ValueError: for lists of different lengths, no problems, or ``n_boot < 1``.
    """
    if len(before) != len(after):
        raise ValueError(f"before has {len(before)} problems but after has {len(after)}")
    diff = torch.tensor([float(a) - float(b) for b, a in zip(before, after)], dtype=torch.float64)
    interval = crossed_bootstrap_interval(diff[None], n_boot, seed, confidence).tolist()  # one seed: the problems
    n = len(diff)
    rates = {"before": sum(map(bool, before)) / n, "after": sum(map(bool, after)) / n}
    return {"n": n, **rates, "gain": float(diff.mean()), "gain_ci": interval}


def seed_mean_gain(
    before: Sequence[bool],
    afters: Sequence[Sequence[bool]],
    n_boot: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
    players_per_seed: int = 1,
) -> dict[str, Any]:
    """The seeds' mean gain (a seed's: its ``players_per_seed`` consecutive players' mean) and its three intervals.

    Raises:
        ValueError: for no seeds or problems, lists of other lengths or groups, or ``n_boot < 1``.
    """
    if not afters:
        raise ValueError("no trained policies")
    for i, after in enumerate(afters):
        if len(after) != len(before):
            raise ValueError(f"before has {len(before)} problems but trained policy {i} has {len(after)}")
    m = players_per_seed
    if m < 1 or len(afters) % m:
        raise ValueError(f"players_per_seed {m}: the {len(afters)} trained policies are not groups of {m}")
    solved_after = torch.tensor([[float(a) for a in after] for after in afters], dtype=torch.float64)
    diff = solved_after.view(len(afters) // m, m, len(before)).mean(dim=1) - torch.tensor([float(b) for b in before])
    return dict(seeds=len(diff), gain=float(diff.mean()), intervals=seed_intervals(diff, n_boot, seed, confidence))


def final_answers(model_path: str, prompts: Sequence[str], system_prompt: str, max_new_tokens: int) -> list[str | None]:
    """The last ``\\boxed{}`` of the greedy reply of the policy in ``model_path`` to each prompt (``None``: no box).

    Kept apart from the scoring so that a report can tell a missing answer (the format) from a wrong one.
    """
    from alignment_games.modules.lm.models import load_model, load_tokenizer

    model, tokenizer = load_model(model_path, task="causal_lm"), load_tokenizer(model_path)
    replies = greedy_replies(model, tokenizer, prompts, system_prompt, max_new_tokens, 32)
    return [extract_final_answer(y) for y in replies]
