"""The debate paper's ablations, pure parts, on hand values: Bob rewarded by ground truth (B-judge, B-convince) and
the pairwise-preference judge (pairs, shares, the programmatic judge's Bradley–Terry probability)."""

import math
from pathlib import Path

import pytest
import torch

from alignment_games.modules.algorithms.debate import (
    BOB_REWARDS,
    PROMPTS,
    Transcript,
    bob_verdict,
    check_ablation,
    ply_rewards,
    split_reply,
)
from alignment_games.modules.algorithms.verdicts import pair_indices, pair_shares
from alignment_games.modules.scorers.judges import DebateJudge, JudgeVotes, ProgrammaticJudge

PAPER_ABLATIONS = (
    "Ablations: pairwise-preference judging hacks faster; step-by-step format lowers the peak; ties allowed or a "
    "frozen API critic are no better than RLAIF-A; training only Bob with ground truth (B-judge, B-convince) is slow."
)
PAPER_CONSTANT_SUM = "Constant-sum: Alice's reward r = fraction of judge votes for Alice; Bob gets 1 − r."
QUOTES_COPY = Path(__file__).resolve().parents[2] / "data" / "paper_quotes.txt"


def test_the_ablations_are_the_papers_words():
    """The quotes are the digest's sentences as tests/data/paper_quotes.txt keeps them (checked against the paper by
    test_debate_rules.py wherever the papers are); the options' docstrings quote their phrases."""
    copy = QUOTES_COPY.read_text(encoding="utf-8")
    assert f"debate-rlaif.en.md | Results (validation, merged groups, Table 1) | {PAPER_ABLATIONS}\n" in copy
    assert f"debate-rlaif.en.md | Rewards | {PAPER_CONSTANT_SUM}\n" in copy
    assert "pairwise-preference judging" in PAPER_ABLATIONS and "(B-judge, B-convince)" in PAPER_ABLATIONS


def _ab(answer: str, critique: str, reference: str | None = "12") -> Transcript:
    replies = [split_reply(answer, required=False), split_reply(critique, required=False)]
    return Transcript("What is 7 + 5?", reference, "debate_ab", replies)


# A hand-made batch of four Debate-AB games, Alice's share r of the judge's votes each, reference 12:
# 0: Alice right (12), Bob's critique says she is right, judge gives her 6/8;
# 1: Alice wrong (13), Bob says she is wrong, judge gives her 6/8 (fooled);
# 2: Alice wrong (13), Bob says she is right (a wrong ruling), judge gives her 2/8;
# 3: Alice right, Bob writes no verdict, 13 words over a limit of 5 (penalty 0.08), judge gives her 5/8.
BATCH = [
    (_ab("7 + 5 = 12, \\boxed{12}", "Checked. Verdict: Alice"), 0.75),
    (_ab("7 + 5 = 13, \\boxed{13}", "It is 12. Verdict: Bob"), 0.75),
    (_ab("7 + 5 = 13, \\boxed{13}", "Looks fine. Verdict: Alice"), 0.25),
    (_ab("\\boxed{12}", "one two three four five six seven eight nine ten eleven twelve thirteen"), 0.625),
]


def _bob(bob_reward: str) -> list[float]:
    """Bob's reward (the critique ply's) on each game of the batch, word limit 5, 0.01 per word over."""
    return [ply_rewards(t, r, word_limit=5, bob_reward=bob_reward)[1].reward for t, r in BATCH]


def test_bob_constant_sum_reward_is_one_minus_alice_share_on_the_hand_batch():
    assert _bob("constant_sum") == pytest.approx([0.25, 0.25, 0.75, 0.375 - 0.08])


def test_bob_b_judge_reward_scores_his_own_verdict_against_the_reference_on_the_hand_batch():
    # right, right, wrong ruling, no ruling (0) minus his word penalty; the judge's votes do not enter
    assert _bob("b_judge") == pytest.approx([1.0, 1.0, 0.0, -0.08])


def test_bob_b_convince_reward_is_the_judges_share_for_the_true_verdict_on_the_hand_batch():
    # Alice right: r; Alice wrong: 1 − r (the judge convinced she is wrong)
    assert _bob("b_convince") == pytest.approx([0.75, 0.25, 0.75, 0.625 - 0.08])


def test_alice_reward_is_unchanged_by_bobs_reward_rule():
    for rule in BOB_REWARDS:
        assert [ply_rewards(t, r, word_limit=5, bob_reward=rule)[0].reward for t, r in BATCH] == [
            0.75,
            0.75,
            0.25,
            0.625,
        ]


def test_ground_truth_rewards_without_a_reference_are_zero():
    t = _ab("\\boxed{12}", "Verdict: Alice", reference=None)
    assert [bob_verdict(t, 0.75, rule) for rule in BOB_REWARDS] == [0.25, 0.0, 0.0]


def test_bob_rewards_format_override_still_applies():
    bad = _ab("\\boxed{12}", "</think> Verdict: Alice")  # a stray closing delimiter: invalid thinking format
    assert ply_rewards(bad, 0.75, bob_reward="b_judge")[1].reward == -1.0


def test_an_unknown_bob_reward_is_refused_by_name():
    t, r = BATCH[0]
    for call in (lambda: ply_rewards(t, r, bob_reward="judge"), lambda: bob_verdict(t, r, "b-judge")):
        with pytest.raises(ValueError, match=r"bob_reward must be one of \('constant_sum', 'b_judge', 'b_convince'\)"):
            call()


def test_the_b_judge_prompt_asks_for_a_verdict_the_rule_reads():
    assert "'Verdict: Alice'" in PROMPTS["bob_judge"] and "{solution}" in PROMPTS["bob_judge"]


# ------------------------------------------------------------------------------------------------------- pairwise
def test_pairs_are_neighbouring_branches_of_each_group():
    assert pair_indices(2, 4) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert pair_indices(1, 2) == [(0, 1)]
    for odd in (1, 3):
        with pytest.raises(ValueError, match=f"group_size must be even, got {odd}"):
            pair_indices(2, odd)


def test_pair_shares_split_each_comparison():
    # 6 of 7 votes prefer rollout 0 to 1 (the paper's 7 votes); 1 of 1 prefers 3 to 2 ("the chosen one gets 1")
    assert pair_shares([6 / 7, 0.0], [(0, 1), (2, 3)]) == pytest.approx([6 / 7, 1 / 7, 0.0, 1.0])
    with pytest.raises(ValueError, match="1 pairwise shares for 2 pairs"):
        pair_shares([0.5], [(0, 1), (2, 3)])


def test_pairwise_judge_probability_on_a_hand_case():
    """Bradley–Terry on the verdict judge's scores: P(y ≻ y' | x) = sigmoid(z(y) − z(y'))."""
    j = ProgrammaticJudge(skill=1.5, length_weight=2.0)
    right = Transcript("7 + 5?", "12", "rlaif_a", [split_reply("7 + 5 = 12 \\boxed{12}", required=False)])  # 6 words
    wrong = Transcript("7 + 5?", "12", "rlaif_a", [split_reply("\\boxed{13}", required=False)])  # 1 word
    # z(right) = 1.5 + 2·6/100 = 1.62, z(wrong) = −1.5 + 2·1/100 = −1.48: sigmoid(3.10)
    assert j.probability(right, wrong) == pytest.approx(1 / (1 + math.exp(-3.10)))
    assert j.probability(wrong, right) == pytest.approx(1 / (1 + math.exp(3.10)))
    assert j.probability(right, right) == 0.5
    # a long wrong answer beats a short right one once the length bias outweighs the skill: 2·(161 − 6)/100 > 3
    long_wrong = Transcript("7 + 5?", "12", "rlaif_a", [split_reply("so " * 160 + "\\boxed{13}", required=False)])
    assert j.probability(long_wrong, right) == pytest.approx(1 / (1 + math.exp(-(-3.0 + 2.0 * 155 / 100))))


def test_pairwise_votes_follow_the_probability_and_shape():
    j = ProgrammaticJudge(skill=30.0, num_votes=7)  # near-certain: the right answer wins every vote
    right = Transcript("7 + 5?", "12", "rlaif_a", [split_reply("\\boxed{12}", required=False)])
    wrong = Transcript("7 + 5?", "12", "rlaif_a", [split_reply("\\boxed{13}", required=False)])
    votes = j.vote([right, wrong], against=[wrong, right])
    assert votes.votes.tolist() == [[1.0] * 7, [0.0] * 7]
    with pytest.raises(ValueError, match="cannot compare 2 answers with 1 others"):
        j.vote([right, wrong], against=[wrong])


class _VerdictOnly(DebateJudge):
    def __call__(self, transcripts):
        return JudgeVotes(torch.ones((len(transcripts), self.num_votes)), [[] for _ in transcripts])


def test_a_judge_that_does_not_compare_refuses_pairs():
    t = BATCH[0][0]
    with pytest.raises(ValueError, match="_VerdictOnly cannot compare 1 answers with 1 others"):
        _VerdictOnly(num_votes=2).vote([t], against=[t])


# ------------------------------------------------------------------------------------------------- settings
@pytest.mark.parametrize(
    "args, message",
    [
        (("rlaif_a", ["answer"], "pairs", "constant_sum", 4), r"judging must be one of \('verdict', 'pairwise'\)"),
        (("debate_ab", ["answer"], "verdict", "judge", 4), "bob_reward must be one of"),
        (("debate_ab", ["answer", "critique"], "pairwise", "constant_sum", 4), "protocol must be rlaif_a"),
        (("rlaif_a", ["answer"], "pairwise", "constant_sum", 3), "group_size must be even, got 3"),
        (("rlaif_a", ["answer"], "verdict", "b_judge", 4), "protocol rlaif_a has no critique"),
        (("debate_ab", ["answer", "critique"], "verdict", "b_convince", 4), r"trainable_plies must be \['critique'\]"),
    ],
)
def test_ablation_settings_that_are_not_the_papers_are_refused_by_name(args, message):
    with pytest.raises(ValueError, match=message):
        check_ablation(*args)


def test_the_papers_ablation_settings_are_accepted():
    check_ablation("rlaif_a", ["answer"], "pairwise", "constant_sum", 4)
    for rule in ("b_judge", "b_convince"):
        check_ablation("debate_ab", ["critique"], "verdict", rule, 4)
        check_ablation("debate_aba", ["critique"], "verdict", rule, 3)
