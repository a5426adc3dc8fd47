"""LightningModules of the suite and the pure math they compose.

The pure functions are importable from here; LightningModules live in their own submodules
(``modules.preference.PreferenceEnsemble``, ``modules.smida_tabular.TabularSMIDA``, ``modules.deep_smida.DeepSMIDA``).
"""

from modules.answers import answers_match, extract_final_answer
from modules.disagreement import decision_uncertainty, ensemble_jsd, ensemble_variance
from modules.smida_estimators import smida_surrogate_losses
from modules.stackelberg import smida, stackelberg_equilibrium

__all__ = [
    "answers_match",
    "decision_uncertainty",
    "ensemble_jsd",
    "ensemble_variance",
    "extract_final_answer",
    "smida",
    "smida_surrogate_losses",
    "stackelberg_equilibrium",
]
