"""Bad values are refused by name in every family's ``__init__``, before any model is loaded.

The model path does not exist: a value checked only after loading would fail on the path instead, and the control
(the same family with good values) shows that it does.
"""

import pytest
from helpers.recipes import RECIPES

from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.tabular_smida import TabularSMIDA

MISSING = "/nonexistent/tiny-model"
#: every family that loads a model, built by its recipe on a model folder that does not exist
FAMILIES = {name: recipe for name, recipe in RECIPES.items() if recipe.build is not None}
CASES = [(name, bad, message) for name, recipe in FAMILIES.items() for bad, message in recipe.refused]


@pytest.mark.parametrize(("family", "bad", "message"), CASES, ids=[f"{f}-{next(iter(b))}" for f, b, _ in CASES])
def test_a_bad_value_is_refused_by_name_before_loading(family, bad, message, tmp_path):
    with pytest.raises(ValueError, match=f"^{message}$"):
        FAMILIES[family].make(ModelConfig(MISSING), tmp_path, **bad)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_good_values_get_as_far_as_loading_the_model(family, tmp_path):
    with pytest.raises((OSError, ValueError), match="nonexistent"):
        FAMILIES[family].make(ModelConfig(MISSING), tmp_path)


@pytest.mark.parametrize("field", ["num_contexts", "num_actions", "ensemble_size"])
def test_tabular_game_sizes_are_refused_by_name(field):
    with pytest.raises(ValueError, match=f"^{field} must be an integer of at least 1, got 0$"):
        TabularSMIDA(**{field: 0})
