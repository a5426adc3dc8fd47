"""The main job end to end through the CLI: fit → report, test --ckpt_path reproduces it, predict scores a jsonl,
and two DDP processes agree with one."""

import glob
import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT

from alignment_games import train
from alignment_games.modules.preference import PreferenceEnsemble

CONFIG = os.path.join(ROOT, "configs", "preference_ensemble.yaml")
SMALL = [
    "--trainer.accelerator=cpu",
    "--trainer.max_epochs=3",
    "--data.init_args.num_prompts=120",
    "--model.init_args.num_members=3",
    "--model.init_args.report_bootstrap=20",
]


def _reports(root):
    return sorted(glob.glob(os.path.join(root, "runs", "**", "report.json"), recursive=True))


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    root = tmp_path_factory.mktemp("fit")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        cli = train.main(["fit", "--config", CONFIG, *SMALL])
    finally:
        os.chdir(cwd)
    return root, cli, os.path.join(root, cli.trainer.log_dir)


@pytest.mark.e2e  # the main job's CLI fit, about 40 s on 2 cores (`pytest -m e2e`, .ci/run)
def test_fit_leaves_logs_checkpoints_config_and_report(fitted):
    root, cli, log_dir = fitted
    assert os.path.isfile(os.path.join(log_dir, "config.yaml"))
    assert glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))
    assert os.path.isfile(os.path.join(log_dir, "checkpoints", "last.ckpt"))
    report = json.load(open(os.path.join(log_dir, "report.json")))
    assert report["n_pairs"] == len(cli.datamodule.splits["test"]) == 30 * 10
    assert len(report["member_accuracy"]) == 3
    assert 0.0 <= report["ensemble_accuracy"] <= 1.0
    # the labels' oracle and protocol: the paper's one binary verdict a pair (App. E.1), nothing left out
    assert report["oracle"] == {
        "oracle": "ProgrammaticOracle",
        "protocol": "binary",
        "num_queries": 1,
        "invalid_verdicts": 0,
        "timeouts": 0,
        "unlabelled_rows": 0,
        "pairs_dropped": 0,
    }
    # trained on, and errors counted against, 0/1 labels
    for split in ("train", "test"):
        assert {r["label"] for r in cli.datamodule.splits[split]} == {0.0, 1.0}, split


@pytest.mark.e2e  # the main job's CLI fit, about 40 s on 2 cores (`pytest -m e2e`, .ci/run)
def test_test_with_ckpt_path_reproduces_the_report(fitted, tmp_path, monkeypatch):
    root, cli, log_dir = fitted
    first = json.load(open(os.path.join(log_dir, "report.json")))
    ckpt = os.path.join(log_dir, "checkpoints", "last.ckpt")
    monkeypatch.chdir(tmp_path)
    again = train.main(["test", "--config", CONFIG, *SMALL, f"--ckpt_path={ckpt}"])
    second = json.load(open(os.path.join(tmp_path, again.trainer.log_dir, "report.json")))
    # what the run read differs by design (its folder, its command, the checkpoint it loaded); the results may not
    made, remade = first.pop("provenance"), second.pop("provenance")
    assert second == first
    assert remade["commit"] == made["commit"] and remade["cwd"] == str(tmp_path)


@pytest.mark.e2e  # the main job's CLI fit, about 40 s on 2 cores (`pytest -m e2e`, .ci/run)
def test_predict_scores_pairs_from_jsonl(fitted, tmp_path, monkeypatch):
    root, cli, log_dir = fitted
    rows = [
        {
            "prompt": "Ava has 3 apples. Then, Ava buys 2 more. How many apples does Ava have now?",
            "response_a": "Ava starts with 3 apples. After adding 2, Ava has 3 + 2 = 5 apples. \\boxed{5}.",
            "response_b": "Ava starts with 3 apples.",
        },
        {"prompt": "What is 1 + 1?", "response_a": "1 + 1 = 2. \\boxed{2}", "response_b": "1 + 1 = 3. \\boxed{3}"},
    ]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ckpt = os.path.join(log_dir, "checkpoints", "last.ckpt")
    monkeypatch.chdir(tmp_path)
    pred = train.main(
        ["predict", "--config", CONFIG, *SMALL, f"--ckpt_path={ckpt}", f"--data.init_args.predict_path={pairs}"]
    )
    out = [json.loads(line) for line in open(os.path.join(tmp_path, pred.trainer.log_dir, "predictions.jsonl"))]
    assert [o["row"] for o in out] == [0, 1]
    scorer = PreferenceEnsemble.load_frozen(ckpt, num_members=3)  # the config of the run that trained it
    expected = scorer.score(
        [r["prompt"] for r in rows], [r["response_a"] for r in rows], [r["response_b"] for r in rows]
    )
    for o, e in zip(out, expected):
        assert o["member_probs"] == pytest.approx(e.tolist(), abs=1e-5)
        assert o["prob"] == pytest.approx(e.mean().item(), abs=1e-5)
        assert o["variance"] == pytest.approx(e.var(unbiased=False).item(), abs=1e-6)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**rows[0], "response_b": ""}) + "\n")
    with pytest.raises(ValueError, match="row 1: field 'response_b' is empty"):
        train.main(
            ["predict", "--config", CONFIG, *SMALL, f"--ckpt_path={ckpt}", f"--data.init_args.predict_path={bad}"]
        )


def test_bad_backbone_path_fails_before_writing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # jsonargparse re-raises the module's OSError as a ValueError; the message names the field and the folder
    with pytest.raises((OSError, ValueError), match=r"lm.name_or_path: the model folder '.*missing' does not exist"):
        train.main(["fit", "--config", CONFIG, *SMALL, f"--model.init_args.lm.name_or_path={tmp_path / 'missing'}"])
    assert not os.path.exists(tmp_path / "runs")


def _run(args, cwd):
    env = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.load(open(_reports(cwd)[-1]))


@pytest.mark.distributed
def test_two_ddp_processes_match_one(tmp_path):
    common = ["fit", "--config", CONFIG, *SMALL, "--data.init_args.num_prompts=200", "--trainer.max_epochs=4"]
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = _run([*common, "--data.init_args.batch_size=64"], tmp_path / "one")
    two = _run(
        [*common, "--trainer.devices=2", "--trainer.strategy=ddp", "--data.init_args.batch_size=32"], tmp_path / "two"
    )
    # same held-out set, every pair exactly once (the sampler's padding is dropped by row id)
    assert one["n_pairs"] == two["n_pairs"] == 50 * 10
    assert one["n_prompts"] == two["n_prompts"]
    assert two["ensemble_accuracy"] == pytest.approx(one["ensemble_accuracy"], abs=0.06)
    for a, b in zip(one["member_accuracy"], two["member_accuracy"]):
        assert b == pytest.approx(a, abs=0.08)
