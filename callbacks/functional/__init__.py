"""The math behind the callbacks (warm-up, Elo, MCC, Beta posteriors), as plain functions with no Lightning or torch."""

from alignment_games.callbacks.functional.beta import (
    beta_lower_bound,
    gap_recovery,
    p_best,
    pooled_lower_bound,
    posterior_mean,
)
from alignment_games.callbacks.functional.elo import (
    decayed_k_factor,
    effective_k_factor,
    elo_expected_score,
    elo_update,
    sample_std,
    weighted_score,
)
from alignment_games.callbacks.functional.mcc import confusion_cells, least_squares_slope, matthews_corrcoef_from_counts
from alignment_games.callbacks.functional.warmup import warmup_learning_rates

__all__ = [
    "beta_lower_bound",
    "confusion_cells",
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
