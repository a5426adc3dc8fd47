"""Every shipped config runs `fit` (and its `test`) with fast_dev_run through the real CLI entry point."""

import glob
import os

import pytest
import yaml
from helpers import ROOT

from alignment_games import train

CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


def _smollm2(path):
    with open(path, encoding="utf-8") as f:
        return "builtin:smollm2-135m-instruct" in f.read()


# Configs on the pretrained SmolLM2 (a wheel download and conversion on first use, minutes a run on 2 cores): their
# fast_dev_run is in the slow set; the default set checks that each parses and names no Qwen system message.
SMOLLM2 = [c for c in CONFIGS if _smollm2(c)]

# deep-SMIDA refuses an untrained utility unless asked by name; a smoke run asks (no ensemble is trained first)
UNTRAINED = "--model.init_args.utility.init_args.allow_untrained=true"
# Small data so a smoke run stays fast; paths that a config expects from an earlier job point at test fixtures.
SMALL = {
    **{
        f"debate_{p}.yaml": [
            "--data.init_args.num_prompts=40",
            "--model.init_args.sampling.max_new_tokens=16",
            "--model.init_args.reply_max_new_tokens=8",
            "--model.init_args.lm.name_or_path={tiny_lm_dir}",
        ]
        for p in ("rlaif_a", "ab", "aba", "rlvr", "hacking", "pairwise", "pairwise_baseline", "b_judge", "b_convince")
        + ("steps", "ties", "frozen_critic")
    },
    "debate_sft_tiny.yaml": ["--data.init_args.num_prompts=40", "--model.init_args.lm.name_or_path={tiny_lm_dir}"],
    "preference_ensemble.yaml": ["--data.init_args.num_prompts=40"],
    "sft_tiny.yaml": ["--data.init_args.num_prompts=40"],
    "sft_small.yaml": ["--data.init_args.num_prompts=40"],
    # a fast_dev_run's one step is the whole cosine schedule: no warmup steps before it
    "sft_competent.yaml": ["--data.init_args.num_prompts=40", "--model.init_args.warmup_steps=0"],
    "deep_smida_small_fo.yaml": [
        "--data.init_args.num_prompts=40",
        "--model.init_args.sampling.max_new_tokens=16",
        "--model.init_args.follower_samples=2",
        "--model.init_args.lm.name_or_path={tiny_lm_dir}",
        UNTRAINED,
    ],
    **{
        f"{name}.yaml": [
            "--data.init_args.num_prompts=40",
            "--model.init_args.sampling.max_new_tokens=16",
            "--model.init_args.follower_samples=2",
            "--model.init_args.lm.name_or_path={tiny_lm_dir}",
            UNTRAINED,
        ]
        for name in ("deep_smida", "deep_smida_competent")
    },
    **{
        f"{name}.yaml": [
            "--data.init_args.num_prompts=40",
            "--model.init_args.sampling.max_new_tokens=16",
            "--model.init_args.lm.name_or_path={tiny_lm_dir}",
            "--model.init_args.preference.init_args.allow_untrained=true",
        ]
        for name in ("nlhf", "slhf")
    },
    **{
        f"grpo_{name}.yaml": [
            "--data.init_args.num_prompts=40",
            "--data.init_args.batch_size=2",
            "--model.init_args.sampling.max_new_tokens=8",
            "--model.init_args.lm.name_or_path={tiny_lm_dir}",
        ]
        for name in ("tiny", "competent")
    },
    **{
        f"pool_{algorithm}{start}.yaml": [
            "--model.init_args.lm.name_or_path={tiny_lm_dir}",
            "--model.init_args.duels_per_iteration=3",
            "--model.init_args.sampling.max_new_tokens=6",
            "--model.init_args.eval_max_new_tokens=6",
            "--data.init_args.num_problems=10",
            "--data.init_args.num_test_problems=2",
            "--data.init_args.batch_size=2",
            # a random tiny model is never right, so every reference-graded duel would tie and DPO would take no step
            *(["--model.init_args.judging.mode=constrained"] if (algorithm, start) == ("dpo", "_competent") else []),
        ]
        for algorithm in ("dpo", "grpo")
        for start in ("", "_competent")
    },
    "deep_smida_smollm2.yaml": [UNTRAINED],
    **{
        f"{name}_smollm2.yaml": ["--model.init_args.preference.init_args.allow_untrained=true"]
        for name in ("nlhf", "slhf")
    },
}


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
    extra = [a.format(tiny_lm_dir=tiny_lm_dir) for a in SMALL.get(os.path.basename(config), [])]
    cli = train.main(["fit", "--config", config, "--trainer.fast_dev_run=true", "--trainer.accelerator=cpu", *extra])
    assert cli.trainer.state.finished
    assert cli.trainer.global_step > 0
    assert sorted(str(p.relative_to(scratch)) for p in scratch.rglob("*")) == []


def test_the_sft_configs_are_found():
    """The configs whose smoke runs once left their model in ``artifacts/`` are among those checked above."""
    names = [os.path.basename(c) for c in CONFIGS if "sft" in os.path.basename(c)]
    assert names == ["debate_sft_tiny.yaml", "sft_competent.yaml", "sft_small.yaml", "sft_tiny.yaml"]


def test_smollm2_configs_are_found():
    names = {os.path.basename(c) for c in SMOLLM2}
    expected = {"grpo", "rft", "online_ipo", "debate", "pool", "deep_smida", "nlhf", "slhf", "preference_ensemble"}
    assert names == {f"{n}_smollm2.yaml" for n in expected}


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
