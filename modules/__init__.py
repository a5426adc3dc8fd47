"""LightningModules of the suite and the pure math they compose.

The pure functions are importable from here; LightningModules live in their own submodules
(``modules.preference.PreferenceEnsemble``, ``modules.tabular_smida.TabularSMIDA``, ``modules.deep_smida.DeepSMIDA``).
"""

from alignment_games.modules.algorithms.answers import answers_match, extract_final_answer
from alignment_games.modules.algorithms.baselines import (
    geometric_mixture_logprobs,
    nash_md_pg_surrogate_loss,
    slhf_surrogate_losses,
)
from alignment_games.modules.algorithms.debate import count_words, ply_rewards, split_reply, word_penalty
from alignment_games.modules.algorithms.disagreement import decision_uncertainty, ensemble_jsd, ensemble_variance
from alignment_games.modules.algorithms.exp3 import Exp3
from alignment_games.modules.algorithms.smida_estimators import smida_surrogate_losses
from alignment_games.modules.algorithms.stackelberg import smida, stackelberg_equilibrium
from alignment_games.modules.algorithms.verdicts import parse_verdict, vote_share

__all__ = [
    "Exp3",
    "answers_match",
    "count_words",
    "decision_uncertainty",
    "ensemble_jsd",
    "ensemble_variance",
    "extract_final_answer",
    "geometric_mixture_logprobs",
    "nash_md_pg_surrogate_loss",
    "parse_verdict",
    "ply_rewards",
    "smida",
    "slhf_surrogate_losses",
    "smida_surrogate_losses",
    "split_reply",
    "stackelberg_equilibrium",
    "vote_share",
    "word_penalty",
]
