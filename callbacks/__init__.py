"""Reusable Lightning callbacks for game-theoretic alignment, and the plain math behind them.

Each works on any ``LightningModule`` that provides what its docstring asks for, imports nothing from the rest of
the suite, resumes exactly from a checkpoint, agrees across DDP ranks and logs under its own namespace.
"""

from alignment_games.callbacks import functional
from alignment_games.callbacks.elo import EloRating
from alignment_games.callbacks.fault_tolerance import (
    AtomicCheckpointIO,
    CheckpointOnSigterm,
    RNGStateCallback,
    atomic_torch_save,
    collect_rng_state,
    restore_rng_state,
)
from alignment_games.callbacks.functional import *  # noqa: F403 - the math helpers, listed in functional.__all__
from alignment_games.callbacks.items import ItemRecords, first_occurrences, gather_unique_items
from alignment_games.callbacks.mcc import MCCTracker
from alignment_games.callbacks.peak import PeakCheckpoint
from alignment_games.callbacks.prediction_writer import JsonlPredictionWriter
from alignment_games.callbacks.warmup import TwoTimescaleWarmup

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
