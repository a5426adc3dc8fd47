"""The adapted Elo reputation rule of the multi-LLM pool (multi-LLM Stackelberg alignment, §2.3 and App. C)."""

import math
from collections.abc import Iterable, Sequence


def _check_score(score: float) -> float:
    score = float(score)
    if not 0.0 <= score <= 1.0:  # also rejects NaN
        raise ValueError(f"An Elo score must lie in [0, 1] (1 = win, 0.5 = draw, 0 = loss), got {score}.")
    return score


def elo_expected_score(rating_a: float, rating_b: float, scale: float = 400.0) -> float:
    r"""Expected score of a against b: :math:`E_a = 1 / (1 + 10^{(R_b - R_a) / s})` (``scale`` :math:`s`, 400 in chess).

    Example:
        >>> elo_expected_score(1000.0, 1000.0)
        0.5
    """
    return 1.0 / (1.0 + 10.0 ** ((rating_b - rating_a) / scale))


def elo_update(
    rating_a: float, rating_b: float, score_a: float, k_a: float, k_b: float | None = None, scale: float = 400.0
) -> tuple[float, float]:
    r"""Ratings after one duel: :math:`R_a + K_a (S_a - E_a)` and :math:`R_b - K_b (S_a - E_a)`, from the old ratings.

    ``k_b`` defaults to ``k_a`` (a zero-sum update); b scores ``1 - score_a``.

    Raises:
        ValueError: if ``score_a`` is outside [0, 1] or a K factor is negative.

    Example:
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
    r"""K factor after ``games_played`` duels under harmonic decay: :math:`K_n = K_0 / (1 + n / d)`; ``None``: no decay.

    Harmonic decay meets the Robbins-Monro conditions, so a rating still follows a player that keeps improving.

    Example:
        >>> decayed_k_factor(32.0, 50, k_decay=50.0)
        16.0
    """
    if games_played < 0:
        raise ValueError(f"`games_played` must be >= 0, got {games_played}.")
    return float(k_factor) if k_decay is None else k_factor / (1.0 + games_played / k_decay)


def sample_std(values: Iterable[float]) -> float:
    """Sample standard deviation (``ddof=1``) of ``values``; 0.0 for fewer than two values.

    Example:
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
    r"""K factor of a player's next duel: :math:`K_0 / (1 + n / d) \cdot (1 + \min(1, \sigma / K_0))`.

    A rating that still scatters (``volatility`` :math:`\sigma`, :func:`sample_std` of recent changes) moves faster, as
    in Glicko-2, at most twice as fast.

    Example:
        >>> effective_k_factor(32.0, 0, k_decay=50.0, volatility=8.0)
        40.0
    """
    if volatility < 0:
        raise ValueError(f"`volatility` must be >= 0, got {volatility}.")
    boost = 1.0 + (min(1.0, volatility / k_factor) if k_factor > 0 else 0.0)
    return decayed_k_factor(k_factor, games_played, k_decay) * boost


def weighted_score(scores: Sequence[float], weights: Sequence[float] | None = None) -> float:
    """Weighted mean of judges' scores in [0, 1] (App. G's reputation-weighted mean); equal weights when ``None``.

    Raises:
        ValueError: on no score, a score outside [0, 1], a negative weight, a length mismatch or a zero sum.

    Example:
        >>> weighted_score([1.0, 0.0], [3.0, 1.0])
        0.75
    """
    scores = [_check_score(s) for s in scores]
    if not scores:
        raise ValueError("At least one judge score is needed.")
    weights = [1.0] * len(scores) if weights is None else [float(w) for w in weights]
    if len(weights) != len(scores):
        raise ValueError(f"Got {len(scores)} judge scores but {len(weights)} weights.")
    if any(not w >= 0.0 for w in weights):
        raise ValueError(f"Judge weights must be >= 0, got {weights}.")
    total = math.fsum(weights)
    if total <= 0.0:
        raise ValueError("Judge weights sum to zero.")
    # Clamp against rounding: a weighted mean of values in [0, 1] lies in [0, 1].
    return min(1.0, max(0.0, math.fsum(s * w for s, w in zip(scores, weights)) / total))
