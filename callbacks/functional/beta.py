"""Beta(1, 1) posteriors for peak-checkpoint selection, P(Best) and gap recovery (debate RLAIF, App. A)."""

import math
from collections.abc import Mapping, Sequence
from typing import overload

import numpy as np

Group = tuple[float, float]  # (successes, trials)


def _check_counts(successes: float, trials: float) -> tuple[float, float]:
    successes, trials = float(successes), float(trials)
    if not (0.0 <= successes <= trials) or not math.isfinite(trials):
        raise ValueError(f"Need 0 <= successes <= trials (finite), got successes={successes}, trials={trials}.")
    return successes, trials


def beta_lower_bound(successes: float, trials: float, quantile: float = 0.025) -> float:
    """``quantile`` of the Beta(1 + successes, 1 + failures) posterior (0.025: the paper's 95% "lower bound").

    Raises:
        ValueError: unless ``0 <= successes <= trials`` and ``0 < quantile < 1``.

    Example:
        >>> round(beta_lower_bound(0, 9, quantile=0.5), 6)  # Beta(1, 10): 1 - 0.5 ** (1 / 10)
        0.066967
    """
    successes, trials = _check_counts(successes, trials)
    if not 0.0 < quantile < 1.0:
        raise ValueError(f"`quantile` must lie in (0, 1), got {quantile}.")
    from scipy import stats  # here, not at the top: the GRPO/deep-SMIDA import chain must not need scipy

    return float(stats.beta.ppf(quantile, 1.0 + successes, 1.0 + trials - successes))


def pooled_lower_bound(evaluations: Sequence[Group], window: int, quantile: float = 0.025) -> float:
    """:func:`beta_lower_bound` of the counts pooled over the last ``window`` evaluations (fewer pooled as they are).

    Raises:
        ValueError: on an empty ``evaluations`` or ``window < 1``.

    Example:
        >>> pooled_lower_bound([(90, 100), (5, 10), (6, 10)], window=2) == beta_lower_bound(11, 20)
        True
    """
    if window < 1:
        raise ValueError(f"`window` must be >= 1, got {window}.")
    if not evaluations:
        raise ValueError("No evaluations to pool.")
    recent = [_check_counts(s, n) for s, n in evaluations[-window:]]
    return beta_lower_bound(math.fsum(s for s, _ in recent), math.fsum(n for _, n in recent), quantile)


def posterior_mean(successes: float, trials: float) -> float:
    """Mean of the Beta(1 + successes, 1 + failures) posterior: ``(1 + successes) / (2 + trials)``."""
    successes, trials = _check_counts(successes, trials)
    return (1.0 + successes) / (2.0 + trials)


@overload
def p_best(groups: Mapping[str, Group], draws: int = ..., seed: int = ...) -> dict[str, float]: ...
@overload
def p_best(groups: Sequence[Group], draws: int = ..., seed: int = ...) -> list[float]: ...
def p_best(
    groups: Mapping[str, Group] | Sequence[Group], draws: int = 100_000, seed: int = 0
) -> dict[str, float] | list[float]:
    """Share of ``draws`` joint posterior draws in which each group's Beta sample is the highest.

    ``groups``: name → merged ``(successes, trials)`` (a dict comes back) or a sequence of them (a list). Correlated
    rollouts make it over-confident.

    Raises:
        ValueError: with no group, ``draws < 1`` or invalid counts.

    Example:
        >>> p_best({"debate": (740, 1000), "rlaif": (700, 1000)})["debate"] > 0.95
        True
    """
    names = list(groups) if isinstance(groups, Mapping) else None
    pairs = [groups[k] for k in names] if names is not None else list(groups)
    if not pairs:
        raise ValueError("`p_best` needs at least one group.")
    if draws < 1:
        raise ValueError(f"`draws` must be >= 1, got {draws}.")
    checked = [_check_counts(s, n) for s, n in pairs]
    alpha = np.array([1.0 + s for s, _ in checked])
    beta = np.array([1.0 + n - s for s, n in checked])
    samples = np.random.default_rng(seed).beta(alpha, beta, size=(draws, len(checked)))
    wins = np.bincount(samples.argmax(axis=1), minlength=len(checked))
    shares = [float(w) / draws for w in wins]
    return dict(zip(names, shares)) if names is not None else shares


def gap_recovery(debate: Group, baseline: Group, upper_bound: Group) -> float:
    """Share of the baseline-to-upper-bound gap that ``debate`` recovers, on :func:`posterior_mean` of merged counts.

    Raises:
        ValueError: if the upper bound's and the baseline's posterior means are equal (no gap to recover).

    Example:
        >>> gap_recovery(debate=(74, 98), baseline=(69, 98), upper_bound=(79, 98))
        0.5
    """
    m_debate, m_base, m_upper = (posterior_mean(*g) for g in (debate, baseline, upper_bound))
    if m_upper == m_base:
        raise ValueError("The upper bound and the baseline have the same posterior mean: there is no gap.")
    return (m_debate - m_base) / (m_upper - m_base)
