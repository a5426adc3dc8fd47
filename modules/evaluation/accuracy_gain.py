r"""How much a game raised a policy's greedy held-out accuracy: per seed, paired over problems, and across seeds.

Every trained policy (one per training seed) and the policy it started from answer the same held-out problems
greedily; a problem is solved when the reply's last ``\boxed{}`` matches the reference
(:func:`~modules.evaluation.policy_accuracy.score_replies`'s rule). Per seed the gain is ``after − before`` with a
bootstrap interval over problems (the same resampled problems for both, so the pairing is kept); across seeds the
mean gain has a Student-t interval with ``seeds − 1`` degrees of freedom: the seeds are the independent training
runs, and with 3 of them the interval is wide (t = 4.30), which is the honest price of 3 seeds. The t interval only
sees the seeds' spread, so seeds with equal gains give it width 0; the report therefore also gives the seeds' mean
gain with a bootstrap interval over problems (each problem's gain averaged over the seeds), which keeps the width that
600 problems leave.

    python -m alignment_games.commands.accuracy_gain --base artifacts/competent_policy \
        --trained runs/grpo_competent/version_0/export/policy runs/grpo_competent/version_1/export/policy ...

A pool trains several players per seed: ``--players-per-seed m`` reads the trained folders as consecutive groups of m
(one seed's players), and a seed's gain is its players' mean (each problem's gain averaged over them, bootstrapped
over problems); the interval across seeds is over those means.

A trained folder is anything ``from_pretrained`` loads: a full model, a merged export, or an exported LoRA adapter
(``export/<player>/``, loaded over the base its ``adapter_config.json`` names).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from alignment_games.modules.algorithms.answers import answers_match, extract_final_answer
from alignment_games.modules.evaluation.policy_accuracy import greedy_replies

__all__ = ["HELD_OUT_SEED", "paired_gain", "seed_interval", "seed_mean_gain", "solved"]

#: problems no game trains on: the games draw theirs from ``seed + 1_000_003`` (GRPO trains on most of that set) and
#: the SFT warm starts from ``seed + 2_000_003``, for small seeds
HELD_OUT_SEED = 7_000_003


def paired_gain(
    before: Sequence[bool], after: Sequence[bool], n_boot: int = 2000, seed: int = 0, confidence: float = 0.95
) -> dict[str, Any]:
    """Accuracy before and after on the same problems, and the gain with a paired bootstrap interval.

    Example:
        >>> out = paired_gain([True, False, False, False], [True, True, False, True])
        >>> out["before"], out["after"], out["gain"]
        (0.25, 0.75, 0.5)

    Raises:
        ValueError: for lists of different lengths, no problems, or ``n_boot < 1``.
    """
    if len(before) != len(after):
        raise ValueError(f"before has {len(before)} problems but after has {len(after)}")
    diff = torch.tensor([float(a) - float(b) for b, a in zip(before, after)], dtype=torch.float64)
    interval = _bootstrap_mean_interval(diff, n_boot, seed, confidence)
    n = len(diff)
    return {
        "n": n,
        "before": sum(map(bool, before)) / n,
        "after": sum(map(bool, after)) / n,
        "gain": float(diff.mean()),
        "gain_ci": interval,
    }


def seed_mean_gain(
    before: Sequence[bool],
    afters: Sequence[Sequence[bool]],
    n_boot: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """The seeds' mean gain with a bootstrap interval over problems: each problem's gain averaged over the seeds.

    Example:
        >>> seed_mean_gain([False, False, True, True], [[True, False, True, True], [True, True, True, False]])["gain"]
        0.25

    Raises:
        ValueError: for no seeds, a seed whose list is not as long as ``before``, no problems, or ``n_boot < 1``.
    """
    if not afters:
        raise ValueError("no trained policies")
    for i, after in enumerate(afters):
        if len(after) != len(before):
            raise ValueError(f"before has {len(before)} problems but trained policy {i} has {len(after)}")
    solved_after = torch.tensor([[float(a) for a in after] for after in afters], dtype=torch.float64)
    diff = solved_after.mean(dim=0) - torch.tensor([float(b) for b in before], dtype=torch.float64)
    return {
        "seeds": len(afters),
        "gain": float(diff.mean()),
        "gain_ci": _bootstrap_mean_interval(diff, n_boot, seed, confidence),
    }


def _bootstrap_mean_interval(diff: torch.Tensor, n_boot: int, seed: int, confidence: float) -> list[float]:
    """Percentile bootstrap interval of the mean of ``diff`` (problems resampled with replacement).

    Raises:
        ValueError: for no problems or ``n_boot < 1``.
    """
    if not len(diff):
        raise ValueError("no problems")
    if n_boot < 1:
        raise ValueError(f"n_boot must be at least 1, got {n_boot}")
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(diff), (n_boot, len(diff)), generator=gen)
    means = diff[idx].mean(dim=1)
    tail = (1 - confidence) / 2
    return torch.quantile(means, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()


def seed_interval(values: Sequence[float], confidence: float = 0.95) -> dict[str, Any]:
    """Mean of per-seed values with a Student-t interval (``len(values) − 1`` degrees of freedom).

    Example:
        >>> out = seed_interval([0.05, 0.07, 0.09])
        >>> round(out["mean"], 4), [round(x, 4) for x in out["ci"]]
        (0.07, [0.0203, 0.1197])

    Raises:
        ValueError: for fewer than two values (one seed has no spread to estimate).
    """
    from scipy.stats import t

    if len(values) < 2:
        raise ValueError(f"an interval over seeds needs at least 2 seeds, got {len(values)}")
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "ci": [mean - half, mean + half]}


def solved(
    model_path: str, prompts: Sequence[str], references: Sequence[str], system_prompt: str, max_new_tokens: int
) -> list[bool]:
    """Whether the greedy reply of the policy in ``model_path`` solves each problem."""
    from alignment_games.modules.lm.models import load_model, load_tokenizer

    model = load_model(model_path, task="causal_lm")
    tokenizer = load_tokenizer(model_path)
    replies = greedy_replies(model, tokenizer, prompts, system_prompt, max_new_tokens, batch_size=32)
    return [answers_match(extract_final_answer(y), r) for y, r in zip(replies, references)]
