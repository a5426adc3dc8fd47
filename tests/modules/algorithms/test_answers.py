import pytest

from alignment_games.modules.algorithms.answers import answers_match, extract_final_answer, extract_gsm8k_answer


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so the answer is \boxed{42}.", "42"),
        (r"first \boxed{1} then \boxed{2}", "2"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{ {a}^{2} }", "{a}^{2}"),
        (r"no box here", None),
        (r"\boxed{12", None),
        ("", None),
        (None, None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


@pytest.mark.parametrize(
    "a, b, same",
    [
        ("1,000", "1000", True),
        ("2.50", "2.5", True),
        (r"\frac{1}{2}", "0.5", True),
        (r"\dfrac{3}{4}", "3/4", True),
        ("$5$", "5", True),
        (r"12\text{ apples}", "12", True),
        (" 7 ", "7", True),
        ("3", "4", False),
        ("x+1", "x + 1", True),
        (None, "1", False),
        ("", "", False),
    ],
)
def test_answers_match(a, b, same):
    assert answers_match(a, b) is same


def test_gsm8k_answer():
    assert extract_gsm8k_answer("He has 3 + 4 = 7.\n#### 7") == "7"
    assert extract_gsm8k_answer("no marker") is None
