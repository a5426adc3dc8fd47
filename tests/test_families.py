"""Contract tests over the family registry (``modules.training.registry``): every family the code defines is listed
by the CLI, resolves by its short name, and is covered by every contract test that applies to it.

The contract tests keep their own per-family tables, keyed by class name (``"StackelbergPool-dpo"``: a variant of
one family). A family that a contract does not apply to, or that still lacks its entry, is listed in
:data:`EXEMPT` with the reason; a new family without either fails here, naming the table to add it to.
"""

import contextlib
import inspect
import io

import pytest
import test_4bit_families
import test_learning_direction
import test_nonfinite_gradients
import test_refused_values
import yaml
from helpers import ROOT
from helpers.resume_families import FAMILIES as RESUME_FAMILIES

from alignment_games import train
from alignment_games.modules.training.registry import data_families, model_families


def _family_of_config(config: str) -> str:
    with open(f"{ROOT}/configs/{config}") as f:
        return yaml.safe_load(f)["model"]["class_path"].rsplit(".", 1)[-1]


def _loader_table() -> set[str]:
    # tests/modules/lm/ holds a test file of the same basename elsewhere; load this one by path
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_contract_model_config", f"{ROOT}/tests/modules/lm/test_model_config.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return set(module.FAMILIES)


def _keys(table) -> set[str]:
    return {key.split("-", 1)[0] for key in table}


# contract: (where a family's entry goes, the families it covers)
CONTRACTS = {
    "exact resume": (
        "tests/helpers/resume_families.py FAMILIES (a Family: a config and tiny overrides)",
        lambda: {_family_of_config(f.config) for f in RESUME_FAMILIES.values()},
    ),
    "non-finite skip": (
        "tests/test_nonfinite_gradients.py FAMILIES (a builder of the tiny model and its data)",
        lambda: _keys(test_nonfinite_gradients.FAMILIES),
    ),
    "refused values": (
        "tests/test_refused_values.py FAMILIES and CASES (the class, its required arguments, bad values)",
        lambda: _keys(test_refused_values.FAMILIES),
    ),
    "learning direction": (
        "tests/test_learning_direction.py RUNS (a run with a rewarded and a mirrored reward)",
        lambda: _keys(test_learning_direction.RUNS),
    ),
    "options reach the loader": (
        "tests/modules/lm/test_model_config.py FAMILIES (a builder from a ModelConfig)",
        _loader_table,
    ),
    "4-bit base": (
        "tests/test_4bit_families.py FAMILIES (a builder on a load_in_4bit ModelConfig and its data)",
        lambda: _keys(test_4bit_families.FAMILIES),
    ),
}
EXEMPT = {
    (
        "non-finite skip",
        "TabularSMIDA",
    ): "no gradients: test_nonfinite_gradients.test_tabular_smida_skips_a_nonfinite_iterate",
    (
        "refused values",
        "TabularSMIDA",
    ): "no model to load: test_refused_values.test_tabular_game_sizes_are_refused_by_name",
    (
        "learning direction",
        "TabularSMIDA",
    ): "test_tabular_smida.test_smida_reaches_the_closed_form_within_the_bound_at_every_step",
    ("options reach the loader", "TabularSMIDA"): "loads no model",
    ("4-bit base", "TabularSMIDA"): "loads no model",
}
MODELS = model_families()


def test_the_registry_finds_every_family_file():
    modules = {cls.__module__ for cls in MODELS.values()}
    assert modules == {
        f"alignment_games.modules.{m}"
        for m in ("debate", "deep_smida", "grpo", "nlhf", "pool", "preference", "sft", "slhf", "tabular_smida")
    }
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
    where, covered = CONTRACTS[contract]
    exempt = EXEMPT.get((contract, name))
    if name in covered():
        assert exempt is None, f"{name} now has its {contract} entry: remove its exemption from EXEMPT"
    else:
        assert exempt is not None, (
            f"family {name} ({MODELS[name].__module__}) has no {contract} test: add it to {where}"
        )


def test_every_exemption_names_a_family_and_a_contract():
    assert {c for c, _ in EXEMPT} <= set(CONTRACTS) and {f for _, f in EXEMPT} <= set(MODELS)


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
