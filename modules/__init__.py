"""LightningModules of the suite and the pure math they compose.

The pure functions the docs use are importable from here; LightningModules live in their own submodules
(``alignment_games.modules.preference.PreferenceEnsemble``, ``alignment_games.modules.tabular_smida.TabularSMIDA``,
``alignment_games.modules.deep_smida.DeepSMIDA``).
"""

from alignment_games.modules.algorithms.answers import answers_match, extract_final_answer
from alignment_games.modules.algorithms.exp3 import Exp3
from alignment_games.modules.algorithms.stackelberg import smida, stackelberg_equilibrium

__all__ = ["Exp3", "answers_match", "extract_final_answer", "smida", "stackelberg_equilibrium"]
