"""Held-out evaluation of a trained Leader–Follower pair against the reference pair (paper §3.2, §5.3, G.1, G.3).

Scores are ensemble variances laid out ``[P, R]``: P prompts × R response pairs per prompt. A triplet is an α-online
candidate when ``Var ≥ F_ref^{-1}(1 − α)`` of the reference pair's scores (Definition 3.2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "adversarial_mask",
    "adversarial_report",
    "adversarial_yield",
    "candidate_thresholds",
    "compare_pairs",
    "prompt_bootstrap_mean",
    "prompt_bootstrap_share",
]


def candidate_thresholds(reference_scores: Tensor, alphas: Sequence[float]) -> dict[float, float]:
    """``F_ref^{-1}(1 − α)`` for each α, the empirical quantile (linear interpolation) of the reference scores.

    Raises:
        ValueError: for an α outside (0, 1) or no reference scores.
    """
    ref = reference_scores.detach().double().flatten()
    if ref.numel() == 0:
        raise ValueError("candidate thresholds need at least one reference score")
    out = {}
    for a in alphas:
        if not 0.0 < a < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {a}")
        out[float(a)] = float(torch.quantile(ref, 1.0 - a))
    return out


def adversarial_yield(oracle_prob: Tensor, ensemble_mean: Tensor, epsilon: float) -> float:
    """The share of the labelled triplets that are ε-adversarial (:func:`adversarial_mask`).

    §5.3.2 reports "the fraction of all labelled triplets": a triplet without an oracle label (NaN: no valid
    verdict) is left out of both counts; NaN when none is labelled.
    """
    labelled = torch.isfinite(oracle_prob)
    adversarial = adversarial_mask(oracle_prob, ensemble_mean, epsilon)[labelled]
    return float(adversarial.double().mean()) if adversarial.numel() else math.nan


def adversarial_mask(oracle_prob: Tensor, ensemble_mean: Tensor, epsilon: float) -> Tensor:
    """Definition 3.1: ``(P* − ½)(P̄ − ½) < 0`` and ``|P* − ½| > ε``.

    Raises:
        ValueError: for ε outside [0, ½).
    """
    if not 0.0 <= epsilon < 0.5:
        raise ValueError(f"epsilon must be in [0, 0.5), got {epsilon}")
    return ((oracle_prob - 0.5) * (ensemble_mean - 0.5) < 0) & ((oracle_prob - 0.5).abs() > epsilon)


def prompt_bootstrap_mean(
    values: Tensor, n_boot: int = 1000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Prompt-bootstrap interval of the mean of ``values[P, R]`` (resampling prompts, all R pairs of each)."""
    g = torch.Generator().manual_seed(seed)
    per_prompt = values.double().mean(dim=1)
    idx = torch.randint(0, per_prompt.numel(), (n_boot, per_prompt.numel()), generator=g)
    means = per_prompt[idx].mean(dim=1)
    lo, hi = torch.quantile(means, torch.tensor([(1 - level) / 2, 1 - (1 - level) / 2], dtype=torch.float64))
    return float(lo), float(hi)


def prompt_bootstrap_share(
    hits: Tensor, counted: Tensor, n_boot: int = 1000, seed: int = 0, level: float = 0.95
) -> tuple[float, float, float]:
    """A share ``Σ hits / Σ counted`` over ``[P, R]`` masks, with its prompt-bootstrap interval.

    Prompts are resampled with all their R triplets, and the share is recomputed as a ratio of sums in each resample:
    the number of counted triplets differs between prompts (a triplet without a valid oracle verdict, or one that is not
    a candidate, is not counted), so the mean of per-prompt shares would weight prompts wrongly. A resample that counts
    nothing is left out of the quantiles.

    Returns:
        ``(share, low, high)``; NaNs when nothing is counted.

    Raises:
        ValueError: when the masks differ in shape or are not ``[P, R]``, or a hit is not counted.
    """
    if hits.shape != counted.shape or hits.ndim != 2:
        raise ValueError(f"hits and counted must share a [P, R] shape, got {tuple(hits.shape)}, {tuple(counted.shape)}")
    if bool((hits & ~counted).any()):
        raise ValueError("every hit must be a counted triplet")
    num, den = hits.double().sum(dim=1), counted.double().sum(dim=1)
    if float(den.sum()) == 0:
        return math.nan, math.nan, math.nan
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, num.numel(), (n_boot, num.numel()), generator=g)
    boot_num, boot_den = num[idx].sum(dim=1), den[idx].sum(dim=1)
    shares = (boot_num / boot_den)[boot_den > 0]
    q = torch.tensor([(1 - level) / 2, 1 - (1 - level) / 2], dtype=torch.float64)
    lo, hi = torch.quantile(shares, q)
    return float(num.sum() / den.sum()), float(lo), float(hi)


def adversarial_report(
    variance: Tensor,
    oracle_prob: Tensor,
    ensemble_mean: Tensor,
    thresholds: dict[str, float],
    epsilons: Sequence[float],
    n_boot: int = 1000,
    seed: int = 0,
) -> dict:
    """Oracle-confirmed errors among one pair's triplets ``[P, R]`` (§5.3.2, Fig. 2b; App. G.3, Fig. 5).

    Over the labelled triplets (a finite oracle probability), for each ε and each α of ``thresholds`` (the reference
    pair's ``F_ref^{-1}(1 − α)``, shared by both pairs as in §5.3.1):

    - ``adversarial``: the share that is ε-adversarial (Definition 3.1), "the fraction of all labelled triplets";
    - ``joint``: the share that is both an α-online candidate (``Var ≥`` threshold, Definition 3.2) and ε-adversarial,
      the joint yield of Fig. 2(b);
    - ``precision``: among labelled α-online candidates, the share that is ε-adversarial (Fig. 5), and
      ``enrichment``, precision over the plain adversarial share ("a 1.53-fold enrichment over random selection").

    Each share comes as ``[value, low, high]`` with a prompt-bootstrap interval (:func:`prompt_bootstrap_share`).
    """
    labelled = torch.isfinite(oracle_prob)
    out: dict = {"labelled": int(labelled.sum())}
    for eps in epsilons:
        adversarial = adversarial_mask(oracle_prob, ensemble_mean, eps) & labelled
        plain = prompt_bootstrap_share(adversarial, labelled, n_boot, seed)
        per_eps: dict = {"adversarial": list(plain), "joint": {}, "precision": {}, "enrichment": {}, "candidates": {}}
        for alpha, threshold in thresholds.items():
            candidate = (variance >= threshold) & labelled
            per_eps["candidates"][alpha] = int(candidate.sum())
            per_eps["joint"][alpha] = list(prompt_bootstrap_share(adversarial & candidate, labelled, n_boot, seed))
            precision = prompt_bootstrap_share(adversarial & candidate, candidate, n_boot, seed)
            per_eps["precision"][alpha] = list(precision)
            per_eps["enrichment"][alpha] = precision[0] / plain[0] if plain[0] > 0 else math.nan
        out[str(eps)] = per_eps
    return out


def compare_pairs(
    trained: Tensor,
    reference: Tensor,
    alphas: Sequence[float] = (0.1, 0.05, 0.01),
    n_boot: int = 1000,
    seed: int = 0,
) -> dict:
    """Trained pair vs reference pair on the same prompts, scores ``[P, R]`` each.

    Returns:
        ``trained``/``reference`` summaries (mean, median, mean's bootstrap interval), ``mean_gain`` with its paired
        prompt-bootstrap interval, ``share_prompts_higher`` (prompts where the trained pair's mean score is higher),
        ``thresholds`` per α from the reference quantiles, and ``candidate_yield`` per α for both pairs.

    Raises:
        ValueError: when the two tensors differ in shape or are not ``[P, R]``.
    """
    if trained.shape != reference.shape or trained.ndim != 2 or trained.numel() == 0:
        raise ValueError(
            f"trained and reference scores must share a non-empty [P, R] shape, got {tuple(trained.shape)} and "
            f"{tuple(reference.shape)}"
        )
    t, r = trained.double(), reference.double()
    thresholds = candidate_thresholds(r, alphas)

    def summary(v: Tensor, s: int) -> dict:
        lo, hi = prompt_bootstrap_mean(v, n_boot, s)
        return {"mean": float(v.mean()), "median": float(v.flatten().median()), "mean_ci": [lo, hi]}

    gain_lo, gain_hi = prompt_bootstrap_mean(t - r, n_boot, seed)
    return {
        "n_prompts": int(t.shape[0]),
        "pairs_per_prompt": int(t.shape[1]),
        "trained": summary(t, seed),
        "reference": summary(r, seed),
        "mean_gain": float((t - r).mean()),
        "mean_gain_ci": [gain_lo, gain_hi],
        "share_prompts_higher": float((t.mean(dim=1) > r.mean(dim=1)).double().mean()),
        "thresholds": {str(a): v for a, v in thresholds.items()},
        "candidate_yield": {
            str(a): {"trained": float((t >= v).double().mean()), "reference": float((r >= v).double().mean())}
            for a, v in thresholds.items()
        },
    }
