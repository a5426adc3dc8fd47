"""LightningModules of the suite and the pure math they compose.

The pure functions are importable from here; LightningModules live in their own submodules
(``modules.preference.PreferenceEnsemble``, ``modules.smida_tabular.TabularSMIDA``, ``modules.deep_smida.DeepSMIDA``).
"""

from modules.answers import answers_match, extract_final_answer
from modules.debate import count_words, parse_verdict, ply_rewards, split_reply, vote_share, word_penalty
from modules.disagreement import decision_uncertainty, ensemble_jsd, ensemble_variance
from modules.exp3 import Exp3
from modules.smida_estimators import smida_surrogate_losses
from modules.stackelberg import smida, stackelberg_equilibrium

__all__ = [
    "Exp3",
    "answers_match",
    "count_words",
    "decision_uncertainty",
    "ensemble_jsd",
    "ensemble_variance",
    "extract_final_answer",
    "parse_verdict",
    "ply_rewards",
    "smida",
    "smida_surrogate_losses",
    "split_reply",
    "stackelberg_equilibrium",
    "vote_share",
    "word_penalty",
]
