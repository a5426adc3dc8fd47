"""Held-out evaluation of a trained Leader–Follower pair against the reference pair (paper §3.2, §5.3, G.1, G.3).

Scores are ensemble variances laid out ``[P, R]``: P prompts × R response pairs per prompt. A triplet is an α-online
candidate when ``Var ≥ F_ref^{-1}(1 − α)`` of the reference pair's scores (Definition 3.2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from alignment_games.modules.algorithms.checks import require_at_least, require_in_range


def resample_prompts(n: int, n_boot: int, seed: int) -> Tensor:
    """``[n_boot, n]`` prompt indices drawn with replacement: the resamples every prompt bootstrap here shares.

    Raises:
        ValueError: for ``n_boot`` below 1.
    """
    require_at_least(n_boot=(n_boot, 1))
    return torch.randint(0, n, (n_boot, n), generator=torch.Generator().manual_seed(int(seed)))


def interval_ends(level: float) -> Tensor:
    """The ``(1 - level) / 2`` and ``(1 + level) / 2`` quantile levels of a two-sided interval."""
    return torch.tensor([(1 - level) / 2, 1 - (1 - level) / 2], dtype=torch.float64)


def _check_pair_shapes(trained: Tensor, reference: Tensor) -> None:
    if trained.shape != reference.shape or trained.ndim != 2 or trained.numel() == 0:
        raise ValueError(
            f"trained and reference scores must share a non-empty [P, R] shape, got {tuple(trained.shape)} and "
            f"{tuple(reference.shape)}"
        )


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
        require_in_range("alpha", a, 0, 1, open_low=True, open_high=True)
        out[float(a)] = float(torch.quantile(ref, 1.0 - a))
    return out


def adversarial_yield(oracle_prob: Tensor, ensemble_mean: Tensor, epsilon: float) -> float:
    """The share of the labelled (finite ``oracle_prob``) triplets that are ε-adversarial (§5.3.2); NaN if none."""
    labelled = torch.isfinite(oracle_prob)
    adversarial = adversarial_mask(oracle_prob, ensemble_mean, epsilon)[labelled]
    return float(adversarial.double().mean()) if adversarial.numel() else math.nan


def adversarial_mask(oracle_prob: Tensor, ensemble_mean: Tensor, epsilon: float) -> Tensor:
    """Definition 3.1: ``(P* − ½)(P̄ − ½) < 0`` and ``|P* − ½| > ε``.

    Raises:
        ValueError: for ε outside [0, ½).
    """
    require_in_range("epsilon", epsilon, 0, 0.5, open_high=True)
    return ((oracle_prob - 0.5) * (ensemble_mean - 0.5) < 0) & ((oracle_prob - 0.5).abs() > epsilon)


def prompt_bootstrap_mean(
    values: Tensor, n_boot: int = 1000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Prompt-bootstrap interval of the mean of ``values[P, R]`` (resampling prompts, all R pairs of each)."""
    per_prompt = values.double().mean(dim=1)
    means = per_prompt[resample_prompts(per_prompt.numel(), n_boot, seed)].mean(dim=1)
    lo, hi = torch.quantile(means, interval_ends(level))
    return float(lo), float(hi)


def prompt_bootstrap_share(
    hits: Tensor, counted: Tensor, n_boot: int = 1000, seed: int = 0, level: float = 0.95
) -> tuple[float, float, float]:
    """``(share, low, high)``: ``Σ hits / Σ counted`` over ``[P, R]`` masks, a ratio of sums per prompt resample.

    A resample that counts nothing is left out; NaNs when nothing is counted.

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
    idx = resample_prompts(num.numel(), n_boot, seed)
    boot_num, boot_den = num[idx].sum(dim=1), den[idx].sum(dim=1)
    shares = (boot_num / boot_den)[boot_den > 0]
    lo, hi = torch.quantile(shares, interval_ends(level))
    return float(num.sum() / den.sum()), float(lo), float(hi)


def candidate_yield_intervals(
    trained: Tensor,
    reference: Tensor,
    alphas: Sequence[float],
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    chunk: int = 200,
) -> dict[float, dict[str, list[float]]]:
    """Paired prompt-bootstrap intervals of both pairs' α-online candidate yields (Fig. 2a, §5.3.1).

    Each resample re-estimates ``F_ref^{-1}(1 − α)`` from its reference scores, so the interval holds the threshold's
    uncertainty and the within-prompt correlation; ``chunk`` resamples at once bound the memory.

    Raises:
        ValueError: for scores not a shared non-empty ``[P, R]``, an α outside (0, 1), or ``n_boot`` below 1.
    """
    _check_pair_shapes(trained, reference)
    for a in alphas:
        require_in_range("alpha", a, 0, 1, open_low=True, open_high=True)
    t, r = trained.detach().double(), reference.detach().double()
    n_prompts = t.shape[0]
    idx = resample_prompts(n_prompts, n_boot, seed)
    q = torch.tensor([1.0 - a for a in alphas], dtype=torch.float64)
    shares_t, shares_r = [], []
    for start in range(0, n_boot, chunk):
        rows = idx[start : start + chunk]
        boot_t, boot_r = t[rows].flatten(1), r[rows].flatten(1)  # [b, P·R]
        th = torch.quantile(boot_r, q, dim=1).T.unsqueeze(-1)  # [b, A, 1]: each resample's own thresholds
        shares_t.append((boot_t.unsqueeze(1) >= th).double().mean(dim=-1))  # [b, A]
        shares_r.append((boot_r.unsqueeze(1) >= th).double().mean(dim=-1))
    ends = interval_ends(level)
    lo_hi_t = torch.quantile(torch.cat(shares_t), ends, dim=0).T.tolist()  # [A, 2]
    lo_hi_r = torch.quantile(torch.cat(shares_r), ends, dim=0).T.tolist()
    return {float(a): {"trained": lo_hi_t[i], "reference": lo_hi_r[i]} for i, a in enumerate(alphas)}


def reversal_capture(
    variance: Tensor,
    oracle_prob: Tensor,
    ensemble_mean: Tensor,
    threshold: float,
    epsilon: float = 0.0,
    n_boot: int = 1000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """``(share, low, high)`` of a pair's labelled oracle reversals that its α-online candidates capture (§5.3.2).

    A reversal is Definition 3.1 at margin ``epsilon`` (0: "capturing 49.2% of all their reversals"); candidates have
    ``Var ≥ threshold``. NaNs when the pair has no labelled reversal.

    Raises:
        ValueError: for ε outside [0, ½), or tensors that do not share a ``[P, R]`` shape.
    """
    if not (variance.shape == oracle_prob.shape == ensemble_mean.shape) or variance.ndim != 2:
        raise ValueError(
            f"variance, oracle_prob and ensemble_mean must share a [P, R] shape, got {tuple(variance.shape)}, "
            f"{tuple(oracle_prob.shape)}, {tuple(ensemble_mean.shape)}"
        )
    reversal = adversarial_mask(oracle_prob, ensemble_mean, epsilon) & torch.isfinite(oracle_prob)
    return prompt_bootstrap_share(reversal & (variance >= threshold), reversal, n_boot, seed)


def adversarial_report(
    variance: Tensor,
    oracle_prob: Tensor,
    ensemble_mean: Tensor,
    thresholds: dict[str, float],
    epsilons: Sequence[float],
    n_boot: int = 1000,
    seed: int = 0,
) -> dict:
    """Oracle-confirmed errors among one pair's labelled triplets ``[P, R]`` (§5.3.2, Fig. 2b; App. G.3, Fig. 5).

    Per ε and per α of ``thresholds``: ``adversarial`` share, ``joint`` (candidate and adversarial), ``precision``
    among candidates with its ``enrichment`` over the plain share, and ``captured`` (:func:`reversal_capture`); each
    as ``[value, low, high]``.
    """
    labelled = torch.isfinite(oracle_prob)
    out: dict = {"labelled": int(labelled.sum())}
    for eps in epsilons:
        adversarial = adversarial_mask(oracle_prob, ensemble_mean, eps) & labelled
        plain = prompt_bootstrap_share(adversarial, labelled, n_boot, seed)
        per_eps: dict = dict(adversarial=list(plain), joint={}, precision={}, enrichment={}, captured={}, candidates={})
        for alpha, threshold in thresholds.items():
            candidate = (variance >= threshold) & labelled
            per_eps["candidates"][alpha] = int(candidate.sum())
            per_eps["joint"][alpha] = list(prompt_bootstrap_share(adversarial & candidate, labelled, n_boot, seed))
            precision = prompt_bootstrap_share(adversarial & candidate, candidate, n_boot, seed)
            per_eps["precision"][alpha] = list(precision)
            per_eps["enrichment"][alpha] = precision[0] / plain[0] if plain[0] > 0 else math.nan
            captured = reversal_capture(variance, oracle_prob, ensemble_mean, threshold, eps, n_boot, seed)
            per_eps["captured"][alpha] = list(captured)
        out[str(eps)] = per_eps
    return out


def compare_pairs(
    trained: Tensor, reference: Tensor, alphas: Sequence[float] = (0.1, 0.05, 0.01), n_boot: int = 1000, seed: int = 0
) -> dict:
    """Trained pair vs reference pair on the same prompts, scores ``[P, R]`` each: summaries, gain, candidate yields.

    Raises:
        ValueError: when the two tensors differ in shape or are not ``[P, R]``.
    """
    _check_pair_shapes(trained, reference)
    t, r = trained.double(), reference.double()
    thresholds = candidate_thresholds(r, alphas)

    def summary(v: Tensor, s: int) -> dict:
        lo, hi = prompt_bootstrap_mean(v, n_boot, s)
        return {"mean": float(v.mean()), "median": float(v.flatten().median()), "mean_ci": [lo, hi]}

    gain_lo, gain_hi = prompt_bootstrap_mean(t - r, n_boot, seed)
    intervals = candidate_yield_intervals(t, r, list(thresholds), n_boot, seed)
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
        "candidate_yield_ci": {str(a): ci for a, ci in intervals.items()},
    }
