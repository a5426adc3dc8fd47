"""Reusable Lightning callbacks for game-theoretic alignment, and the plain math behind them.

Each callback works on any ``LightningModule`` that provides what its docstring asks for, imports nothing from the
rest of the suite, resumes exactly from a checkpoint, agrees across DDP ranks and logs under its own namespace::

    from callbacks import EloRating, MCCTracker, PeakCheckpoint, TwoTimescaleWarmup
"""

from callbacks.elo import EloRating
from callbacks.fault_tolerance import (
    AtomicCheckpointIO,
    CheckpointOnSigterm,
    RNGStateCallback,
    atomic_torch_save,
    collect_rng_state,
    restore_rng_state,
)
from callbacks.functional import (
    beta_lower_bound,
    decayed_k_factor,
    effective_k_factor,
    elo_expected_score,
    elo_update,
    gap_recovery,
    least_squares_slope,
    matthews_corrcoef_from_counts,
    p_best,
    pooled_lower_bound,
    posterior_mean,
    sample_std,
    warmup_learning_rates,
    weighted_score,
)
from callbacks.mcc import MCCTracker
from callbacks.peak import PeakCheckpoint
from callbacks.prediction_writer import JsonlPredictionWriter
from callbacks.warmup import TwoTimescaleWarmup

__all__ = [
    "AtomicCheckpointIO",
    "CheckpointOnSigterm",
    "EloRating",
    "JsonlPredictionWriter",
    "MCCTracker",
    "PeakCheckpoint",
    "RNGStateCallback",
    "TwoTimescaleWarmup",
    "atomic_torch_save",
    "beta_lower_bound",
    "collect_rng_state",
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
    "restore_rng_state",
    "sample_std",
    "warmup_learning_rates",
    "weighted_score",
]
