"""Every own-data recipe of docs/data.md run through the real CLI entry point on the files of tests/data.

Its main recipe (a chosen/rejected file with its own column names) runs exactly as written (its options, the main
config, nothing else); the others use ``--trainer.fast_dev_run`` or one epoch and small sampling lengths to stay short.
"""

import json
import os

import pytest
import torch
from helpers import ROOT

from alignment_games import train

DATA = os.path.join(ROOT, "tests", "data")
CONFIGS = os.path.join(ROOT, "configs")
MAIN = os.path.join(CONFIGS, "preference_ensemble.yaml")
# docs/data.md's main recipe, "a chosen/rejected file with its own column names", word for word
README_RECIPE = [
    "--data.init_args.prompt_column=question",
    "--data.init_args.response_a_column=chosen",
    "--data.init_args.response_b_column=rejected",
    "--data.init_args.label_column=null",
]
FAST = ["--trainer.accelerator=cpu", "--trainer.fast_dev_run=true"]


def _report(cli):
    return json.load(open(os.path.join(cli.trainer.log_dir, "report.json")))


def _rows(name):
    with open(os.path.join(DATA, name)) as f:
        return [json.loads(line) for line in f]


def test_the_readme_recipe_trains_the_main_config_on_a_chosen_rejected_file(tmp_path, monkeypatch):
    """The recipe needs no option beyond the docs', and the main config's oracle leaves the labels alone."""
    monkeypatch.chdir(tmp_path)
    path = os.path.join(DATA, "pairs_question_chosen_rejected.jsonl")
    cli = train.main(["fit", "--config", MAIN, f"--data.init_args.path={path}", *README_RECIPE])
    report = _report(cli)
    # 40 questions: a quarter (10) held out, one pair each; labels from the file, so no oracle
    assert (report["n_pairs"], report["n_prompts"], report["oracle"]) == (10, 10, None)
    assert 0.0 <= report["ensemble_accuracy"] <= 1.0 and len(report["member_accuracy"]) == 5
    assert set(report["auroc"]) == {"variance", "decision_uncertainty", "jsd"}
    assert cli.trainer.current_epoch == 10  # the config's max_epochs, run whole


def test_relabelling_a_file_with_the_oracle_is_asked_for_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = os.path.join(DATA, "pairs_question_chosen_rejected.jsonl")
    args = ["fit", "--config", MAIN, f"--data.init_args.path={path}", *README_RECIPE, "--trainer.max_epochs=1"]
    with pytest.raises(ValueError, match="set data.relabel: true"):
        train.main([*args, "--data.init_args.reference_column=answer"])
    cli = train.main([*args, "--data.init_args.relabel=true", "--data.init_args.reference_column=answer"])
    oracle = _report(cli)["oracle"]
    assert (oracle["oracle"], oracle["protocol"], oracle["num_queries"], oracle["pairs_dropped"]) == (
        "ProgrammaticOracle",
        "binary",
        1,
        0,
    )


def test_a_trl_conversational_file_with_an_implicit_prompt_needs_only_its_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = os.path.join(DATA, "trl_preference_implicit.jsonl")
    cli = train.main(["fit", "--config", MAIN, f"--data.init_args.path={path}", "--trainer.max_epochs=1"])
    assert (_report(cli)["n_pairs"], _report(cli)["oracle"]) == (10, None)
    # MiniLM has no chat template: the plain lines, the prompt being the shared user turn
    prompt = _rows("trl_preference_implicit.jsonl")[0]["chosen"][0]["content"]
    tok = cli.model.tokenizer
    decoded = [tok.decode(s, skip_special_tokens=True) for s in cli.datamodule.sequences]
    assert any(
        d.startswith(tok.decode(tok(f"user: {prompt}\nassistant:")["input_ids"], skip_special_tokens=True))
        for d in decoded
    )


def test_a_hub_preference_set_with_subset_and_revision(tmp_path, monkeypatch):
    import datasets

    real, calls = datasets.load_dataset, []

    def fake_hub(name, config_name=None, split=None, revision=None, **kw):
        if name in ("json", "parquet", "csv"):
            return real(name, split=split, **kw)
        calls.append((name, config_name, split, revision))
        return real("json", data_files=os.path.join(DATA, "trl_preference_standard.jsonl"), split="train")

    monkeypatch.setattr(datasets, "load_dataset", fake_hub)
    monkeypatch.chdir(tmp_path)
    hub = ["--data.init_args.name=org/pairs", "--data.init_args.config_name=v2", "--data.init_args.revision=abc123"]
    cli = train.main(["fit", "--config", MAIN, *hub, "--data.init_args.split=test", *FAST])
    assert calls == [("org/pairs", "v2", "test", "abc123")] and cli.trainer.state.finished
    assert len(cli.datamodule.splits["train"]) == 26  # 40 prompts - 10 held out - 4 validation


@pytest.mark.parametrize("name", ["sft_messages.jsonl", "sft_prompt_completion_conversational.jsonl"])
def test_sft_on_a_file(tmp_path, monkeypatch, name):
    from safetensors.torch import load_file

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "policy"
    cli = train.main(
        [
            "fit",
            "--config",
            os.path.join(CONFIGS, "sft_tiny.yaml"),
            "--data=alignment_games.datamodules.sft.SFTFileDataModule",
            f"--data.init_args.path={os.path.join(DATA, name)}",
            f"--model.init_args.output_dir={out}",
            # one step, saved (a fast_dev_run saves no model)
            "--trainer.accelerator=cpu",
            "--trainer.max_steps=1",
            "--trainer.limit_val_batches=0",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
        ]
    )
    assert len(cli.datamodule.train_pairs) + len(cli.datamodule.val_pairs) == 32
    before, after = load_file(out / "_init" / "model.safetensors"), load_file(out / "model.safetensors")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed and set(before) == set(after)  # one step on the file's data moved the saved weights


def _source(prefix, name, prompt, reference=None, fmt=None, category=None):
    args = [f"--{prefix}.path={os.path.join(DATA, name)}", f"--{prefix}.prompt_column={prompt}"]
    args += [f"--{prefix}.reference_column={reference}"] if reference else []
    args += [f"--{prefix}.reference_format={fmt}"] if fmt else []
    return args + ([f"--{prefix}.category_column={category}"] if category else [])


@pytest.mark.parametrize(
    ("config", "extra"),
    [
        ("grpo_tiny.yaml", ["--model.init_args.sampling.max_new_tokens=8"]),
        (
            "debate_rlvr.yaml",
            ["--model.init_args.sampling.max_new_tokens=16", "--model.init_args.reply_max_new_tokens=8"],
        ),
    ],
)
def test_grpo_and_debate_on_problems_with_reference_answers(tmp_path, monkeypatch, tiny_lm_dir, config, extra):
    monkeypatch.chdir(tmp_path)
    source = _source("data.init_args.source", "problems_gsm8k_style.jsonl", "question", "answer", "gsm8k")
    cli = train.main(
        [
            "fit",
            "--config",
            os.path.join(CONFIGS, config),
            *source,
            f"--model.init_args.lm.name_or_path={tiny_lm_dir}",
            *extra,
            *FAST,
        ]
    )
    refs = {r["question"]: r["answer"].rsplit("#### ", 1)[1] for r in _rows("problems_gsm8k_style.jsonl")}
    rows = cli.datamodule.splits["train"] + cli.datamodule.splits["val"]
    assert len(rows) == 32 and all(refs[r["prompt"]] == r["reference"] for r in rows)
    assert cli.trainer.global_step > 0


def test_pool_instructions_with_categories(tmp_path, monkeypatch, tiny_lm_dir):
    monkeypatch.chdir(tmp_path)
    source = _source(
        "data.init_args.source", "instructions_with_categories.jsonl", "instruction", "answer", None, "category"
    )
    cli = train.main(
        [
            "fit",
            "--config",
            os.path.join(CONFIGS, "pool_dpo.yaml"),
            *source,
            f"--model.init_args.lm.name_or_path={tiny_lm_dir}",
            "--model.init_args.duels_per_iteration=3",
            "--model.init_args.sampling.max_new_tokens=6",
            "--model.init_args.eval_max_new_tokens=6",
            "--test_after_fit=false",  # the training iteration's logged metrics are read below
            *FAST,
        ]
    )
    logged = cli.trainer.logged_metrics
    weights = {k.rsplit("/", 1)[1]: float(v) for k, v in logged.items() if k.startswith("leader/category_weight/")}
    assert set(weights) == {"2_steps", "3_steps", "4_steps"}
    assert sum(weights.values()) == pytest.approx(1.0, abs=1e-6)
    # the leader's mass per category is the sum of its probabilities over that category's instructions
    probs, cats = cli.model.leader_probabilities().tolist(), cli.model.categories
    assert weights["2_steps"] == pytest.approx(sum(p for p, c in zip(probs, cats) if c == "2_steps"), abs=1e-6)
    assert cats == [r["category"] for r in cli.datamodule.splits["train"]]
