"""The debate paper's ablations, pure parts, on hand values: Bob rewarded by ground truth (B-judge, B-convince), the
pairwise-preference judge (pairs, their order, shares, the programmatic judge's Bradley–Terry probability), the
step-by-step format, a judge that may declare a tie and a frozen critic."""

import math
import random
import re
from pathlib import Path

import pytest
import torch
import yaml

from alignment_games.modules.algorithms.debate import (
    BOB_REWARDS,
    PROMPTS,
    Transcript,
    bob_verdict,
    check_ablation,
    fill_fields,
    numbered_steps,
    ply_rewards,
    split_reply,
)
from alignment_games.modules.algorithms.verdicts import pair_indices, pair_shares, parse_verdict, vote_share
from alignment_games.modules.scorers.judges import DebateJudge, JudgeVotes, ProgrammaticJudge

PAPER_ABLATIONS = (
    "Ablations: pairwise-preference judging hacks faster; step-by-step format lowers the peak; ties allowed or a "
    "frozen API critic are no better than RLAIF-A; training only Bob with ground truth (B-judge, B-convince) is slow."
)
PAPER_CONSTANT_SUM = "Constant-sum: Alice's reward r = fraction of judge votes for Alice; Bob gets 1 − r."
# The zh digest's details (tests/data/paper_quotes.txt, section 其他消融与分析): "Step-by-step format (Figure 9): the
# visible solution is changed to numbered steps with a character limit"; "Other debate variants: preliminary experiments
# allowing ties or using a frozen API critic were close to or worse than RLAIF-A. The authors say training Bob together
# with Alice is necessary"; the pairwise run "reward hacks faster than a baseline matched in the number of judgments".
PAPER_STEPS = "分步格式（Figure 9）： 可见解答改为有字符上限的编号步骤。"
PAPER_VARIANTS = "其他辩论变体： 允许平局或使用冻结 API 批评者的初步实验，与 RLAIF-A 相近或更差。"
PAPER_VARIANTS += "作者称与 Alice 共同训练 Bob 是必要的。"
ROOT = Path(__file__).resolve().parents[3]
QUOTES_COPY = ROOT / "tests" / "data" / "paper_quotes.txt"
# each ablation the paper lists, the configs that run it (each header quotes the paper's clause)
ABLATION_CONFIGS = {
    "pairwise-preference judging hacks faster": ["debate_pairwise"],
    "step-by-step format lowers the peak": ["debate_steps"],
    "ties allowed or a frozen API critic are no better than RLAIF-A": ["debate_ties", "debate_frozen_critic"],
    "training only Bob with ground truth (B-judge, B-convince) is slow": ["debate_b_judge", "debate_b_convince"],
}


def test_the_ablations_are_the_papers_words():
    """The quotes are the digests' sentences as tests/data/paper_quotes.txt keeps them (checked against the papers by
    test_debate_rules.py wherever the papers are)."""
    copy = QUOTES_COPY.read_text(encoding="utf-8")
    assert f"debate-rlaif.en.md | Results (validation, merged groups, Table 1) | {PAPER_ABLATIONS}\n" in copy
    assert f"debate-rlaif.en.md | Rewards | {PAPER_CONSTANT_SUM}\n" in copy
    for quote in (PAPER_STEPS, PAPER_VARIANTS):
        assert f"debate-rlaif.zh.txt | 其他消融与分析 | {quote}\n" in copy


def test_every_ablation_the_paper_lists_has_a_config_quoting_it():
    """The paper's list, split at its semicolons, is covered clause by clause by the configs' header comments."""
    clauses = PAPER_ABLATIONS.removeprefix("Ablations: ").removesuffix(".").split("; ")
    assert clauses == list(ABLATION_CONFIGS)
    for clause, configs in ABLATION_CONFIGS.items():
        for name in configs:
            lines = (ROOT / "configs" / f"{name}.yaml").read_text(encoding="utf-8").splitlines()
            header = " ".join(" ".join(x.lstrip("# ") for x in lines if x.startswith("#")).split())
            assert clause in header, f"configs/{name}.yaml does not quote {clause!r}"


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


def test_replies_written_to_the_b_judge_prompt_score_by_the_rule():
    """Bob follows the prompt: its quoted verdict lines, each appended to a critique, are read and scored (hand)."""
    prompt = fill_fields(PROMPTS["bob_judge"], problem="What is 7 + 5?", solution="\\boxed{13}", word_limit=50)
    assert "\\boxed{13}" in prompt
    said_right, said_wrong = re.findall(r"ending with '([^']+)' if it is correct, otherwise '([^']+)'", prompt)[0]
    right, wrong = (_ab(f"7 + 5 = {x}, \\boxed{{{x}}}", "") for x in (12, 13))
    rewards = {}
    for name, alice in (("right", right), ("wrong", wrong)):
        for said in (said_right, said_wrong):
            alice.replies[1] = split_reply(f"I checked each step. {said}", required=False)
            rewards[name, said] = ply_rewards(alice, 0.5, bob_reward="b_judge")[1].reward
    # Alice right: "Verdict: Alice" is Bob's correct ruling (1); Alice wrong: "Verdict: Bob" is (1)
    assert rewards == {
        ("right", "Verdict: Alice"): 1.0,
        ("right", "Verdict: Bob"): 0.0,
        ("wrong", "Verdict: Alice"): 0.0,
        ("wrong", "Verdict: Bob"): 1.0,
    }


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
        (("rlaif_a", ["answer"], "verdict", "b_judge", 4), "b_judge, frozen_critic: False: rlaif_a has no critique"),
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


# --------------------------------------------------------------------------------- pairwise: order and judgments
def test_a_seeded_coin_orders_each_pair_and_the_shares_follow_the_order():
    fixed = pair_indices(500, 4)
    drawn = pair_indices(500, 4, random.Random(7))
    assert [tuple(sorted(p)) for p in drawn] == fixed  # the same pairs, each in one of its two orders
    flipped = sum(p != q for p, q in zip(drawn, fixed))
    assert 450 <= flipped <= 550  # Binomial(1000, 1/2): mean 500, sd 15.8
    assert drawn == pair_indices(500, 4, random.Random(7)) != pair_indices(500, 4, random.Random(8))
    # the share of the first shown goes to it, wherever it stands in the group: rollout 1 shown first, 6 of 7 for it
    assert pair_shares([6 / 7], [(1, 0)]) == pytest.approx([1 / 7, 6 / 7])


def test_the_pairwise_baseline_config_is_matched_in_judgments():
    """Judge calls a problem and a step: pairwise G/2 pairs × V votes; the verdict baseline G rollouts × V votes."""

    def settings(name):
        cfg = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text(encoding="utf-8"))
        model = cfg["model"]["init_args"]
        votes, group = model["judge"]["init_args"]["num_votes"], model["policy_gradient"]["group_size"]
        return model.get("judging", "verdict"), votes, group, cfg["data"]["init_args"]["batch_size"]

    judging, v, g, b = settings("debate_pairwise")
    assert judging == "pairwise" and (g // 2 * v, b * g // 2 * v) == (14, 56)  # 2 pairs × 7 votes, 4 problems
    judging, v, g, b = settings("debate_pairwise_baseline")
    assert judging == "verdict" and (g * v, b * g * v) == (14, 56)  # 2 rollouts × 7 votes, 4 problems
    assert v == 7  # every reward a share of 7 votes in both


# ------------------------------------------------------------------------------------ step-by-step format (Fig. 9)
STEPS = "1. 7 + 5 = 12\n2. So \\boxed{12}"  # 13 and 16 characters


@pytest.mark.parametrize(
    ("text", "cap", "ok"),
    [
        (STEPS, 16, True),
        (STEPS, 15, False),  # the second step is 16 characters long
        ("1) 7 + 5 = 12\n\n2) So \\boxed{12}", 16, True),  # blank lines between steps are no steps
        ("7 + 5 = 12, so \\boxed{12}", 100, False),  # not numbered
        ("1. 7 + 5 = 12\n3. So \\boxed{12}", 100, False),  # numbered out of order
        ("1. 7 + 5 = 12\nSo \\boxed{12}", 100, False),  # a line that is no step
        ("1.7 + 5 = 12", 100, False),  # no space after the number: "1.7" is a decimal
        ("", 100, False),
    ],
)
def test_numbered_steps_on_hand_cases(text, cap, ok):
    assert numbered_steps(text, cap) is ok


def test_step_format_rule_costs_alice_the_format_reward_only():
    """PAPER_STEPS: numbered steps with a character cap; any other visible answer is an invalid format (−1, the paper's
    format rule), Bob keeps 1 − r minus his penalty. Judge share 0.75, word limit 5."""
    free = _ab("7 + 5 = 12, so \\boxed{12}", "one two three four five six seven")  # Bob: 2 words over, 0.02

    def rewards(t, cap):
        return [x.reward for x in ply_rewards(t, 0.75, word_limit=5, step_chars=cap)]

    assert rewards(free, None) == pytest.approx([0.75, 0.23])  # the free format: no step rule
    assert rewards(free, 100) == pytest.approx([-1.0, 0.23])
    steps = _ab(STEPS, "one two three four five six seven")
    assert rewards(steps, 16) == pytest.approx([0.75, 0.23])
    assert rewards(steps, 15) == pytest.approx([-1.0, 0.23])
    replies = [split_reply(x, required=False) for x in (STEPS, "ok", "free text")]
    rebuttal = Transcript("q", "12", "debate_aba", replies)
    assert rewards(rebuttal, 16) == pytest.approx([0.75, 0.25, 0.75])  # the rule binds the answer, not the rebuttal


# ----------------------------------------------------------------------------------------------------- ties
def test_a_tie_is_read_only_when_ties_are_allowed():
    """PAPER_VARIANTS: "allowing ties". A tie vote is half a vote for each side."""
    for text in ("Verdict: Tie", "**Verdict:** tie.", "Tie"):
        assert (parse_verdict(text, ties=True), parse_verdict(text)) == (0.5, None)
    assert parse_verdict("Verdict: Alice\nVerdict: Tie", ties=True) == 0.5  # the last verdict counts
    assert parse_verdict("Verdict: Tie\nVerdict: Bob", ties=True) == 0.0
    for text in ("Verdict: not a tie", "Verdict: tie, Alice is right", "Verdict: tied game"):
        assert parse_verdict(text, ties=True) is None


def test_tie_votes_give_half_a_vote_to_each_side_of_the_constant_sum():
    # 8 votes: 5 for Alice, 2 ties, 1 for Bob: r = (5 + 2 · 0.5) / 8 = 0.75; Bob 1 − r = 0.25
    share, unparsed = vote_share([1.0] * 5 + [0.5, 0.5, 0.0])
    assert (share, unparsed) == (0.75, 0)
    a, b = ply_rewards(_ab("\\boxed{12}", "fine"), share)
    assert (a.reward, b.reward) == (0.75, 0.25)


def test_the_programmatic_judge_ties_by_rao_and_kupper():
    """Alice right, skill 1.5: z = 1.5; θ = 0.5: Alice σ(1.0) = 0.731059, Bob σ(−2.0) = 0.119203, tie 0.149738."""
    right = _ab("\\boxed{12}", "")
    u = torch.rand((1, 4000), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    hand = torch.where(u < 0.731059, 1.0, torch.where(u < 1 - 0.119203, 0.5, 0.0)).float()
    votes = ProgrammaticJudge(skill=1.5, tie_margin=0.5, num_votes=4000, seed=3).vote([right]).votes
    assert torch.equal(votes, hand)
    assert [float((votes == x).float().mean()) for x in (1.0, 0.5, 0.0)] == pytest.approx(
        [0.731059, 0.149738, 0.119203], abs=0.025
    )
    # θ = 0 (the default): no ties, the same draws as before the rule: 1 where u < σ(1.5) = 0.817574
    plain = ProgrammaticJudge(skill=1.5, num_votes=4000, seed=3).vote([right]).votes
    assert torch.equal(plain, (u < 0.817574).float())
    with pytest.raises(ValueError, match="tie_margin must be at least 0.0, got -0.1"):
        ProgrammaticJudge(tie_margin=-0.1)


class _Halves(DebateJudge):
    def __call__(self, transcripts):
        return JudgeVotes(torch.full((len(transcripts), self.num_votes), 0.5), [[] for _ in transcripts])


def test_a_tie_vote_counts_only_from_a_judge_that_may_tie():
    t = BATCH[0][0]
    refused = _Halves(num_votes=3).vote([t])  # a judge without ties: 0.5 is no vote (NaN, counted invalid)
    assert torch.isnan(refused.votes).all() and refused.invalid == 3
    allowed = _Halves(num_votes=3)
    allowed.ties = True
    out = allowed.vote([t])
    assert out.votes.tolist() == [[0.5] * 3] and out.invalid == 0 and out.verdicts == ["tie"]


# ------------------------------------------------------------------------------------------------ frozen critic
def test_a_frozen_critic_is_accepted_only_where_bob_plays_and_alice_alone_trains():
    """PAPER_VARIANTS: "a frozen API critic": Bob is the frozen reference, Alice's plies the trained ones."""
    check_ablation("debate_ab", ["answer"], "verdict", "constant_sum", 4, frozen_critic=True)
    check_ablation("debate_aba", ["answer", "rebuttal"], "verdict", "constant_sum", 4, frozen_critic=True)
    for args in (
        ("debate_ab", ["answer", "critique"], "verdict", "constant_sum"),  # Bob would train
        ("debate_ab", ["critique"], "verdict", "b_judge"),  # B-judge trains Bob
    ):
        with pytest.raises(ValueError, match="frozen_critic: Bob is the frozen reference"):
            check_ablation(*args, 4, frozen_critic=True)
    with pytest.raises(ValueError, match="frozen_critic: True: rlaif_a has no critique"):  # no Bob
        check_ablation("rlaif_a", ["answer"], "verdict", "constant_sum", 4, frozen_critic=True)
