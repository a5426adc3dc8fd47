import random
import re

import pytest

from datamodules.arithmetic import generate_problems, make_response, make_think_response
from datamodules.sft import ArithmeticSFTDataModule
from modules.algorithms.answers import extract_final_answer
from modules.evaluation.policy_accuracy import reply_in_format


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
    with pytest.raises(ValueError, match="width must be non-negative"):
        make_think_response(generate_problems(1)[0], width=-1)
    with pytest.raises(ValueError, match="min_steps <= max_steps"):
        ArithmeticSFTDataModule(min_steps=3, max_steps=2)
