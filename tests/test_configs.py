"""Every shipped config runs `fit` (and its `test`) with fast_dev_run through the real CLI entry point, small: with the
options of its header's ``# Smoke:`` lines (``tests/helpers/config_header.py``; paths that a config expects from an
earlier job point at test fixtures)."""

import glob
import os

import pytest
import yaml
from helpers import ROOT
from helpers.config_header import smoke_args

from alignment_games import train

CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


def _smollm2(path):
    with open(path, encoding="utf-8") as f:
        return "builtin:smollm2-135m-instruct" in f.read()


# Configs on the pretrained SmolLM2 (a wheel download and conversion on first use, minutes a run on 2 cores): their
# fast_dev_run is in the slow set; the default set checks that each parses and names no Qwen system message.
SMOLLM2 = [c for c in CONFIGS if _smollm2(c)]


@pytest.mark.parametrize(
    "config",
    [pytest.param(c, marks=pytest.mark.slow) if c in SMOLLM2 else c for c in CONFIGS],
    ids=os.path.basename,
)
def test_config_runs_fast_dev_run_and_leaves_nothing_behind(config, tmp_path, monkeypatch, tiny_lm_dir):
    """Each config's smoke run trains a step and writes nothing: no ``checkpoints/last-vN.ckpt`` (Lightning's
    ``save_last`` skips its ``fast_dev_run`` check at the end of training), no result file in the working folder, and
    no SFT model in ``artifacts/`` (neither the trained model nor its tiny base)."""
    scratch = tmp_path / "cwd"
    scratch.mkdir()
    monkeypatch.chdir(scratch)
    extra = smoke_args(config, tiny_lm_dir=str(tiny_lm_dir), root=ROOT)
    cli = train.main(["fit", "--config", config, "--trainer.fast_dev_run=true", "--trainer.accelerator=cpu", *extra])
    assert cli.trainer.state.finished
    assert cli.trainer.global_step > 0
    assert sorted(str(p.relative_to(scratch)) for p in scratch.rglob("*")) == []


def test_the_sft_configs_are_found():
    """The configs whose smoke runs once left their model in ``artifacts/`` are among those checked above."""
    names = [os.path.basename(c) for c in CONFIGS if "sft" in os.path.basename(c)]
    assert names == ["debate_sft_tiny.yaml", "sft_competent.yaml", "sft_small.yaml", "sft_tiny.yaml"]


def test_smollm2_configs_are_found():
    """The configs on SmolLM2 are those named so (their fast_dev_run is in the slow set), and there are some."""
    names = {os.path.basename(c) for c in SMOLLM2}
    assert "grpo_smollm2.yaml" in names
    assert names == {os.path.basename(c) for c in CONFIGS if c.endswith("_smollm2.yaml")}


def test_preference_ensemble_configs_label_each_pair_with_one_binary_verdict():
    """The paper's training data carry one binary oracle label a pair, and §5.2 counts the ensemble's errors against
    it (App. E.1): the preference ensemble's configs ask their oracle one query a pair (11 is a named deviation)."""
    found = {}
    for path in CONFIGS:
        with open(path, encoding="utf-8") as f:
            cfg = yaml.safe_load(f)
        if cfg["model"]["class_path"].endswith(".PreferenceEnsemble"):
            found[os.path.basename(path)] = cfg["data"]["init_args"]["oracle"]["init_args"]["num_queries"]
    assert found == {"preference_ensemble.yaml": 1, "preference_ensemble_smollm2.yaml": 1}


@pytest.mark.parametrize("config", SMOLLM2, ids=os.path.basename)
def test_smollm2_config_parses_without_a_qwen_system_message(config, capsys):
    """Each SmolLM2 config parses (``--print_config``: nothing is loaded), and no family default puts "You are Qwen"
    into a prompt of this Llama model."""
    with pytest.raises(SystemExit) as done:
        train.main(["fit", "--config", config, "--print_config"])
    assert done.value.code in (0, None)
    out = capsys.readouterr().out
    assert "name_or_path: builtin:smollm2-135m-instruct" in out
    assert "Qwen" not in out
    assert ("system_prompt:" in out) == ("PreferenceEnsemble" not in out)  # every policy family states its own
    assert "dtype: float32" in out


def test_help_reads_as_the_manual(capsys):
    with pytest.raises(SystemExit):
        train.main(
            [
                "fit",
                "--model=PreferenceEnsemble",
                "--model.help",
                "alignment_games.modules.preference.PreferenceEnsemble",
            ]
        )
    out = capsys.readouterr().out
    assert "--model.num_members" in out and "Ensemble size" in out


def test_unknown_option_is_rejected(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        train.main(
            [
                "fit",
                "--config",
                os.path.join(ROOT, "configs", "preference_ensemble.yaml"),
                "--model.init_args.num_memberz=3",
            ]
        )
