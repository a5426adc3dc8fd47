"""The math behind the callbacks, as plain functions with no Lightning or torch, testable exactly and reusable.

- :mod:`.warmup`: the two-timescale leader/follower learning-rate warm-up.
- :mod:`.elo`: the adapted Elo reputation rule with judge weights.
- :mod:`.mcc`: judge MCC from confusion counts and its trend.
- :mod:`.beta`: Beta posteriors for peak selection, P(Best) and gap recovery.
"""

from callbacks.functional.beta import beta_lower_bound, gap_recovery, p_best, pooled_lower_bound, posterior_mean
from callbacks.functional.elo import (
    decayed_k_factor,
    effective_k_factor,
    elo_expected_score,
    elo_update,
    sample_std,
    weighted_score,
)
from callbacks.functional.mcc import least_squares_slope, matthews_corrcoef_from_counts
from callbacks.functional.warmup import warmup_learning_rates

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
