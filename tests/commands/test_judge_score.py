import json
import os

import pytest
import torch
import yaml
from helpers import ROOT
from helpers.provenance import check_provenance

from alignment_games.commands.judge_score import _config, main, read_answers
from alignment_games.datamodules.debate import DebateDataModule
from alignment_games.modules.evaluation.judge_score import judge_report

DEBATE = os.path.join(ROOT, "configs", "debate_smollm2.yaml")
VERIFIER = os.path.join(ROOT, "configs", "judges", "verifier_smollm2.yaml")


@pytest.fixture
def debate_config(tmp_path, tiny_lm_dir):
    """The SmolLM2 debate config with the tiny model as Alice and judge, short replies, 12 problems."""
    with open(DEBATE, encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    model = cfg["model"]["init_args"]
    model["lm"]["name_or_path"] = model["judge"]["init_args"]["model"] = str(tiny_lm_dir)
    model["sampling"]["max_new_tokens"] = 6
    cfg["data"]["init_args"]["num_prompts"] = 12
    path = tmp_path / "debate.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _rows(tmp_path, truths):
    path = tmp_path / "answers.jsonl"
    rows = [
        {
            "problem": i // 2,
            "prompt": f"Ann has {i} pens.",
            "reference": str(i),
            "answer": f"\\boxed{{{i}}}",
            "truth": t,
        }
        for i, t in enumerate(truths)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_answers_are_the_splits_problems_each_sampled_and_graded(tmp_path, debate_config):
    out = tmp_path / "a.jsonl"
    argv = ["answers", "--config", str(debate_config), "--temperature", "0", "0.7", "--samples", "2", "--out", str(out)]
    rows = main(argv)
    dm = DebateDataModule(problems="single_step", max_operand=30, num_prompts=12, val_fraction=0.5, batch_size=2)
    dm.setup("fit")
    val = dm.splits["val"]
    passes = [(0.0, 0), (0.7, 0), (0.7, 1)]  # one greedy answer, then --samples at each sampled temperature
    assert [(r["prompt"], r["reference"], r["temperature"], r["sample"]) for r in rows] == [
        (p["prompt"], p["reference"], t, k) for t, k in passes for p in val
    ]
    assert read_answers(str(out)) == rows
    assert all(r["truth"] is False for r in rows if "\\boxed" not in r["answer"])  # no boxed answer is never right


def test_score_reports_every_answer_its_votes_and_the_inputs_hashes(tmp_path, debate_config, tiny_lm_dir):
    answers = _rows(tmp_path, [True, False, True, True, False, False])
    out = tmp_path / "report.json"
    report = main(
        ["score", "--config", str(debate_config), "--answers", str(answers), "--votes", "3", "--out", str(out)]
    )
    assert json.loads(out.read_text())["mcc"] == report["mcc"]
    votes = torch.tensor([[float("nan") if v is None else v for v in r["votes"]] for r in report["answers"]])
    assert votes.shape == (6, 3) and report["num_votes"] == 3 and report["n_problems"] == 3
    again = judge_report(votes, [r["truth"] for r in report["answers"]], [r["problem"] for r in report["answers"]])
    assert {k: again[k] for k in ("mcc", "auroc", "tie_share")} == {k: report[k] for k in ("mcc", "auroc", "tie_share")}
    block = check_provenance(
        report, {"config": str(debate_config), "answers": str(answers), "judge_model": tiny_lm_dir}
    )
    assert block["inputs"]["judge_model"]["model"]  # the judge's identity, as checkpoints record it


def test_sft_refuses_a_system_message_the_judge_never_reads(tmp_path, debate_config):
    answers = _rows(tmp_path, [True, False])
    with pytest.raises(SystemExit) as exit_info:
        main(["sft", "--config", str(debate_config), "--answers", str(answers), "--out", str(tmp_path / "s.jsonl")])
    assert exit_info.value.code == 2 and not (tmp_path / "s.jsonl").exists()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{", "row 2: not JSON"),
        ('{"problem": 0}', "row 2: field 'prompt'"),
        ('{"problem": "0"}', "row 2: field 'problem'"),
    ],
)
def test_a_malformed_answers_row_is_named(tmp_path, line, message):
    path = _rows(tmp_path, [True])
    path.write_text(path.read_text() + line + "\n")
    with pytest.raises(ValueError, match=message):
        read_answers(str(path))


@pytest.mark.e2e
def test_sft_rows_render_to_the_smollm2_judges_own_prompt(tmp_path):
    """SmolLM2's template puts in a default system message: the SFT rows carry it, so the texts are the judge's."""
    answers = _rows(tmp_path, [True, False])
    rows = main(
        [
            "sft",
            "--config",
            DEBATE,
            "--answers",
            str(answers),
            "--out",
            str(tmp_path / "s.jsonl"),
        ]
    )
    assert [r["completion"] for r in rows] == ["Verdict: Alice", "Verdict: Bob"]
    assert rows[0]["prompt"][0]["content"].startswith("You are a helpful AI assistant named SmolLM")


def test_a_later_config_is_laid_over_the_game_config():
    _, judge, data = _config([DEBATE, VERIFIER])
    args = judge["init_args"]
    assert args["model"] == "artifacts/judge_verifier_smollm2" and args["chain_of_thought"] is True
    assert args["sampling"] == {"temperature": 1.0, "max_new_tokens": 40} and args["num_votes"] == 8
    assert args["max_answer_words"] == 50 and args["max_prompt_tokens"] == 768  # the game config's, kept
    assert data == _config([DEBATE])[2]


def test_a_config_that_is_not_a_mapping_is_named(tmp_path):
    bad = tmp_path / "overlay.yaml"
    bad.write_text("- judge\n")
    with pytest.raises(ValueError, match=r"--config: .*overlay.yaml is not a mapping of settings \(a YAML list\)"):
        _config([DEBATE, str(bad)])


@pytest.mark.e2e
def test_a_thinking_verifiers_rows_write_the_check_then_the_verdict(tmp_path, capsys):
    path = tmp_path / "answers.jsonl"
    prompt = "Ann has 3 pens. Then, Ann buys 14 more. How many pens does Ann have now?"
    answers = ["3 + 14 = 17. \\boxed{17}", "\\boxed{16} and \\boxed{18}", "17 pens"]
    rows = [{"problem": 0, "prompt": prompt, "reference": "17", "answer": a, "truth": a[-3:] == "17}"} for a in answers]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["sft", "--config", DEBATE, "--config", VERIFIER, "--judge-model", "builtin:smollm2-135m-instruct"]
    argv += ["--answers", str(path), "--out", str(tmp_path / "s.jsonl")]
    written = main([*argv, "--reasoning", "{n1} + {n2} = {reference}. Alice's final answer is {final}."])
    assert [r["completion"] for r in written] == [
        "<think>3 + 14 = 17. Alice's final answer is 17.</think>\nVerdict: Alice",
        "<think>3 + 14 = 17. Alice's final answer is 18.</think>\nVerdict: Bob",  # the last box is the final answer
        "<think>3 + 14 = 17. Alice's final answer is none.</think>\nVerdict: Bob",
    ]
    balanced = main([*argv, "--balance", "--reasoning", "{check}"])  # the one right answer repeated to two rows
    alice, bob = "<think>equal</think>\nVerdict: Alice", "<think>not equal</think>\nVerdict: Bob"
    assert [r["completion"] for r in balanced] == [alice, alice, bob, bob]
    os.remove(tmp_path / "s.jsonl")
    for extra, message in [(["--reasoning", "{n3}"], "row 1 has no field 'n3'"), ([], "a thinking judge needs")]:
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, *extra])
        assert exit_info.value.code == 2 and not (tmp_path / "s.jsonl").exists()
        assert message in capsys.readouterr().err


@pytest.mark.engines
def test_the_smollm2_judge_votes_on_the_engine_over_a_hundred_answers(tmp_path):
    """The committed 100 greedy answers, 4 votes each on vLLM: seeded sampled requests beyond the engine's first
    batches once stopped vLLM 0.32 on CPU ("CPU Generator does not use offset") until chunked prefill was turned off."""
    answers = os.path.join(ROOT, "benchmarks", "results", "judge_smollm2", "greedy100.jsonl")
    argv = ["score", "--config", DEBATE, "--answers", answers, "--votes", "4"]
    report = main([*argv, "--decode", "vllm", "--out", str(tmp_path / "r.json")])
    assert report["n_answers"] == 100 and report["judge"]["decode"] == "vllm"
    assert all(len(r["votes"]) == 4 for r in report["answers"])
