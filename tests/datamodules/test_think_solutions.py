import random
import re

import pytest

from alignment_games.datamodules.sft import ArithmeticSFTDataModule
from alignment_games.modules.algorithms.answers import extract_final_answer
from alignment_games.modules.algorithms.arithmetic import (
    ArithmeticProblem,
    generate_problems,
    make_response,
    make_think_response,
)
from alignment_games.modules.evaluation.policy_accuracy import reply_in_format


@pytest.mark.parametrize("style", ["think", "think_padded"])
def test_think_solutions_are_right_line_by_line_and_in_format(style):
    dm = ArithmeticSFTDataModule(
        num_prompts=60, kinds=["correct"], style=style, min_steps=1, max_steps=2, follower_fraction=0.0
    )
    dm.setup()
    problems = generate_problems(60, 2_000_003, 1, 2)
    for (system, question, response), p in zip(dm.val_pairs + dm.train_pairs, problems):
        assert (
            question == p.question and system == "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
        )
        assert reply_in_format(response) and extract_final_answer(response) == str(p.answer)
        lines = response.split("</think>")[0].removeprefix("<think>").split("\n")
        assert 1 <= len(lines) == len(p.ops) <= 2
        v = p.start
        for line, (op, n) in zip(lines, p.ops):
            a, sym, b, c = re.fullmatch(r"(\d+) ([-+*]) (\d+) = (\d+)", line).groups()
            assert (int(a), sym, int(b)) == (v, op, n)
            # padded: three digits each (no total here reaches 1000); plain: no leading zero
            assert all(len(x) == 3 if style == "think_padded" else str(int(x)) == x for x in (a, b, c))
            v = {"+": v + n, "-": v - n, "*": v * n}[op]
            assert int(c) == v


@pytest.mark.parametrize(
    ("start", "ops", "expected"),
    [
        # the brief's example: 38 + 13 = 51, each number padded to three digits and read from its units up
        (38, [("+", 13)], "<think>830 + 310 = 150</think>\nThe answer is \\boxed{51}."),
        # a borrow, then a carry into the hundreds; the box in normal order, no leading zero
        (
            52,
            [("-", 7), ("*", 3), ("+", 40)],
            "<think>250 - 700 = 540\n540 * 300 = 531\n531 + 040 = 571</think>\nThe answer is \\boxed{175}.",
        ),
        (5, [("-", 5)], "<think>500 - 500 = 000</think>\nThe answer is \\boxed{0}."),
    ],
)
def test_reversed_writer_matches_hand_written_examples(start, ops, expected):
    v = start
    for op, n in ops:
        v = {"+": v + n, "-": v - n, "*": v * n}[op]
    assert make_think_response(ArithmeticProblem("", v, start, ops), width=3, reverse=True) == expected


def test_reversed_style_writes_each_equation_backwards_and_boxes_the_true_answer():
    dm = ArithmeticSFTDataModule(
        num_prompts=200, kinds=["correct"], style="think_reversed", min_steps=1, max_steps=6, follower_fraction=0.0
    )
    dm.setup()
    problems = generate_problems(200, 2_000_003, 1, 6)
    for (_, question, response), p in zip(dm.val_pairs + dm.train_pairs, problems):
        assert question == p.question
        assert reply_in_format(response) and extract_final_answer(response) == str(p.answer)
        lines = response.split("</think>")[0].removeprefix("<think>").split("\n")
        assert len(lines) == len(p.ops)
        v = p.start
        for line, (op, n) in zip(lines, p.ops):
            a, sym, b, c = re.fullmatch(r"(\d{3}) ([-+*]) (\d{3}) = (\d{3})", line).groups()
            v_next = {"+": v + n, "-": v - n, "*": v * n}[op]
            assert (int(a[::-1]), sym, int(b[::-1]), int(c[::-1])) == (v, op, n, v_next)
            v = v_next
        assert v == p.answer
    # the same problems as the padded style, only the digits' order inside the think block differs
    padded = ArithmeticSFTDataModule(
        num_prompts=200, kinds=["correct"], style="think_padded", min_steps=1, max_steps=6, follower_fraction=0.0
    )
    padded.setup()
    for (_, _, r), (_, _, rp) in zip(dm.train_pairs, padded.train_pairs):
        assert r.split("</think>")[1] == rp.split("</think>")[1]
        assert sorted(r.split("</think>")[0]) == sorted(rp.split("</think>")[0])


def test_worded_default_is_unchanged():
    dm = ArithmeticSFTDataModule(num_prompts=20, follower_fraction=0.0, seed=3)
    dm.setup()
    rng = random.Random(3)
    expected = []
    for p in generate_problems(20, 2_000_006):  # the default 2-4 steps
        kind = rng.choices(dm.kinds, weights=dm.weights)[0]
        rng.random()  # the follower draw
        expected.append(make_response(p, kind, rng))
    assert [r for _, _, r in dm.val_pairs + dm.train_pairs] == expected


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="style must be one of"):
        ArithmeticSFTDataModule(style="terse")
    with pytest.raises(ValueError, match="correct solutions only"):
        ArithmeticSFTDataModule(style="think")  # every corruption kind by default
    with pytest.raises(ValueError, match="'think_padded' writes correct solutions only"):
        ArithmeticSFTDataModule(style="think_padded", kinds=["correct", "padded"])
    with pytest.raises(ValueError, match="reverse needs a width"):
        make_think_response(generate_problems(1)[0], reverse=True)
    with pytest.raises(ValueError, match="bucket_window must be non-negative"):
        ArithmeticSFTDataModule(bucket_window=-1)
    with pytest.raises(ValueError, match="width must be non-negative"):
        make_think_response(generate_problems(1)[0], width=-1)
    with pytest.raises(ValueError, match="min_steps <= max_steps"):
        ArithmeticSFTDataModule(min_steps=3, max_steps=2)
