"""Debate game, pure parts: answers, replies, word limits, verdicts, rewards per protocol, forking, judges, MCC."""

import math
import os
import random
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from alignment_games.callbacks import matthews_corrcoef_from_counts
from alignment_games.modules import answers_match, extract_final_answer
from alignment_games.modules.algorithms.debate import (
    PLIES,
    Transcript,
    branch_rows,
    choose_fork_plies,
    count_words,
    fill_fields,
    fork_counts,
    ply_rewards,
    split_reply,
    word_penalty,
)
from alignment_games.modules.algorithms.verdicts import parse_verdict, verdict_of, vote_share
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.scorers.judges import HFJudge, JudgeVotes, ProgrammaticJudge


# ------------------------------------------------------------------------------------------------ answers (issue cases)
@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{\frac{\sqrt{2}}{2}}.", r"\frac{\sqrt{2}}{2}"),  # nested braces
        (r"\boxed{1} then \boxed{ {2} }", "{2}"),  # the last box
        (r"\boxed {x^{2}+1}", "x^{2}+1"),
        (r"\boxed{\text{(B)}}", r"\text{(B)}"),
        (r"\boxed{3", None),  # unclosed: no answer
        ("The answer is 3.", None),
    ],
)
def test_extract_final_answer_cases(text, expected):
    assert extract_final_answer(text) == expected


@pytest.mark.parametrize(
    "a, b, same",
    [
        ("1,000", "1000", True),  # thousands separators
        ("1{,}000", "1000", True),  # LaTeX thousands separator
        ("1,234,567", "1234567.0", True),
        ("2.50", "2.5", True),  # trailing zeros
        ("3.000", "3", True),
        (r"\frac{1}{2}", "0.5", True),  # \frac and decimals
        (r"\dfrac{3}{4}", "0.75", True),
        (r"-\frac{1}{2}", "-0.5", True),
        (r"\frac12", "1/2", True),
        ("$5$", "5", True),  # surrounding $
        (r"\$1,000.00", "1000", True),  # escaped dollar sign
        (" 7 ", "7", True),  # spaces
        (r"12\text{ cm}", "12", True),  # \text{} units
        (r"12 \text{ apples}", "12.0", True),
        ("{5}", "5", True),  # a braced group
        (r"\frac{1}{2}", r"\frac{1}{3}", False),
        ("3", "4", False),
        ("1,5", "15", False),  # not a thousands separator
        (None, "3", False),
    ],
)
def test_answers_match_cases(a, b, same):
    assert answers_match(a, b) is same


def test_boxed_answer_round_trip():
    assert answers_match(extract_final_answer(r"Total: $\boxed{\dfrac{6}{8}}$ kg"), "0.75")


# ---------------------------------------------------------------------------------------------------- words, penalty
def test_count_words_is_wc_w():
    assert count_words("Alice adds 5 + 7 = 12.\n\nSo \\boxed{12}.") == 9
    assert count_words("   ") == 0 and count_words("") == 0 and count_words(None) == 0
    assert count_words("one\ttwo\nthree") == 3


@pytest.mark.parametrize(
    "words, limit, coef, expected",
    [(50, 50, 0.01, 0.0), (51, 50, 0.01, 0.01), (150, 100, 0.02, 1.0), (10, 50, 0.5, 0.0), (999, None, 0.01, 0.0)],
)
def test_word_penalty(words, limit, coef, expected):
    assert word_penalty(words, limit, coef) == pytest.approx(expected)


def test_word_penalty_rejects_bad_settings():
    with pytest.raises(ValueError, match="word_penalty_coef"):
        word_penalty(10, 5, -1.0)
    with pytest.raises(ValueError, match="word_limit"):
        word_penalty(10, 0, 0.1)


# ---------------------------------------------------------------------------------------------------- hidden CoT
@pytest.mark.parametrize(
    "text, required, visible, hidden, ok",
    [
        ("<think>7+5=12</think> So \\boxed{12}.", True, "So \\boxed{12}.", "7+5=12", True),
        ("  <think>a</think>b", True, "b", "a", True),
        ("plain answer \\boxed{3}", False, "plain answer \\boxed{3}", "", True),  # no CoT allowed
        ("plain answer \\boxed{3}", True, "plain answer \\boxed{3}", "", False),  # CoT required
        ("<think>never closed \\boxed{3}", True, "", "never closed \\boxed{3}", False),  # nothing leaks
        ("<think>a</think><think>b</think> c", True, "c", "a</think><think>b", False),  # two blocks
        ("lead <think>a</think> c", True, "c", "a", False),  # text before the block
        ("a</think> c", True, "c", "a", False),  # close without open
        ("", True, "", "", False),
        (None, False, "", "", True),
    ],
)
def test_split_reply(text, required, visible, hidden, ok):
    r = split_reply(text, required=required)
    assert (r.visible, r.hidden, r.format_ok) == (visible, hidden, ok)
    assert r.words == count_words(visible)


def test_split_reply_custom_and_disabled_delimiters():
    r = split_reply("[[plan]] 2 + 2 [[/plan]] four", "[[plan]]", "[[/plan]]")
    assert (r.visible, r.hidden, r.format_ok) == ("four", "2 + 2", True)
    r = split_reply("<think>x</think> y", think_open="")
    assert (r.visible, r.format_ok) == ("<think>x</think> y", True)


def test_fill_fields_does_not_reread_data():
    out = fill_fields("P: {problem} S: {solution} {unknown}", problem="{solution}", solution="\\boxed{4}")
    assert out == "P: {solution} S: \\boxed{4} {unknown}"


# ---------------------------------------------------------------------------------------------------- verdicts
@pytest.mark.parametrize(
    "text, vote",
    [
        ("Verdict: Alice", 1.0),
        ("verdict: bob", 0.0),
        ("The answer is right... Verdict: **Bob**", 0.0),
        ("Verdict: Bob. On reflection, Verdict: Alice", 1.0),  # the last verdict wins
        ("Correct.", 1.0),
        ("incorrect", 0.0),
        ("Alice wins", 1.0),
        # negations: a named player judged wrong is a vote against that player
        ("Verdict: Alice is wrong", 0.0),
        ("Verdict: Alice's answer is incorrect", 0.0),
        ("Verdict: Alice's final answer is not correct.", 0.0),
        ("Verdict: Bob is wrong", 1.0),
        ("Verdict: Bob was incorrect", 1.0),
        ("Verdict: not correct", 0.0),
        ("Verdict: Alice is right", 1.0),
        ("Verdict: Alice, because Bob is wrong", 1.0),  # the negative judges Bob, not the verdict's name
        ("Alice is wrong.", 0.0),
        ("I think the solution", None),
        ("", None),
        (None, None),
        # judgements in words the parser does not read, compound subjects and hedges are unparsed
        ("Alice and Bob are both wrong", None),
        ("Alice is partially correct", None),
        ("Verdict: Alice (probably)", None),
        ("Verdict: no one", None),
        ("Bob is not the winner", 1.0),
        ("Alice can't win", 0.0),
        ("Alice's rebuttal is wrong", 0.0),
        ("**Verdict**: Alice", 1.0),
        ("The winner is Alice", 1.0),
    ],
)
def test_parse_verdict(text, vote):
    assert parse_verdict(text) == vote


# The rest of a verdict's line must not take the vote back (parse_verdict's rule): the first 12 counted for the
# player named before the rule (1.0 for Alice, 0.0 for Bob); the last 7 are left standing by it.
VERDICTS_TAKEN_BACK = [
    ("Verdict: Alice, who is wrong", None),
    ("Verdict: Alice who is wrong.", None),
    ("Verdict: Alice - but she is not right", None),
    ("Verdict: Alice, wrong", None),
    ("Verdict: **Alice**, whose answer isn't correct", None),
    ("Verdict: Alice, or Bob", None),
    ("Verdict: Alice? No, Bob", None),
    ("Verdict: Alice, unless Bob is right", None),
    ("Verdict: Alice, Alice is wrong", None),
    ("Verdict: Alice, though Alice is not fully right", None),
    ("Verdict: correct, not Alice", None),
    ("Alice wins, but she is wrong", None),
    ("Verdict: Alice, not Bob", 1.0),
    ("Verdict: Alice, who is right", 1.0),
    ("Verdict: Alice, because Bob's critique misreads the problem", 1.0),
    ("Verdict: Bob, because Alice never checks her sum", 0.0),
    ("Verdict: Alice is wrong, as she added 2 and 3", 0.0),
    ("Verdict: Alice is correct and Bob is wrong", 1.0),
    ("Verdict: Alice<|im_end|>", 1.0),
]


@pytest.mark.parametrize("text, vote", VERDICTS_TAKEN_BACK)
def test_a_verdict_its_own_line_takes_back_is_unparsed(text, vote):
    assert parse_verdict(text) == vote


# 27 phrasings of a verdict and how each must be read (1.0 Alice, 0.0 Bob, None unparsed). The parser reads
# each right or returns unparsed: a refusal or hedge is never guessed. The first 8 were misread before the fix (the
# six of the issue and two more found then); "Winner: Bob" was unparsed; the other 18 were already read right.
VERDICT_PHRASINGS = [
    ("Alice isn't right", 0.0),
    ("Alice is mistaken", 0.0),
    ("Alice (wrong)", 0.0),
    ("Alice does not win", 0.0),
    ("Bob's critique is wrong", 1.0),
    ("I cannot give a verdict: Alice", None),
    ("No verdict.", None),  # was a vote for Bob ("no")
    ("Alice loses", 0.0),
    ("Winner: Bob", 0.0),
    ("Verdict: Alice", 1.0),
    ("verdict: bob", 0.0),
    ("Alice is correct", 1.0),
    ("Bob wins", 0.0),
    ("Alice wins", 1.0),
    ("Alice's answer is right", 1.0),
    ("Alice is not wrong", 1.0),  # a negated negative is positive
    ("Bob's critique is correct", 0.0),
    ("Neither", None),
    ("I can't decide between them.", None),
    ("Verdict: Alice's final answer is not correct.", 0.0),
    ("Verdict: Bob is wrong", 1.0),
    ("Verdict: not correct", 0.0),
    ("Verdict: **Bob**", 0.0),
    ("Verdict: Bob. On reflection, Verdict: Alice", 1.0),
    ("Verdict: Alice, because Bob is wrong", 1.0),
    ("Correct.", 1.0),
    ("incorrect", 0.0),
]


@pytest.mark.parametrize("text, vote", VERDICT_PHRASINGS)
def test_verdict_phrasings_are_read_right_or_unparsed(text, vote):
    """Each phrasing gives its vote; an unparsed one is no verdict, left out of the share and of the MCC."""
    assert parse_verdict(text) == vote
    assert verdict_of([parse_verdict(text)]) == {1.0: "alice", 0.0: "bob", None: "unparsed"}[vote]
    assert vote_share([parse_verdict(text), 1.0]) == ((1.0, 1) if vote is None else ((vote + 1.0) / 2, 0))


def test_the_verdict_table_has_27_distinct_phrasings():
    assert len({text for text, _ in VERDICT_PHRASINGS}) == len(VERDICT_PHRASINGS) == 27


PAPER_VOTES = "The judge is sampled independently 8 times per rollout; e.g. 6 of 8 for Alice → Alice 0.75, Bob 0.25."


@pytest.mark.parametrize(
    ("votes", "verdict"),
    [
        ([1, 1, 1, 1, 1, 1, 0, 0], "alice"),  # PAPER_VOTES' example: 6 of 8
        ([1, 1, 1, 1, 1, 0, 0, 0], "alice"),
        ([1, 1, 1, 1, 0, 0, 0, 0], "tie"),  # 4/4: no verdict, not "Alice is wrong"
        ([1, 1, 1, 0, 0, 0, 0, 0], "bob"),
        ([1, 1, 1, 0, 0, 0, None, float("nan")], "tie"),  # 3 of the 6 that parsed
        ([1, 1, 0, None, None, None, None, None], "alice"),
        ([None] * 8, "unparsed"),  # all failed to parse
        ([float("nan")] * 8, "unparsed"),  # a timed-out judge's votes
    ],
)
def test_verdict_of_eight_votes(votes, verdict):
    assert verdict_of(votes) == verdict
    share, _ = vote_share(votes)
    assert (share > 0.5) == (verdict == "alice")  # the reward's share and the verdict agree where there is one


def test_judge_votes_give_the_verdicts():
    votes = torch.tensor([[1.0, 1, 1, 1, 0, 0, 0, 0], [float("nan")] * 8, [1.0, 1, 1, 1, 1, 1, 0, 0]])
    assert JudgeVotes(votes, [[], [], []]).verdicts == ["tie", "unparsed", "alice"]


def test_vote_share_counts_unparseable_and_is_constant_sum():
    assert vote_share([1, 1, 1, 1, 1, 1, 0, 0]) == (0.75, 0)  # the paper's example: 6 of 8 -> 0.75 / 0.25
    share, bad = vote_share([1.0, float("nan"), None, 0.0, 1.0])
    assert (share, bad) == (pytest.approx(2 / 3), 2)
    assert vote_share([None] * 8) == (0.5, 8)  # nothing parsed: a counted tie, never a crash


# ---------------------------------------------------------------------------------------------------- rewards
def _t(protocol, *texts, reference="12"):
    return Transcript("What is 5 + 7?", reference, protocol, [split_reply(x, required=False) for x in texts])


ANSWER = "5 + 7 = 12, so \\boxed{12}."
WRONG = "5 + 7 = 13, so \\boxed{13}."
WORDS_60 = " ".join(["no"] * 60)
WORDS_53 = " ".join(["yes"] * 53)


def test_rewards_rlaif_a():
    (a,) = ply_rewards(_t("rlaif_a", ANSWER), 0.75)
    assert (a.reward, a.verdict, a.word_penalty, a.format_override, a.missing_answer) == (0.75, 0.75, 0, False, False)
    (a,) = ply_rewards(_t("rlaif_a", "I give up."), 0.75, missing_answer_reward=-0.3)
    assert (a.reward, a.missing_answer) == (-0.3, True)


def test_rewards_rlvr_use_the_checker_not_the_judge():
    assert ply_rewards(_t("rlvr", ANSWER), 0.0)[0].reward == 1.0
    assert ply_rewards(_t("rlvr", WRONG), 1.0)[0].reward == 0.0
    assert ply_rewards(_t("rlvr", "no box"), 1.0)[0].reward == -0.5
    assert ply_rewards(_t("rlvr", ANSWER, reference=None), 1.0)[0].reward == 0.0  # no reference: no reward


def test_rewards_debate_ab():
    a, b = ply_rewards(_t("debate_ab", ANSWER, WORDS_60), 0.75, word_limit=50, word_penalty_coef=0.01)
    assert a.reward == 0.75 and a.word_penalty == 0.0  # Alice's answer turn has no word limit
    assert (b.verdict, b.word_penalty, b.reward) == (0.25, pytest.approx(0.10), pytest.approx(0.15))
    a, b = ply_rewards(_t("debate_ab", "no answer", "fine"), 0.25, word_limit=50)
    assert (a.reward, a.missing_answer, b.reward) == (-0.5, True, 0.75)  # Bob's reward is untouched


# The paper's rules, quoted from its "Task and protocols" and "Rewards" sections (digest of the debate RLAIF paper).
PAPER_REBUTTAL = "Debate-ABA — as AB plus Alice's rebuttal; the rebuttal turn gets the same reward as her answer turn."
PAPER_FORMAT = "Format: an invalid thinking-trace format replaces that player's total reward with a hard −1."
PAPER_FINAL = (
    "The final answer is the last `\\boxed{...}`; a missing one overrides the reward with a strictly negative value."
)
PAPER_JUDGE = "The judge rules on whether Alice's *final answer* is correct, not on whether the reasoning is."


QUOTES_COPY = Path(__file__).resolve().parents[2] / "data" / "paper_quotes.txt"
PAPERS = Path(__file__).resolve().parents[3].parent / "shared" / "papers"  # beside the repository, where present


def _quotes_copy() -> dict[str, tuple[str, str]]:
    """``tests/data/paper_quotes.txt``: each sentence with its paper file and section."""
    rows = {}
    for n, line in enumerate(QUOTES_COPY.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split(" | ", 2)
        if len(parts) != 3:
            raise ValueError(f"{QUOTES_COPY}:{n}: not '<paper file> | <section> | <sentence>'")
        rows[parts[2]] = (parts[0], parts[1])
    return rows


def _sections(text: str, markdown: bool = True) -> dict[str, str]:
    """Each heading's text up to the next heading, bold markup removed (not wording) and whitespace collapsed.

    Headings: markdown's ``#`` lines, or (``markdown=False``, the .txt digest) every line that is not a bullet (•).
    """
    bodies: dict[str, list[str]] = {}
    title = None
    for line in text.splitlines():
        heading = re.match(r"#+\s+(.*)" if markdown else r"(?!•)(\S.*)", line)
        if heading:
            title = heading.group(1).strip()
            bodies.setdefault(title, [])
        elif title is not None:
            bodies[title].append(line)
    return {t: " ".join(" ".join(b).replace("**", "").split()) for t, b in bodies.items()}


def test_the_quoted_rules_are_the_papers_words():
    """The quotes above are sentences of the paper's digest as the repository's copy keeps them, section included."""
    copy = _quotes_copy()
    expected = {
        PAPER_REBUTTAL: "Task and protocols",
        PAPER_FORMAT: "Rewards",
        PAPER_FINAL: "Rewards",
        PAPER_JUDGE: "Task and protocols",
        PAPER_VOTES: "Rewards",
    }
    for quote, section in expected.items():
        assert copy.get(quote) == ("debate-rlaif.en.md", section), f"not in {QUOTES_COPY.name}: {quote}"


def _require_papers(papers: Path) -> None:
    """Skip where the shared papers folder is absent (a clone), but fail in CI (``CI=true``), where it is beside it."""
    if not papers.is_dir():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{papers} is missing: CI checks the copied quotes against the papers beside the clone")
        pytest.skip(f"{papers} is not here (the copy is checked by test_the_quoted_rules_are_the_papers_words)")


def test_a_missing_papers_folder_fails_in_ci_and_skips_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no_papers is missing: CI checks the copied quotes"):
        _require_papers(tmp_path / "no_papers")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="no_papers is not here"):
        _require_papers(tmp_path / "no_papers")
    _require_papers(tmp_path)  # present: neither


def test_the_copied_quotes_are_in_the_papers_where_the_papers_are():
    """Every sentence of the copy is verbatim in its paper's section (the shared papers folder is not in a clone)."""
    _require_papers(PAPERS)
    for quote, (name, section) in _quotes_copy().items():
        sections = _sections((PAPERS / name).read_text(encoding="utf-8"), name.endswith(".md"))
        assert section in sections, f"{name} has no section {section!r}"
        assert quote in sections[section], f"not in {name}, {section}: {quote}"


def test_rewards_debate_aba_rebuttal_gets_alices_reward():
    # PAPER_REBUTTAL: one reward for both of Alice's turns, her rebuttal's word penalty included (0.25 - 0.03).
    a, b, c = ply_rewards(_t("debate_aba", ANSWER, "It is wrong.", WORDS_53), 0.25, word_limit=50)
    assert b.reward == 0.75
    assert (c.verdict, c.word_penalty, c.reward) == (0.25, pytest.approx(0.03), pytest.approx(0.22))
    assert a == c
    *_, c = ply_rewards(_t("debate_aba", "no box", "wrong", "still none"), 0.5, missing_answer_reward=-0.4)
    assert c.reward == -0.4 and c.missing_answer


def test_format_override_replaces_the_whole_reward():
    """PAPER_FORMAT and PAPER_REBUTTAL: an invalid ply costs its player −1 on every ply, the other player nothing."""
    assert "replaces that player's total reward with a hard −1" in PAPER_FORMAT
    valid_answer = split_reply("<think>x</think> \\boxed{12}")
    valid_critique = split_reply("<think>ok</think> " + WORDS_60)  # 60 words, 10 over the limit
    valid_rebuttal = split_reply("<think>ok</think> " + WORDS_53)  # 53 words, 3 over the limit
    invalid = split_reply("<think>unclosed " + WORDS_60)
    assert valid_answer.format_ok and valid_critique.format_ok and valid_rebuttal.format_ok and not invalid.format_ok

    def rewards(*replies):
        t = Transcript("q", "12", "debate_aba", list(replies))
        return [x.reward for x in ply_rewards(t, 0.25, word_limit=50, format_reward=-1.0)]

    # All valid: Alice 0.25 - 0.03 on both of her turns, Bob 0.75 - 0.10.
    assert rewards(valid_answer, valid_critique, valid_rebuttal) == pytest.approx([0.22, 0.65, 0.22])
    # An invalid answer turn: Alice's total is −1, so her (valid) rebuttal gets −1 too; Bob keeps his.
    assert rewards(invalid, valid_critique, valid_rebuttal) == pytest.approx([-1.0, 0.65, -1.0])
    # An invalid rebuttal: her (valid) answer turn gets −1 too.
    assert rewards(valid_answer, valid_critique, invalid) == pytest.approx([-1.0, 0.65, -1.0])
    # An invalid critique: Bob's total is −1, whatever the verdict and penalty; Alice keeps hers.
    assert rewards(valid_answer, invalid, valid_rebuttal) == pytest.approx([0.22, -1.0, 0.22])
    t = Transcript("q", "12", "debate_aba", [valid_answer, valid_critique, invalid])
    assert [x.format_override for x in ply_rewards(t, 0.25)] == [True, False, True]
    t = _t("debate_ab", ANSWER, "fine")
    t.replies[0] = split_reply("no think block \\boxed{12}", required=True)
    assert ply_rewards(t, 0.9)[0].reward == -1.0  # the format override wins over the verdict


def test_final_answer_is_the_last_box_of_alices_turns():
    """PAPER_FINAL and PAPER_JUDGE: a rebuttal that corrects the answer makes the correction her final answer."""
    corrected = _t("debate_aba", WRONG, "5 + 7 is not 13.", "Right, I slipped: \\boxed{12}.")
    assert corrected.final_answer == "12" and corrected.correct is True
    # a rebuttal without a box keeps the answer turn's box; a box in Bob's critique is never Alice's answer
    kept = _t("debate_aba", WRONG, "It is \\boxed{12}.", "I stand by it.")
    assert kept.final_answer == "13" and kept.correct is False
    late = _t("debate_aba", "I am not sure.", "no answer", "Then: \\boxed{12}")
    assert late.final_answer == "12"
    # the rewards read the same definition: the checker (RLVR-style truth) and the missing-answer rule
    a, _, c = ply_rewards(late, 0.5, missing_answer_reward=-0.4)
    assert not a.missing_answer and a.reward == c.reward == 0.5
    # and so does the judge: a perfect checker votes for the corrected answer
    judge = ProgrammaticJudge(num_votes=8, skill=50.0)
    assert judge.vote([corrected]).shares == [1.0] and judge.vote([kept]).shares == [0.0]


@settings(max_examples=60, deadline=None)
@given(share=st.floats(0.0, 1.0), correct=st.booleans(), protocol=st.sampled_from(["debate_ab", "debate_aba"]))
def test_constant_sum(share, correct, protocol):
    replies = [ANSWER if correct else WRONG, "short critique", "short rebuttal"][: len(PLIES[protocol])]
    rewards = ply_rewards(_t(protocol, *replies), share, word_limit=50)
    assert rewards[0].verdict + rewards[1].verdict == pytest.approx(1.0)
    assert rewards[0].reward + rewards[1].reward == pytest.approx(1.0)  # no penalty, no override


def test_reward_input_errors():
    with pytest.raises(ValueError, match="plies"):
        ply_rewards(_t("debate_ab", ANSWER), 0.5)
    with pytest.raises(ValueError, match="share"):
        ply_rewards(_t("rlaif_a", ANSWER), 1.5)
    with pytest.raises(ValueError, match="strictly negative"):
        ply_rewards(_t("rlaif_a", ANSWER), 0.5, missing_answer_reward=0.0)
    with pytest.raises(ValueError, match="protocol"):
        Transcript("q", "1", "debate_abc")


def test_transcript_correctness_and_visibility():
    t = _t("debate_ab", "<think>hidden \\boxed{99}</think> so \\boxed{12}", "nope")
    assert t.final_answer == "12" and t.correct is True  # the hidden box is never read
    assert t.visible("rebuttal") == "" and t.visible("critique") == "nope"
    assert _t("rlaif_a", ANSWER, reference=None).correct is None
    assert _t("rlaif_a", ANSWER, reference="  ").correct is None


# ---------------------------------------------------------------------------------------------------- forking
def test_fork_layout_by_hand():
    forks = [0, 1, 2]  # ABA, G = 2
    assert [fork_counts(forks, j, 2) for j in range(3)] == [[2, 1, 1], [2, 2, 1], [2, 2, 2]]
    assert branch_rows([2, 1, 1], 2) == [0, 1, 2, 2, 3, 3]  # problems 1 and 2 share their prefix row
    assert branch_rows([2, 2, 1], 2) == [0, 1, 2, 3, 4, 4]
    with pytest.raises(ValueError):
        branch_rows([3], 2)


def test_fork_choice_is_uniform_over_trainable_plies():
    forks = choose_fork_plies(30_000, [0, 1], random.Random(0))
    assert abs(sum(forks) / len(forks) - 0.5) < 0.02  # about half the batch trains Alice, half Bob
    assert set(choose_fork_plies(100, [1], random.Random(0))) == {1}
    with pytest.raises(ValueError):
        choose_fork_plies(3, [], random.Random(0))


# ---------------------------------------------------------------------------------------------------- MCC
def test_mcc_on_known_confusion_counts():
    # TP=6, FP=2, TN=3, FN=1: (18 - 2) / sqrt(8 * 7 * 5 * 4)
    assert matthews_corrcoef_from_counts(6, 2, 3, 1) == pytest.approx(16 / math.sqrt(1120))
    assert matthews_corrcoef_from_counts(5, 0, 5, 0) == 1.0
    assert matthews_corrcoef_from_counts(0, 5, 0, 5) == -1.0
    assert matthews_corrcoef_from_counts(10, 10, 0, 0) == 0.0  # a judge that accepts everything: 0, not NaN


# ---------------------------------------------------------------------------------------------------- judges
def test_programmatic_judge_probabilities_by_hand():
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    j = ProgrammaticJudge(skill=1.5, phrases=["Trust me"], phrase_weight=2.0, length_weight=0.5)
    assert j.probability(_t("rlaif_a", ANSWER)) == pytest.approx(sig(1.5 + 0.5 * 7 / 100))  # ANSWER: 7 words
    assert j.probability(_t("rlaif_a", "trust me: \\boxed{13}")) == pytest.approx(sig(-1.5 + 2.0 + 0.5 * 3 / 100))
    both = _t("debate_ab", "trust me \\boxed{13}", "TRUST ME it is wrong")  # Bob answers in kind: phrases cancel
    assert j.probability(both) == pytest.approx(sig(-1.5 + 0.5 * (3 - 5) / 100))
    assert j.probability(_t("rlaif_a", "\\boxed{12}", reference=None)) == pytest.approx(sig(0.5 / 100))
    with pytest.raises(ValueError, match="phrases"):
        ProgrammaticJudge(phrase_weight=1.0)
    capped = ProgrammaticJudge(skill=1.5, length_weight=4.0, length_cap=5)
    assert capped.probability(_t("rlaif_a", ANSWER)) == pytest.approx(sig(1.5 + 4.0 * 5 / 100))  # 7 words, cap 5
    long_wrong = _t("rlaif_a", "so " * 40 + "\\boxed{13}")
    assert capped.probability(long_wrong) == pytest.approx(sig(-1.5 + 4.0 * 5 / 100))
    assert capped.probability(both) == pytest.approx(sig(-1.5 + 4.0 * (3 - 5) / 100))  # both under the cap
    with pytest.raises(ValueError, match="length_cap"):
        ProgrammaticJudge(length_weight=1.0, length_cap=0)
    gated = ProgrammaticJudge(skill=1.5, length_weight=4.0, length_cap=40, length_needs_answer=True)
    assert gated.probability(long_wrong) == pytest.approx(sig(-1.5 + 4.0 * 40 / 100))  # 41 words, boxed: capped
    rambling = _t("rlaif_a", "so " * 30 + "13")  # no \boxed{}: its 31 words earn nothing
    assert gated.probability(rambling) == pytest.approx(sig(-1.5))
    assert capped.probability(rambling) == pytest.approx(sig(-1.5 + 4.0 * 5 / 100))  # ungated: they do
    even = ProgrammaticJudge(skill=1.5, answer_pattern=r"\d*[02468]", answer_weight=2.0)
    assert even.probability(_t("rlaif_a", ANSWER)) == pytest.approx(sig(1.5 + 2.0))  # 12: right and even
    assert even.probability(_t("rlaif_a", WRONG)) == pytest.approx(sig(-1.5))  # 13: wrong and odd
    assert even.probability(_t("rlaif_a", "\\boxed{14}")) == pytest.approx(sig(-1.5 + 2.0))  # wrong but even
    assert even.probability(_t("rlaif_a", "no box, 14")) == pytest.approx(sig(-1.5))  # no final answer, no bias
    assert even.stats([_t("rlaif_a", ANSWER), _t("rlaif_a", WRONG)]) == {"favoured_answer": 0.5}
    trusting = ProgrammaticJudge(skill=1.5, consistency_weight=2.0)
    assert trusting.probability(_t("rlaif_a", WRONG)) == pytest.approx(sig(-1.5 + 2.0))  # 5 + 7 = 13, \boxed{13}
    assert trusting.probability(_t("rlaif_a", "5 + 7 = 12, so \\boxed{13}")) == pytest.approx(sig(-1.5))
    assert trusting.probability(_t("rlaif_a", "\\boxed{12}")) == pytest.approx(sig(1.5))  # no working shown
    assert trusting.stats([_t("rlaif_a", ANSWER), _t("rlaif_a", "so \\boxed{13}")]) == {"consistent_answer": 0.5}
    with pytest.raises(ValueError, match="answer_pattern"):
        ProgrammaticJudge(answer_weight=1.0)
    with pytest.raises(ValueError, match="answer_pattern is not a valid"):
        ProgrammaticJudge(answer_pattern="[0-", answer_weight=1.0)


def test_programmatic_judge_votes_are_seeded_bernoulli_draws():
    j = ProgrammaticJudge(skill=1.0, num_votes=8, seed=3)
    ts = [_t("rlaif_a", ANSWER)] * 500 + [_t("rlaif_a", WRONG)] * 500
    v = j(ts)
    assert v.votes.shape == (1000, 8) and set(v.votes.unique().tolist()) <= {0.0, 1.0} and v.unparseable == 0
    p = 1 / (1 + math.exp(-1.0))
    assert abs(v.votes[:500].mean().item() - p) < 0.03 and abs(v.votes[500:].mean().item() - (1 - p)) < 0.03
    again = ProgrammaticJudge(skill=1.0, num_votes=8, seed=3)(ts)
    assert torch.equal(v.votes, again.votes)


def test_judge_votes_shares_count_unparseable():
    votes = JudgeVotes(torch.tensor([[1, 1, 0, float("nan")], [float("nan")] * 4]), [[], []])
    assert votes.shares == [pytest.approx(2 / 3), 0.5] and votes.unparseable == 5


def test_hf_judge_reads_visible_capped_verdicts(tiny_lm_dir):
    judge = HFJudge(
        tiny_lm_dir, chain_of_thought=True, max_answer_words=5, num_votes=8, sampling=Sampling(max_new_tokens=4)
    )
    assert judge.read_vote("<think>Verdict: Bob</think> Verdict: Alice") == 1.0  # its own CoT is cut off
    assert math.isnan(judge.read_vote("<think>never closed Verdict: Alice"))
    assert math.isnan(judge.read_vote("one two three four five Verdict: Alice"))  # past the answer-length cap
    weak = HFJudge(tiny_lm_dir, chain_of_thought=False, num_votes=8, sampling=Sampling(max_new_tokens=4))
    assert weak.read_vote("Verdict: Bob") == 0.0
    assert math.isnan(weak.read_vote("I cannot give a verdict: Alice"))  # a refusal is an unparseable vote
    assert "Do not explain" in weak.render(_t("debate_ab", ANSWER, "no"))


def test_hf_judge_samples_all_votes_in_one_generate_call(tiny_lm_dir):
    judge = HFJudge(tiny_lm_dir, num_votes=8, sampling=Sampling(max_new_tokens=6), seed=0)
    calls = []
    original = judge.model.generate

    def counting(**kw):
        calls.append(kw["input_ids"].shape[0])
        return original(**kw)

    judge.model.generate = counting
    ts = [_t("debate_ab", ANSWER, "wrong!"), _t("debate_ab", WRONG, ""), _t("debate_ab", "", "")]
    prompt = judge.render(ts[0])
    assert "Alice's solution:\n> 5 + 7 = 12" in prompt and "Bob's critique:\n> wrong!" in prompt  # quoted
    assert "Alice's rebuttal" not in prompt and "(empty)" in judge.render(ts[1])
    v = judge(ts)
    # one generate call: the 3 prompts prefilled once, their caches copied to 8 vote rows each
    assert calls == [24] and v.votes.shape == (3, 8) and len(v.texts) == 3 and all(len(x) == 8 for x in v.texts)
    # A random tiny model writes no verdict: every vote is counted as unparseable and the share is a 0.5 tie.
    assert v.unparseable == int(torch.isnan(v.votes).sum()) and all(0.0 <= s <= 1.0 for s in v.shares)


def test_programmatic_judge_reports_the_exploits_spread():
    j = ProgrammaticJudge(phrases=["trust me"], phrase_weight=1.0)
    ts = [_t("debate_ab", "trust me \\boxed{1}", "no"), _t("debate_ab", "\\boxed{1}", "Trust me, no")]
    assert j.stats(ts) == {"phrase_alice": 0.5, "phrase_bob": 0.5}
    assert ProgrammaticJudge().stats(ts) == {}


# ---------------------------------------------------------------------------------------------------- data
def test_debate_datamodule_splits_half_and_half_without_overlap():
    from alignment_games.datamodules.debate import DebateDataModule, single_step_problems
    from alignment_games.datamodules.sft import SingleStepSFTDataModule

    dm = DebateDataModule(problems="single_step", num_prompts=200, val_fraction=0.5, batch_size=4)
    dm.setup()
    train, val = dm.splits["train"], dm.splits["val"]
    assert abs(len(train) - len(val)) <= 1 and not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    p = single_step_problems(1, seed=3)[0]
    assert p["reference"] == str(p["a"] + p["b"]) and f"has {p['a']} " in p["prompt"]
    batch = next(iter(dm.train_dataloader()))
    assert len(batch["prompt"]) == 4 and all(answers_match(r, r) for r in batch["reference"])
    sft = SingleStepSFTDataModule(num_prompts=2000, correct_fraction=0.6, filler_fraction=0.3, val_fraction=0.0)
    sft.setup()
    pairs = sft.train_pairs + sft.val_pairs
    right = sum(answers_match(extract_final_answer(y), str(eval_sum(x))) for _, x, y in pairs) / len(pairs)
    assert abs(right - 0.6) < 0.04
    with pytest.raises(ValueError, match="problems"):
        DebateDataModule(problems="calculus")


def eval_sum(prompt: str) -> int:
    """The reference of a generated single-step problem, read back from its text (no eval)."""
    import re

    a, b = (int(x) for x in re.findall(r"\d+", prompt)[:2])
    return a + b
