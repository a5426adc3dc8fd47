"""The math behind the callbacks, as small plain functions.

Nothing here imports Lightning or torch, so every rule can be tested exactly and reused outside a ``Trainer``:

- :func:`warmup_learning_rates`: the joint leader-rate / follower-to-leader-ratio warm-up of deep-smida
  (Stackelberg preference games, App. D.1).
- :func:`elo_expected_score`, :func:`elo_update`, :func:`decayed_k_factor`, :func:`sample_std`,
  :func:`effective_k_factor`, :func:`weighted_score`: the adapted Elo reputation rule (multi-LLM Stackelberg
  alignment, §2.3 and App. C).
- :func:`matthews_corrcoef_from_counts`, :func:`least_squares_slope`: judge MCC and its trend (debate RLAIF,
  "Metrics").
- :func:`beta_lower_bound`, :func:`pooled_lower_bound`, :func:`posterior_mean`, :func:`p_best`,
  :func:`gap_recovery`: peak selection under a Beta(1, 1) prior (debate RLAIF, App. A).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import overload

import numpy as np
from scipy import stats

__all__ = [
    "beta_lower_bound",
    "decayed_k_factor",
    "effective_k_factor",
    "elo_expected_score",
    "elo_update",
    "gap_recovery",
    "least_squares_slope",
    "matthews_corrcoef_from_counts",
    "p_best",
    "pooled_lower_bound",
    "posterior_mean",
    "sample_std",
    "warmup_learning_rates",
    "weighted_score",
]

# --------------------------------------------------------------------------------------------------------------------
# Two-timescale warm-up
# --------------------------------------------------------------------------------------------------------------------


def warmup_learning_rates(
    step: int, initial_lr: float, leader_lr: float, follower_lr: float, warmup_steps: int
) -> tuple[float, float, float]:
    r"""Leader rate, follower rate and follower/leader ratio after ``step`` warm-up steps.

    The schedule of App. D.1: with :math:`p_t = \min(t / T_{warm}, 1)`,

    .. math::
        \eta^L_t = \eta^L_{init} + p_t (\eta^L - \eta^L_{init}), \qquad
        \eta^F_t = \eta^L_t \, [1 + p_t (\eta^F / \eta^L - 1)].

    Both rates equal ``initial_lr`` at step 0 and their targets from step ``warmup_steps`` on.
    ``warmup_steps == 0`` means no warm-up (``p_t = 1``).

    Args:
        step: number of training batches already taken (0 for the first batch).
        initial_lr: :math:`\eta^L_{init}`, the leader's (and follower's) rate at step 0.
        leader_lr: :math:`\eta^L`, the leader's target rate.
        follower_lr: :math:`\eta^F`, the follower's target rate.
        warmup_steps: :math:`T_{warm}`.

    Returns:
        ``(leader_rate, follower_rate, ratio)`` with ``follower_rate == leader_rate * ratio``.

    Raises:
        ValueError: if ``step`` or ``warmup_steps`` is negative or ``leader_lr`` is not positive.

    Example::

        >>> warmup_learning_rates(2, initial_lr=1.0, leader_lr=3.0, follower_lr=6.0, warmup_steps=4)
        (2.0, 3.0, 1.5)
    """
    if step < 0:
        raise ValueError(f"`step` must be >= 0, got {step}.")
    if warmup_steps < 0:
        raise ValueError(f"`warmup_steps` must be >= 0, got {warmup_steps}.")
    if leader_lr <= 0:
        raise ValueError(f"`leader_lr` must be > 0, got {leader_lr}.")
    progress = 1.0 if warmup_steps == 0 else min(step / warmup_steps, 1.0)
    leader = initial_lr + progress * (leader_lr - initial_lr)
    ratio = 1.0 + progress * (follower_lr / leader_lr - 1.0)
    return leader, leader * ratio, ratio


# --------------------------------------------------------------------------------------------------------------------
# Elo reputations
# --------------------------------------------------------------------------------------------------------------------


def _check_score(score: float) -> float:
    score = float(score)
    if not 0.0 <= score <= 1.0:  # also rejects NaN
        raise ValueError(f"An Elo score must lie in [0, 1] (1 = win, 0.5 = draw, 0 = loss), got {score}.")
    return score


def elo_expected_score(rating_a: float, rating_b: float, scale: float = 400.0) -> float:
    r"""Expected score of player a against player b: :math:`E_a = 1 / (1 + 10^{(R_b - R_a) / s})`.

    Args:
        rating_a: rating of player a.
        rating_b: rating of player b.
        scale: the logistic scale :math:`s` (400 in chess: a 400-point gap means 10:1 odds).

    Example::

        >>> elo_expected_score(1000.0, 1000.0)
        0.5
    """
    return 1.0 / (1.0 + 10.0 ** ((rating_b - rating_a) / scale))


def elo_update(
    rating_a: float,
    rating_b: float,
    score_a: float,
    k_a: float,
    k_b: float | None = None,
    scale: float = 400.0,
) -> tuple[float, float]:
    r"""Ratings of a and b after one duel: :math:`R'_a = R_a + K_a (S_a - E_a)`, :math:`R'_b = R_b - K_b (S_a - E_a)`.

    Both updates use the ratings from before the duel. With ``k_a == k_b`` the update is zero-sum.

    Args:
        rating_a: rating of player a before the duel.
        rating_b: rating of player b before the duel.
        score_a: a's score in [0, 1]; b scores ``1 - score_a``.
        k_a: K factor of player a.
        k_b: K factor of player b (defaults to ``k_a``).
        scale: the logistic scale of :func:`elo_expected_score`.

    Returns:
        ``(new_rating_a, new_rating_b)``.

    Raises:
        ValueError: if ``score_a`` is outside [0, 1] or a K factor is negative.

    Example::

        >>> elo_update(1000.0, 1000.0, 1.0, k_a=32.0)
        (1016.0, 984.0)
    """
    score_a = _check_score(score_a)
    k_b = k_a if k_b is None else k_b
    if k_a < 0 or k_b < 0:
        raise ValueError(f"K factors must be >= 0, got k_a={k_a}, k_b={k_b}.")
    surprise = score_a - elo_expected_score(rating_a, rating_b, scale)
    return rating_a + k_a * surprise, rating_b - k_b * surprise


def decayed_k_factor(k_factor: float, games_played: int, k_decay: float | None) -> float:
    r"""K factor after ``games_played`` duels under harmonic decay: :math:`K_n = K_0 / (1 + n / d)`.

    ``k_decay`` (:math:`d`) is the number of duels after which K has halved; ``None`` disables the decay.
    Why harmonic rather than exponential: with :math:`K_n \propto 1/n` the steps satisfy the Robbins-Monro
    conditions (:math:`\sum K_n = \infty`, :math:`\sum K_n^2 < \infty`), so a rating averages out judge noise
    yet can still follow a player that keeps improving during training; an exponentially decaying K has a
    finite sum and freezes every rating after a fixed number of duels.

    Example::

        >>> decayed_k_factor(32.0, 50, k_decay=50.0)
        16.0
    """
    if games_played < 0:
        raise ValueError(f"`games_played` must be >= 0, got {games_played}.")
    if k_decay is None:
        return float(k_factor)
    return k_factor / (1.0 + games_played / k_decay)


def sample_std(values: Iterable[float]) -> float:
    """Sample standard deviation (``ddof=1``) of ``values``; 0.0 for fewer than two values.

    Example::

        >>> sample_std([1.0, 3.0])
        1.4142135623730951
    """
    values = [float(v) for v in values]
    n = len(values)
    if n < 2:
        return 0.0
    mean = math.fsum(values) / n
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))


def effective_k_factor(k_factor: float, games_played: int, k_decay: float | None, volatility: float) -> float:
    r"""K factor of a player for its next duel: decayed K boosted by its recent volatility.

    .. math:: K = K_0 / (1 + n / d) \cdot (1 + \min(1, \sigma / K_0))

    where :math:`\sigma` is the sample standard deviation of the player's recent rating changes
    (:func:`sample_std`). Why: a rating whose recent changes scatter has not settled, so it should move
    faster (the role volatility plays in Glicko-2); dividing by :math:`K_0` makes the boost scale-free
    (:math:`\sigma / K_0` is measured in full-surprise updates) and the cap bounds it to a doubling. Because
    each change is at most the K that made it, :math:`\sigma` shrinks as K decays, so the boost fades and the
    cooling of :func:`decayed_k_factor` wins in the long run.

    Example::

        >>> effective_k_factor(32.0, 0, k_decay=50.0, volatility=8.0)
        40.0
    """
    if volatility < 0:
        raise ValueError(f"`volatility` must be >= 0, got {volatility}.")
    boost = 1.0 + (min(1.0, volatility / k_factor) if k_factor > 0 else 0.0)
    return decayed_k_factor(k_factor, games_played, k_decay) * boost


def weighted_score(scores: Sequence[float], weights: Sequence[float] | None = None) -> float:
    """Weighted mean of judges' scores (the reputation-weighted mean of App. G when weights are reputations).

    Args:
        scores: one score in [0, 1] per judge.
        weights: one non-negative weight per judge (equal weights when ``None``).

    Raises:
        ValueError: on an empty list, a score outside [0, 1], a negative weight, a length mismatch or weights
            that sum to zero.

    Example::

        >>> weighted_score([1.0, 0.0], [3.0, 1.0])
        0.75
    """
    scores = [_check_score(s) for s in scores]
    if not scores:
        raise ValueError("At least one judge score is needed.")
    if weights is None:
        weights = [1.0] * len(scores)
    weights = [float(w) for w in weights]
    if len(weights) != len(scores):
        raise ValueError(f"Got {len(scores)} judge scores but {len(weights)} weights.")
    if any(not w >= 0.0 for w in weights):
        raise ValueError(f"Judge weights must be >= 0, got {weights}.")
    total = math.fsum(weights)
    if total <= 0.0:
        raise ValueError("Judge weights sum to zero.")
    # Clamp against rounding: a weighted mean of values in [0, 1] lies in [0, 1].
    return min(1.0, max(0.0, math.fsum(s * w for s, w in zip(scores, weights)) / total))


# --------------------------------------------------------------------------------------------------------------------
# MCC and its trend
# --------------------------------------------------------------------------------------------------------------------


def matthews_corrcoef_from_counts(tp: float, fp: float, tn: float, fn: float) -> float:
    r"""Matthews correlation from confusion counts, 0.0 where it is undefined.

    :math:`MCC = (TP \cdot TN - FP \cdot FN) / \sqrt{(TP+FP)(TP+FN)(TN+FP)(TN+FN)}`. When a factor of the
    denominator is zero (a single class in the truth or in the predictions, or no samples) the result is 0.0,
    the convention of ``sklearn.metrics.matthews_corrcoef``.

    Raises:
        ValueError: if a count is negative.

    Example::

        >>> matthews_corrcoef_from_counts(tp=5, fp=0, tn=5, fn=0)
        1.0
    """
    if min(tp, fp, tn, fn) < 0:
        raise ValueError(f"Confusion counts must be >= 0, got tp={tp}, fp={fp}, tn={tn}, fn={fn}.")
    factors = (tp + fp, tp + fn, tn + fp, tn + fn)
    if any(f == 0 for f in factors):
        return 0.0
    return (tp * tn - fp * fn) / math.sqrt(math.prod(float(f) for f in factors))


def least_squares_slope(values: Sequence[float]) -> float:
    """Least-squares slope of ``values`` against their index 0, 1, ..., n - 1; 0.0 for fewer than two values.

    Example::

        >>> least_squares_slope([1.0, 2.0, 4.0])
        1.5
    """
    n = len(values)
    if n < 2:
        return 0.0
    x_mean = (n - 1) / 2.0
    y_mean = math.fsum(values) / n
    num = math.fsum((i - x_mean) * (y - y_mean) for i, y in enumerate(values))
    den = math.fsum((i - x_mean) ** 2 for i in range(n))
    return num / den


# --------------------------------------------------------------------------------------------------------------------
# Beta posteriors, peak selection, P(Best), gap recovery
# --------------------------------------------------------------------------------------------------------------------

Group = tuple[float, float]  # (successes, trials)


def _check_counts(successes: float, trials: float) -> tuple[float, float]:
    successes, trials = float(successes), float(trials)
    if not (0.0 <= successes <= trials) or not math.isfinite(trials):
        raise ValueError(f"Need 0 <= successes <= trials (finite), got successes={successes}, trials={trials}.")
    return successes, trials


def beta_lower_bound(successes: float, trials: float, quantile: float = 0.025) -> float:
    """``quantile`` of the Beta(1 + successes, 1 + failures) posterior of an accuracy under a Beta(1, 1) prior.

    With the default 0.025 this is the lower end of the central 95% credible interval, the paper's "lower bound".

    Raises:
        ValueError: unless ``0 <= successes <= trials`` and ``0 < quantile < 1``.

    Example::

        >>> round(beta_lower_bound(0, 9, quantile=0.5), 6)  # Beta(1, 10): 1 - 0.5 ** (1 / 10)
        0.066967
    """
    successes, trials = _check_counts(successes, trials)
    if not 0.0 < quantile < 1.0:
        raise ValueError(f"`quantile` must lie in (0, 1), got {quantile}.")
    return float(stats.beta.ppf(quantile, 1.0 + successes, 1.0 + trials - successes))


def pooled_lower_bound(evaluations: Sequence[Group], window: int, quantile: float = 0.025) -> float:
    """:func:`beta_lower_bound` of the successes and trials pooled over the last ``window`` evaluations.

    Fewer evaluations than ``window`` are pooled as they are: fewer trials give a wider posterior, so a short
    window is penalised by the bound itself.

    Raises:
        ValueError: on an empty ``evaluations`` or ``window < 1``.

    Example::

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
    """Share of Monte Carlo draws in which each group's posterior sample is the highest.

    Each group is given as merged ``(successes, trials)``; its posterior is Beta(1 + successes, 1 + failures).
    The paper uses 100,000 draws and warns that correlated rollouts make this over-confident.

    Args:
        groups: a mapping name -> (successes, trials), or a sequence of such pairs.
        draws: number of joint posterior draws.
        seed: seed of the NumPy generator, so the result is reproducible.

    Returns:
        The shares, summing to 1, as a dict with the same keys for a mapping and as a list otherwise.

    Raises:
        ValueError: with no group, ``draws < 1`` or invalid counts.

    Example::

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
    rng = np.random.default_rng(seed)
    samples = rng.beta(alpha, beta, size=(draws, len(checked)))
    wins = np.bincount(samples.argmax(axis=1), minlength=len(checked))
    shares = [float(w) / draws for w in wins]
    return dict(zip(names, shares)) if names is not None else shares


def gap_recovery(debate: Group, baseline: Group, upper_bound: Group) -> float:
    """Share of the baseline-to-upper-bound gap that ``debate`` recovers, on posterior means.

    ``(mean(debate) - mean(baseline)) / (mean(upper_bound) - mean(baseline))`` with :func:`posterior_mean`;
    each argument is merged ``(successes, trials)``.

    Raises:
        ValueError: if the upper bound's and the baseline's posterior means are equal (no gap to recover).

    Example::

        >>> gap_recovery(debate=(74, 98), baseline=(69, 98), upper_bound=(79, 98))
        0.5
    """
    m_debate, m_base, m_upper = (posterior_mean(*g) for g in (debate, baseline, upper_bound))
    if m_upper == m_base:
        raise ValueError("The upper bound and the baseline have the same posterior mean: there is no gap.")
    return (m_debate - m_base) / (m_upper - m_base)
