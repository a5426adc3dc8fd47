"""Pure functions of the multi-LLM pool (modules/algorithms/pool.py): matching, judging, aggregation, pairs."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from alignment_games.modules.algorithms.pool import (
    DEFAULT_SCORE,
    Matchmaking,
    ReputationWeighting,
    aggregate_duel,
    agreement_score,
    duel_judges,
    fill_judge_template,
    judge_verdicts,
    normalized_reputations,
    parse_judgement,
    peer_score_advantages,
    preference_pairs,
    reference_agreement,
    reputation_weighted_mean,
    weight_extremes,
)

MATCH = Matchmaking()  # the paper's: 3 candidates, uniform share 0.2; our kernel width 0.25


def test_normalized_reputations():
    assert normalized_reputations([1000, 1100, 1200]) == pytest.approx([0.0, 0.5, 1.0])
    assert normalized_reputations([1000, 1000, 1000]) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        normalized_reputations([1000, float("nan")])


def test_opponent_distribution_hand_computed_three_models():
    # normalised [0, 0.5, 1]; target gap 1, bandwidth 0.25: a_1 = exp(−0.25/0.125) = e^−2 = 0.1353353, a_2 = 1.
    # m = 3: both others are the candidates; P_j = 0.2/2 + 0.8·a_j/(a_1 + a_2).
    aff = MATCH.affinities([1000, 1100, 1200], 0, target_gap=1.0)
    assert aff == pytest.approx([0.0, math.exp(-2), 1.0])
    p = MATCH.distribution([1000, 1100, 1200], 0, target_gap=1.0)
    share = math.exp(-2) / (1 + math.exp(-2))
    assert p == pytest.approx([0.0, 0.1 + 0.8 * share, 0.1 + 0.8 * (1 - share)])
    # target gap 0 (late training): the near peer is preferred
    late = MATCH.distribution([1000, 1100, 1200], 0, target_gap=0.0)
    assert late[1] > late[2]


def test_opponent_distribution_with_candidate_sets_hand_computed():
    # m = 5, c = 3 candidates out of 4 others (4 sets, each leaving one out); equal affinities but for player 4.
    # Ratings [0, 0, 0, 0, 1] normalised the same; player 0, target 1: a_1 = a_2 = a_3 = e^−8, a_4 = 1.
    ratings = [0.0, 0.0, 0.0, 0.0, 1.0]
    a = math.exp(-8)
    sets_with_4 = 3  # of the 4 sets, 3 contain player 4: {1,2,4}, {1,3,4}, {2,3,4}; {1,2,3} does not
    p4 = 0.2 / 4 + 0.8 * sets_with_4 / 4 * (1 / (1 + 2 * a))
    p1 = 0.2 / 4 + 0.8 / 4 * (2 * a / (1 + 2 * a) + 1 / 3)  # in 2 sets with 4, and in {1,2,3}
    p = MATCH.distribution(ratings, 0, target_gap=1.0)
    assert p[0] == 0.0 and sum(p) == pytest.approx(1.0)
    assert p[4] == pytest.approx(p4) and p[1] == pytest.approx(p1) and p[2] == pytest.approx(p1)


def test_sampler_matches_the_exact_marginal():
    ratings = [1000.0, 1040.0, 1130.0, 1210.0, 1300.0]
    exact = MATCH.distribution(ratings, 2, target_gap=0.7)
    g = torch.Generator().manual_seed(0)
    n = 8000
    counts = [0] * 5
    for _ in range(n):
        counts[MATCH.sample(ratings, 2, 0.7, g)] += 1
    assert counts[2] == 0
    assert [c / n for c in counts] == pytest.approx(exact, abs=0.02)


def test_selection_weights_uniform_for_equal_reputations():
    assert MATCH.selection_weights([1000.0] * 4, target_gap=1.0) == pytest.approx([0.25] * 4)
    w = MATCH.selection_weights([900.0, 1000.0, 1100.0], target_gap=1.0)
    assert sum(w) == pytest.approx(1.0) and w[1] < 1 / 3  # the middle one is never a gap-1 opponent


def test_matching_needs_two_members():
    with pytest.raises(ValueError, match="at least two"):
        MATCH.distribution([1000.0], 0, 1.0)


@pytest.mark.parametrize(
    ("text", "score", "method"),
    [
        ('{"score": 7}', 7.0, "json"),
        ('Here is my verdict: {"reasoning": "clear", "score": 8.5} thanks', 8.5, "json"),
        ('{"Score": "6"}', 6.0, "json"),
        ('{"score": 7', 7.0, "regex"),  # unclosed object (e.g. cut by max_new_tokens)
        ("Score: 9", 9.0, "regex"),
        ("I would rate it 4/10.", 4.0, "regex"),
        ("rating is 3 out of 10", 3.0, "regex"),
        ('{"score": 42}', DEFAULT_SCORE, "failed"),  # out of the 1–10 range
        ('{"score": true}', DEFAULT_SCORE, "failed"),
        ('{"score": 1e999}', DEFAULT_SCORE, "failed"),  # not read as 1
        ("a fine answer, well argued", DEFAULT_SCORE, "failed"),
        ("", DEFAULT_SCORE, "failed"),
        (None, DEFAULT_SCORE, "failed"),
        ("ÿ\x00{{}} 12345", DEFAULT_SCORE, "failed"),
    ],
)
def test_parse_judgement(text, score, method):
    out = parse_judgement(text)
    assert (out.score, out.method) == (score, method)
    assert out.ok == (method != "failed")


def test_reputation_weighted_mean():
    assert reputation_weighted_mean([8.0, 4.0], [1200.0, 800.0]) == pytest.approx(6.4)  # (9600 + 3200)/2000
    assert reputation_weighted_mean([8.0, 4.0], [0.0, 0.0]) == pytest.approx(6.0)  # documented: equal weights
    # a weight that rounds 10·w/w above 10: the mean stays on the scale (the leader's reward refuses 10.000000000000002)
    assert 10.0 * 960.6625452157855 / 960.6625452157855 > 10.0
    assert reputation_weighted_mean([10.0], [960.6625452157855]) == 10.0
    for scores, weights in [([], []), ([5.0], [1.0, 2.0]), ([5.0], [-1.0]), ([float("nan")], [1.0])]:
        with pytest.raises(ValueError):
            reputation_weighted_mean(scores, weights)


def test_reputation_weighting_raw_is_the_paper_rule_and_elo_odds_gives_reputation_an_effect():
    """Three judges rated 1000, 1050 and 950 (tens apart, as Elo ratings are) score 4, 8, 6."""
    ratings, scores = [1000.0, 1050.0, 950.0], [4.0, 8.0, 6.0]
    raw = ReputationWeighting().weights(ratings)
    assert ReputationWeighting().rule == "raw" and raw == [1000.0, 1050.0, 950.0]  # App. G: the ratings themselves
    assert ReputationWeighting().weights([-20.0, 5.0]) == [0.0, 5.0]  # floored at 0
    # raw: (4000 + 8400 + 5700) / 3000 = 6.0333, barely off the plain mean 6.0
    assert reputation_weighted_mean(scores, raw) == pytest.approx(6.0333333, abs=1e-6)
    odds = ReputationWeighting("elo_odds").weights(ratings)
    # 10^(0/400), 10^(50/400), 10^(-50/400) = 1, 1.3335214, 0.7498942, over their sum 3.0834156
    assert odds == pytest.approx([0.3243157, 0.4324819, 0.2432024], abs=1e-7)
    # the same weights as a softmax of (R - mean) ln 10 / 400, by numpy
    logits = (np.array(ratings) - np.mean(ratings)) * np.log(10.0) / 400.0
    assert odds == pytest.approx((np.exp(logits) / np.exp(logits).sum()).tolist(), abs=1e-12)
    # 0.3243157 * 4 + 0.4324819 * 8 + 0.2432024 * 6: the best-rated judge's 8 pulls the score up
    assert reputation_weighted_mean(scores, odds) == pytest.approx(6.2163325, abs=1e-6)
    shifted = ReputationWeighting("elo_odds").weights([x + 500.0 for x in ratings])
    assert shifted == pytest.approx(odds, abs=1e-12)  # the starting rating plays no part
    assert ReputationWeighting("elo_odds", scale=100.0).weights([1100.0, 1000.0]) == pytest.approx([10 / 11, 1 / 11])
    # the whole duel: judges' verdicts and per-response scores follow the same weights
    per_rollout, verdicts = aggregate_duel([[[4.0, 8.0, 6.0]], [[6.0, 6.0, 6.0]]], odds)
    assert per_rollout == [[pytest.approx(6.2163325, abs=1e-6)], [pytest.approx(6.0)]] and verdicts == [0.0, 1.0, 0.5]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"rule": "softmax"}, "reputation.rule"), ({"scale": 0.0}, "reputation.scale"), ({"scale": math.inf}, "scale")],
)
def test_reputation_weighting_refuses_bad_settings_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReputationWeighting(**kwargs)
    with pytest.raises(ValueError, match="finite"):
        ReputationWeighting().weights([1000.0, float("nan")])


def test_verdicts_and_pairs():
    assert judge_verdicts([7, 5, 6], [5, 5, 8]) == [1.0, 0.5, 0.0]
    assert preference_pairs([7.0, 5.0, 6.0], [5.0, 5.0, 8.0]) == [(0, True), (2, False)]


def test_match_duels_draws_a_uniform_combatant_then_its_opponent():
    ratings = [1000.0, 1100.0, 1200.0, 1300.0]
    two = Matchmaking(num_candidates=2)
    duels = two.duels(ratings, 6, 0.5, torch.Generator().manual_seed(3))
    replay, g = [], torch.Generator().manual_seed(3)  # the same draws, one duel at a time
    for _ in range(6):
        a = int(torch.randint(4, (), generator=g))
        replay.append((a, two.sample(ratings, a, 0.5, g)))
    assert duels == replay and all(a != b for a, b in duels)
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    assert two.duels([1000.0], 3, 1.0, g) == [(0, 0)] * 3 and torch.equal(g.get_state(), state)  # draws nothing


def test_duel_judges_are_the_members_outside_the_duel():
    assert duel_judges([(0, 1), (2, 0)], 4) == [[2, 3], [1, 3]]
    assert duel_judges([(0, 0)], 1) == [[0]]  # a pool of one judges itself


def test_aggregate_duel_hand_computed():
    # two judges (weights 3 and 1), two rollouts per side; table[side][rollout][judge]
    table = [[[8.0, 4.0], [6.0, 2.0]], [[5.0, 9.0], [5.0, 5.0]]]
    per_rollout, verdicts = aggregate_duel(table, [3.0, 1.0])
    assert per_rollout == [[7.0, 5.0], [6.0, 5.0]]  # (3·8 + 4)/4, (3·6 + 2)/4; (15 + 9)/4, 5
    assert verdicts == [1.0, 0.0]  # judge 0: a 7 vs b 5; judge 1: a 3 vs b 7


def test_judge_template_is_filled_once():
    assert fill_judge_template("Q: {prompt} A: {response}", "{response}?", "x") == "Q: {response}? A: x"


def test_peer_score_advantages():
    # two prompts × 4 rollouts; group 1 = [2, 4, 6, 8]: mean 5, unbiased std sqrt(20/3) = 2.5819889
    adv = peer_score_advantages(torch.tensor([2.0, 4.0, 6.0, 8.0, 5.0, 5.0, 5.0, 5.0]), group_size=4)
    std = math.sqrt(20 / 3) + 1e-4
    assert adv[:4].tolist() == pytest.approx([-3 / std, -1 / std, 1 / std, 3 / std], rel=1e-5)
    assert adv[4:].tolist() == [0.0] * 4  # equal peer scores: no signal
    with pytest.raises(ValueError, match="finite"):
        peer_score_advantages(torch.tensor([1.0, float("nan")]), group_size=2)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=300) | st.sampled_from(['{"score": 1e999}', '{"score": NaN}', "score: -3", "10/10"]))
def test_parse_judgement_never_crashes_and_stays_on_the_scale(text):
    out = parse_judgement(text)
    assert 1.0 <= out.score <= 10.0 and out.method in ("json", "regex", "failed")
    assert out.ok or out.score == DEFAULT_SCORE


def test_agreement_score_hand_computed():
    # 1 + 9 x the share of the judge's answers the response matches (answers compared as numbers)
    assert agreement_score("12", ["12", "12.0", "7", None]) == (1.0 + 9.0 * 2 / 4, True)
    assert agreement_score("12", ["12"]) == (10.0, True)  # one greedy solution: 10 or 1
    assert agreement_score("5", ["12"]) == (1.0, True)
    assert agreement_score(None, ["12", "5"]) == (1.0, True)  # no answer in the response: the bottom
    assert agreement_score("12", [None, None]) == (DEFAULT_SCORE, False)  # the judge found no answer: not read
    with pytest.raises(ValueError, match="at least one of the judge's answers"):
        agreement_score("12", [])


def test_weight_extremes_against_uniform():
    probs = [0.4, 0.2, 0.2, 0.1, 0.1]  # K = 5, n capped at 2
    top, bottom = weight_extremes(probs, n=5)
    assert top == pytest.approx((0.4 + 0.2) / 2 * 5) and bottom == pytest.approx((0.1 + 0.1) / 2 * 5)
    assert weight_extremes([0.25] * 4) == pytest.approx((1.0, 1.0))  # uniform: both 1
    assert weight_extremes([1.0]) == pytest.approx((1.0, 1.0))
    with pytest.raises(ValueError, match="n >= 1"):
        weight_extremes([0.5, 0.5], n=0)


def test_reference_agreement_is_the_per_duel_auc_pooled_by_pairs() -> None:
    from sklearn.metrics import roc_auc_score

    scores = [[7.0, 3.0], [2.0, 5.0, 5.0, 9.0], [4.0, 4.0], [1.0, 1.0]]
    right = [[True, False], [True, False, True, False], [True, False], [True, True]]
    share, pairs = reference_agreement(scores, right)
    # duel 0: 1 pair ranked right; duel 1: 4 pairs, AUC by sklearn; duel 2: 1 tie; duel 3: no (right, wrong) pair
    auc1 = roc_auc_score(right[1], scores[1])
    assert pairs == 6
    assert share == pytest.approx((1.0 + 4 * auc1 + 0.5) / 6)
    assert auc1 == pytest.approx(0.5 / 4)  # by hand: right 2 and 5 against wrong 5 and 9: only 5 = 5 (a tie) counts
    assert math.isnan(reference_agreement([[1.0, 2.0]], [[False, False]])[0])
    with pytest.raises(ValueError):
        reference_agreement([[1.0]], [])
