"""Contract tests over the family registry (``alignment_games.modules.training.registry``): every family the code
defines is listed by the CLI, resolves by its short name, and has a test recipe (``tests/helpers/recipes.py``) that
feeds every contract test, or says in ``Recipe.exempt`` why a contract does not apply to it.
"""

import contextlib
import inspect
import io
import os

import pytest
from helpers import ROOT
from helpers.recipes import RECIPES

from alignment_games import train
from alignment_games.modules.training.registry import data_families, model_families

# contract: (the test file it feeds, whether a recipe provides it)
CONTRACTS = {
    "exact resume": ("tests/test_resume.py", lambda r: bool(r.resume)),
    "non-finite skip": ("tests/test_nonfinite_gradients.py", lambda r: r.build is not None),
    "refused values": ("tests/test_refused_values.py", lambda r: bool(r.refused)),
    "learning direction": ("tests/test_learning_direction.py", lambda r: bool(r.learns)),
    "optimizers": ("tests/test_injected_optimizers.py", lambda r: r.rates is not None),
    "loader": ("tests/modules/lm/test_model_config.py", lambda r: r.build is not None),
    "4-bit base": ("tests/test_4bit_families.py", lambda r: r.build is not None and bool(r.four_bit)),
}
MODELS = model_families()


def test_the_registry_finds_every_family_file():
    """Every top-level file of ``modules/`` but the shared base is a family file: the registry finds a family in
    each."""
    files = {
        f"alignment_games.modules.{name[: -len('.py')]}"
        for name in os.listdir(os.path.join(ROOT, "modules"))
        if name.endswith(".py") and not name.startswith("_") and name != "base.py"
    }
    assert {cls.__module__ for cls in MODELS.values()} == files
    assert "LanguageModelGame" not in MODELS  # the shared base is not a family
    assert set(data_families()) >= {"PreferenceDataModule", "PromptDataModule", "DebateDataModule"}
    assert "_TriplesDataModule" not in data_families()  # private bases are not listed


@pytest.fixture(scope="module")
def fit_help() -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        train.main(["fit", "--help"])
    return out.getvalue()


@pytest.mark.parametrize("name", sorted(MODELS) + sorted(data_families()))
def test_fit_help_lists_the_family(name, fit_help):
    cls = MODELS.get(name) or data_families()[name]
    assert f"{cls.__module__}.{name}" in "".join(fit_help.split())  # argparse wraps long names mid-word


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_short_name_resolves_for_print_config(name):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        train.main(["fit", "--model", name, "--print_config"])
    assert stop.value.code in (0, None)
    assert f"class_path: {MODELS[name].__module__}.{name}" in out.getvalue()


@pytest.mark.parametrize("contract", sorted(CONTRACTS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_family_meets_every_contract(contract, name):
    where, provided = CONTRACTS[contract]
    recipe = RECIPES.get(name)
    if recipe is None:
        pytest.fail(f"family {name} ({MODELS[name].__module__}) has no recipe: add one to tests/helpers/recipes.py")
    exempt = recipe.exempt.get(contract)
    if provided(recipe):
        assert exempt is None, f"{name}'s recipe now feeds {where}: remove its {contract} exemption"
    else:
        assert exempt is not None, f"{name}'s recipe gives {where} nothing: add its {contract} entry or exemption"


def test_every_recipe_names_a_family_and_its_exemptions_name_contracts():
    assert set(RECIPES) <= set(MODELS)
    assert {c for recipe in RECIPES.values() for c in recipe.exempt} <= set(CONTRACTS)


@pytest.mark.parametrize("name", sorted(MODELS) + sorted(data_families()))
def test_the_configuration_page_names_the_family(name):
    with open(f"{ROOT}/docs/configuration.md") as f:
        assert f"`{name}`" in f.read(), f"docs/configuration.md does not list the family {name}"


def _passes_on_kwargs(cls: type) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(cls.__init__).parameters.values())


FORWARDING = sorted(n for n, c in {**MODELS, **data_families()}.items() if _passes_on_kwargs(c))


def test_some_families_pass_their_bases_arguments_on():
    assert {
        "GRPO",
        "DeepSMIDA",
        "StackelbergPool",
        "NashMDPG",
        "SLHF",
        "DebateSelfPlay",
        "PreferenceEnsemble",
        "CausalLMSFT",
        "SFTFileDataModule",
        "PreferenceDataModule",
    } <= set(FORWARDING)


@pytest.mark.parametrize("name", FORWARDING)
def test_the_arguments_a_family_passes_on_as_kwargs_are_config_options(name):
    """A family taking its base's arguments as ``**kwargs`` (the base owns them and their help) still offers them."""
    from jsonargparse import ArgumentParser

    cls = MODELS.get(name) or data_families()[name]
    parser = ArgumentParser()
    parser.add_class_arguments(cls, "x")
    options = {a.dest.split(".")[1] for a in parser._actions if a.dest.startswith("x.")}
    named = {
        p.name
        for c in cls.__mro__
        if c.__module__.startswith("alignment_games") and "__init__" in vars(c)
        for p in inspect.signature(c.__init__).parameters.values()
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"
    }
    assert named <= options
