import hashlib
import json

import pytest
from helpers.provenance import check_provenance

from alignment_games.commands.policy_accuracy import main
from alignment_games.modules.evaluation.policy_accuracy import (
    policy_accuracy,
    reply_in_format,
    score_replies,
    wilson_interval,
)


def test_counts_match_hand_judged_replies():
    replies = [
        "<think>3 + 4 = 7</think>\nThe answer is \\boxed{7}.",  # right, in format
        "<think>3 + 4 = 8</think>\nThe answer is \\boxed{8}.",  # wrong, in format
        "The answer is \\boxed{7}.",  # right, no think block
        "<think>3 + 4 = 7\nThe answer is \\boxed{7}.",  # right, think never closed
        "<think>3 + 4 = 7</think>\nThe answer is 7.",  # no box: wrong, out of format
        "<think>a</think><think>b</think> \\boxed{7}",  # right, two think blocks
        "<think>3 + 4 = 7</think>\\boxed{7.0}",  # right (7.0 == 7), in format
    ]
    refs = ["7"] * len(replies)
    report = score_replies(replies, refs)
    assert report.pop("accuracy_ci95") == pytest.approx(list(wilson_interval(5, 7)))
    assert report == {"n": 7, "correct": 5, "in_format": 3, "accuracy": 5 / 7, "format_rate": 3 / 7}


def test_wilson_interval_inverts_the_score_test():
    # independent reference: the proportions p where the score test just fails, (k/n - p)^2 = z^2 p (1 - p) / n,
    # found by root-finding on each side of k/n (z the normal 97.5% quantile from scipy)
    from scipy.optimize import brentq
    from scipy.stats import norm

    z = norm.ppf(0.975)
    for k, n in [(5, 7), (237, 400), (1, 20), (19, 20), (200, 400)]:
        gap = lambda p, k=k, n=n: (k / n - p) ** 2 - z * z * p * (1 - p) / n  # noqa: E731
        reference = (brentq(gap, 1e-12, k / n), brentq(gap, k / n, 1 - 1e-12))
        assert wilson_interval(k, n) == pytest.approx(reference, abs=1e-9)
    assert wilson_interval(0, 20) == pytest.approx((0.0, z * z / (20 + z * z)))  # ends at 0, closed form
    assert wilson_interval(20, 20) == pytest.approx((20 / (20 + z * z), 1.0))
    with pytest.raises(ValueError, match="successes=3, n=2"):
        wilson_interval(3, 2)
    with pytest.raises(ValueError, match="n=0"):
        wilson_interval(0, 0)


def test_format_needs_the_box_outside_the_think_block():
    assert not reply_in_format("<think>\\boxed{7}</think> seven")
    assert reply_in_format("  <think>x</think> so \\boxed{7}")
    assert not reply_in_format("hi <think>x</think> \\boxed{7}")  # text before the block


def test_bad_inputs_are_refused(tiny_lm_dir):
    with pytest.raises(ValueError, match="2 replies but 1 references"):
        score_replies(["a", "b"], ["1"])
    with pytest.raises(ValueError, match="no replies"):
        score_replies([], [])
    with pytest.raises(ValueError, match="num_problems must be at least 1"):
        policy_accuracy(tiny_lm_dir, num_problems=0)
    with pytest.raises(ValueError, match="min_steps <= max_steps"):
        policy_accuracy(tiny_lm_dir, num_problems=2, min_steps=3, max_steps=2)


def test_command_scores_a_random_tiny_model(tiny_lm_dir, tmp_path, capsys):
    out = tmp_path / "report.json"
    report = main(["--model", tiny_lm_dir, "--num-problems", "3", "--max-new-tokens", "4", "--out", str(out)])
    # four bytes can spell neither a think block nor a box: nothing is right, nothing is in format
    assert (report["n"], report["correct"], report["in_format"]) == (3, 0, 0)
    assert report["accuracy_ci95"] == pytest.approx(list(wilson_interval(0, 3)))
    counts = [(k, v["n"], v["correct"]) for k, v in report["by_operations"].items()]
    assert sum(n for _, n, _ in counts) == 3 and all(c == 0 and 2 <= int(k) <= 4 for k, _, c in counts)
    assert json.loads(out.read_text()) == json.loads(capsys.readouterr().out) == report
    assert [len(e["reply"].encode()) <= 4 for e in report["examples"]] == [True] * 3
    weights = hashlib.sha256(open(f"{tiny_lm_dir}/model.safetensors", "rb").read()).hexdigest()
    assert report["model_record"] == {"path": tiny_lm_dir, "sha256": weights, "base_identity": None}
    rows = [json.loads(line) for line in (tmp_path / "report.problems.jsonl").read_text().splitlines()]
    assert report["per_problem"]["rows"] == 3 and [r["correct"] for r in rows] == [{"model": False}] * 3
    check_provenance(json.loads(out.read_text()), {"--model": tiny_lm_dir})
