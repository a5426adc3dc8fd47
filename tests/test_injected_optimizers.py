"""The model's ``optimizer`` option (``alignment_games.modules.training.optimizers``) in every family that trains by
gradient: AdamW at the family's settings when it is not given; any ``torch.optim`` class from a config, one per player
at the family's rates; a value that cannot build an optimizer refused naming the option.

Each family is built by ``train.py`` from its recipe's first resume run: a config and tiny overrides (parse and
instantiate only).
"""

import pytest
import torch
from helpers import ROOT
from helpers.recipes import RECIPES
from test_refused_values import MISSING

from alignment_games import train
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.training.optimizers import build_optimizer

#: every family whose recipe gives its optimizers' rates (tests/test_families.py: every family with gradients)
CASES = {name: recipe for name, recipe in RECIPES.items() if recipe.rates is not None}
SGD = '--model.init_args.optimizer={"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1, "momentum": 0.0}}'


def _build(family: str, tiny_lm_dir, *extra: str):
    recipe = CASES[family]
    run = recipe.resume[0]
    config = f"{ROOT}/configs/{run.config}"
    args = [a.replace("{tiny_lm_dir}", str(tiny_lm_dir)) for a in run.args]
    rates = (f"--model.init_args.{r}" for r in recipe.rates.options)
    return train.main(["--config", config, *args, *rates, *extra], run=False).model


def _optimizers(model) -> list[torch.optim.Optimizer]:
    built = model.configure_optimizers()
    built = built["optimizer"] if isinstance(built, dict) else built
    return built if isinstance(built, list) else [built]


@pytest.mark.parametrize("family", sorted(CASES))
def test_without_an_injection_each_player_gets_adamw_at_the_family_settings(family, tiny_lm_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = _build(family, tiny_lm_dir)
    weight_decay, betas = CASES[family].rates.adamw
    optimizers = _optimizers(model)
    assert [[g["lr"] for g in o.param_groups] for o in optimizers] == CASES[family].rates.lrs
    for opt in optimizers:
        assert type(opt) is torch.optim.AdamW
        for group in opt.param_groups:
            assert (group["weight_decay"], group["betas"], group["eps"], group["amsgrad"]) == (
                weight_decay,
                betas,
                1e-8,
                False,
            )


@pytest.mark.parametrize("family", sorted(CASES))
def test_an_injected_sgd_steps_each_player_by_its_family_rate(family, tiny_lm_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = _build(family, tiny_lm_dir, SGD)
    optimizers = _optimizers(model)
    # one SGD per player at the family's rates: SGD's own lr (0.1) and the family's weight decay are not used
    assert [type(o) for o in optimizers] == [torch.optim.SGD] * len(CASES[family].rates.lrs)
    assert [[g["lr"] for g in o.param_groups] for o in optimizers] == CASES[family].rates.lrs
    trained = [p for o in optimizers for g in o.param_groups for p in g["params"]]
    assert len({id(p) for p in trained}) == len(trained)  # no parameter in two players' optimizers
    assert {id(p) for p in trained} == {id(p) for p in model.parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}  # references, judges
    gen = torch.Generator().manual_seed(0)
    for opt in optimizers:
        expected = []
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
                expected.append((p, p.detach() - group["lr"] * p.grad))  # a power of two: exact
        opt.step()
        for p, want in expected:
            assert torch.equal(p.detach(), want)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)


@pytest.mark.parametrize("family", sorted(CASES))
@pytest.mark.parametrize("bad", [3, torch.nn.Linear], ids=["not-callable", "not-an-optimizer"])
def test_a_value_that_cannot_build_an_optimizer_is_refused_by_name(family, bad, tmp_path):
    with pytest.raises(TypeError, match=r"^optimizer must build a torch.optim.Optimizer .* got "):
        CASES[family].make(ModelConfig(MISSING), tmp_path, optimizer=bad)


def test_a_callable_that_builds_no_optimizer_is_refused_by_name():
    with pytest.raises(TypeError, match=r"^optimizer must build a torch.optim.Optimizer .* got a list from "):
        build_optimizer(lambda groups: groups, [torch.nn.Parameter(torch.zeros(2))], 0.5)


def test_the_cli_refuses_a_class_that_is_not_an_optimizer(capsys):
    with pytest.raises(SystemExit):
        train.main(["--config", f"{ROOT}/configs/nlhf.yaml", "--model.init_args.optimizer=torch.nn.Linear"], run=False)
    err = capsys.readouterr().err
    assert "optimizer" in err and "Expected 'torch.nn.Linear' to be a subclass of <class 'Optimizer'>" in err


def test_the_model_help_shows_the_option(capsys):
    with pytest.raises(SystemExit):
        train.main(["fit", "--model.help", "DeepSMIDA"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--model.optimizer OPTIMIZER Each player's optimizer" in out and "Callable[[Iterable], Optimizer]" in out
