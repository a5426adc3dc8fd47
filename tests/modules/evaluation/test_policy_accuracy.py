import json

import pytest

from modules.evaluation.policy_accuracy import main, policy_accuracy, reply_in_format, score_replies


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
    assert score_replies(replies, refs) == {
        "n": 7,
        "correct": 5,
        "in_format": 3,
        "accuracy": 5 / 7,
        "format_rate": 3 / 7,
    }


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
    assert json.loads(out.read_text()) == json.loads(capsys.readouterr().out) == report
    assert [len(e["reply"].encode()) <= 4 for e in report["examples"]] == [True] * 3
