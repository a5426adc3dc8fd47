r"""The Stackelberg leader of multi-LLM alignment: EXP3 over instructions and its composite reward (§2.1, App. C).

Where the paper leaves a formula open: Auer et al.'s (2002) Exp3 with every duel one round (App. H), an iteration's
D duels importance-weighted by the distribution *before* the update,
:math:`\log w_i \mathrel{+}= (\gamma/K) \sum_{d: I_d = i} r_d / p_i` (mixing :math:`\gamma/K` is the floor). Difficulty
reward :math:`(10 - \bar s)/9`, or 0 when even the better response scores below ``min_score``. Preference reward: a
Gaussian bump of the gap :math:`g = |s_a - s_b| / 9` around an ideal gap annealed over training, times
:math:`\min(1, g/\delta)`: 0 at a tie, without a jump. Composite :math:`0.3\,r_\text{diff} + 0.7\,r_\text{pref}`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from alignment_games.modules.algorithms.checks import require_at_least, require_in_range, require_positive

SCORE_MIN, SCORE_MAX = 1.0, 10.0


def linear_schedule(start: float, end: float, progress: float) -> float:
    """``start + (end - start) * progress`` with ``progress`` clipped to [0, 1]."""
    if not math.isfinite(progress):
        raise ValueError(f"progress must be finite, got {progress}")
    return start + (end - start) * min(1.0, max(0.0, float(progress)))


def _check_score(name: str, s: float) -> float:
    s = float(s)
    require_in_range(f"{name} (a judge score)", s, SCORE_MIN, SCORE_MAX)
    return s


def normalized_gap(score_a: float, score_b: float) -> float:
    """``|s_a - s_b| / 9``: the score gap as a fraction of the 1–10 scale."""
    a, b = _check_score("score_a", score_a), _check_score("score_b", score_b)
    return abs(a - b) / (SCORE_MAX - SCORE_MIN)


def difficulty_reward(score_a: float, score_b: float, min_score: float = 3.0) -> float:
    """``(10 - mean score) / 9``, or 0 when even the better response scores below ``min_score``.

    Raises:
        ValueError: for a score outside [1, 10].
    """
    a, b = _check_score("score_a", score_a), _check_score("score_b", score_b)
    return 0.0 if max(a, b) < min_score else (SCORE_MAX - 0.5 * (a + b)) / (SCORE_MAX - SCORE_MIN)


def preference_reward(
    score_a: float, score_b: float, ideal_gap: float, bandwidth: float = 0.15, tie_gap: float = 1 / 9
) -> float:
    """Gaussian bump ``exp(-(g - ideal_gap)^2 / (2 bandwidth^2))`` of the normalised gap ``g``, times ``min(1, g/δ)``.

    A tie shows no preference: 0, a judge-split near tie (g ≈ 0.001) about as little (δ ``tie_gap``, one score point).
    A leader rule only: a tie gives DPO no pair, but GRPO learns (equal side means: unequal rewards within a side).

    Raises:
        ValueError: for a score outside [1, 10], or a non-positive bandwidth or ``tie_gap``.
    """
    require_positive(bandwidth=bandwidth, tie_gap=tie_gap)
    g = normalized_gap(score_a, score_b)
    return min(1.0, g / tie_gap) * math.exp(-((g - ideal_gap) ** 2) / (2.0 * bandwidth**2))


@dataclass(frozen=True)
class CompositeReward:
    """The leader's reward of one duel, ``λ1 r_diff + λ2 r_pref``, called as ``reward(score_a, score_b, progress)``.

    Attributes:
        difficulty_weight: λ1 (the paper's 0.3).
        preference_weight: λ2 (the paper's 0.7).
        min_score: Threshold of the difficulty reward.
        bandwidth: Width of the preference bump.
        tie_gap: δ, the normalised gap below which the bump is scaled by ``g/δ`` (1/9: one point of the 1–10 scale).
        gap_start: Ideal normalised gap at the start of training.
        gap_end: Ideal normalised gap at the end.

    Raises:
        ValueError: for a negative weight or a non-positive bandwidth or tie_gap.
    """

    difficulty_weight: float = 0.3
    preference_weight: float = 0.7
    min_score: float = 3.0
    bandwidth: float = 0.15
    tie_gap: float = 1 / 9
    gap_start: float = 0.6
    gap_end: float = 0.15

    def __post_init__(self) -> None:
        require_at_least(
            difficulty_weight=(self.difficulty_weight, 0.0), preference_weight=(self.preference_weight, 0.0)
        )
        require_positive(bandwidth=self.bandwidth, tie_gap=self.tie_gap)

    def __call__(self, score_a: float, score_b: float, progress: float) -> float:
        """The reward of one duel with scores ``score_a``, ``score_b`` at training ``progress``."""
        ideal = linear_schedule(self.gap_start, self.gap_end, progress)
        difficulty = difficulty_reward(score_a, score_b, self.min_score)
        return self.difficulty_weight * difficulty + self.preference_weight * preference_reward(
            score_a, score_b, ideal, self.bandwidth, self.tie_gap
        )


class Exp3:
    r"""EXP3 over K arms (instructions) with uniform mixing γ, batched rounds and importance-weighted estimates.

    Args:
        num_arms: K, the number of instructions (≥ 1).
        gamma: Exploration rate γ in (0, 1]; also the floor ``γ/K`` of every probability.

    Raises:
        ValueError: on a bad argument.
    """

    def __init__(self, num_arms: int, gamma: float = 0.2) -> None:
        if int(num_arms) != num_arms or num_arms < 1:
            raise ValueError(f"num_arms must be a positive integer, got {num_arms}")
        require_in_range("gamma", gamma, 0, 1, open_low=True)
        self.num_arms = int(num_arms)
        self.gamma = float(gamma)
        self.log_weights = torch.zeros(self.num_arms, dtype=torch.float64)
        self.rounds = 0  # duels seen

    @property
    def eta(self) -> float:
        """The learning rate ``γ/K`` of Auer et al.'s Exp3."""
        return self.gamma / self.num_arms

    def probabilities(self) -> Tensor:
        """``(1 − γ) softmax(log w) + γ/K``, float64, sums to 1."""
        return (1.0 - self.gamma) * torch.softmax(self.log_weights, dim=0) + self.gamma / self.num_arms

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """Draw ``n`` arms with replacement from :meth:`probabilities` (long tensor ``[n]``)."""
        require_positive(n=n)
        return torch.multinomial(self.probabilities(), n, replacement=True, generator=generator)

    def estimates(self, indices: Sequence[int] | Tensor, rewards: Sequence[float] | Tensor) -> Tensor:
        r"""Importance-weighted reward estimates summed per arm, :math:`\sum_{d: I_d = i} r_d / p_i` (``[K]``).

        Raises:
            ValueError: for mismatched lengths, an index outside ``[0, K)`` or a reward outside [0, 1] (NaN included).
        """
        idx = torch.as_tensor(indices, dtype=torch.long).flatten()
        r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
        if idx.numel() != r.numel():
            raise ValueError(f"indices and rewards differ in length: {idx.numel()} vs {r.numel()}")
        if idx.numel() and (idx.min() < 0 or idx.max() >= self.num_arms):
            raise ValueError(f"indices must be in [0, {self.num_arms}), got {idx.tolist()}")
        bad = ~((r >= 0) & (r <= 1))
        if bad.any():
            i = int(bad.nonzero()[0])
            raise ValueError(f"rewards must be in [0, 1] (EXP3's range), got {float(r[i])} at position {i}")
        p = self.probabilities()
        return torch.zeros(self.num_arms, dtype=torch.float64).index_add_(0, idx, r / p[idx])

    def update(self, indices: Sequence[int] | Tensor, rewards: Sequence[float] | Tensor) -> None:
        """One EXP3 round per duel: ``log w_i += (γ/K) Σ_{d: I_d = i} r_d / p_i``."""
        w = self.log_weights + self.eta * self.estimates(indices, rewards)
        self.log_weights = w - w.max()  # same probabilities, no overflow
        self.rounds += int(torch.as_tensor(indices).numel())

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: K, γ, the log-weights and the round count."""
        return dict(num_arms=self.num_arms, gamma=self.gamma, log_weights=self.log_weights.clone(), rounds=self.rounds)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; refuses a state for another number of arms or another γ."""
        if int(state["num_arms"]) != self.num_arms or float(state["gamma"]) != self.gamma:
            raise ValueError(
                f"EXP3 state is for K={state['num_arms']}, gamma={state['gamma']}; this bandit has "
                f"K={self.num_arms}, gamma={self.gamma}"
            )
        self.log_weights = torch.as_tensor(state["log_weights"], dtype=torch.float64).clone()
        self.rounds = int(state["rounds"])
