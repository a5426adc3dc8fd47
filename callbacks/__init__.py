"""Reusable Lightning callbacks for game-theoretic alignment, and the plain math behind them.

Each works on any ``LightningModule`` that provides what its docstring asks for, imports nothing from the rest of
the suite, resumes exactly from a checkpoint, agrees across DDP ranks and logs under its own namespace.
"""

from callbacks import functional
from callbacks.elo import EloRating
from callbacks.fault_tolerance import (
    AtomicCheckpointIO,
    CheckpointOnSigterm,
    RNGStateCallback,
    atomic_torch_save,
    collect_rng_state,
    restore_rng_state,
)
from callbacks.functional import *  # noqa: F403 - the math helpers, listed in functional.__all__
from callbacks.items import ItemRecords, first_occurrences, gather_unique_items
from callbacks.mcc import MCCTracker
from callbacks.peak import PeakCheckpoint
from callbacks.prediction_writer import JsonlPredictionWriter
from callbacks.warmup import TwoTimescaleWarmup

__all__ = [
    "AtomicCheckpointIO",
    "CheckpointOnSigterm",
    "EloRating",
    "ItemRecords",
    "JsonlPredictionWriter",
    "MCCTracker",
    "PeakCheckpoint",
    "RNGStateCallback",
    "TwoTimescaleWarmup",
    "atomic_torch_save",
    "collect_rng_state",
    "first_occurrences",
    "gather_unique_items",
    "restore_rng_state",
]
__all__ += functional.__all__
