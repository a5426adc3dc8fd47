"""EXP3 leader and its composite reward against hand-computed numbers (modules/algorithms/exp3.py)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from alignment_games.modules import Exp3
from alignment_games.modules.algorithms.exp3 import (
    CompositeReward,
    difficulty_reward,
    linear_schedule,
    preference_reward,
)


def test_initial_probabilities_are_uniform():
    assert torch.allclose(Exp3(4, gamma=0.2).probabilities(), torch.full((4,), 0.25, dtype=torch.float64))


def test_update_matches_hand_computed_values():
    # K=4, γ=0.2: η = γ/K = 0.05; p = 0.25 each. Duels on arms 0, 0, 2 with rewards 1.0, 0.5, 0.8:
    # estimate_0 = (1.0 + 0.5)/0.25 = 6, estimate_2 = 0.8/0.25 = 3.2 → log w = [0.3, 0, 0.16, 0].
    # softmax: e^0.3 = 1.3498588, e^0.16 = 1.1735109, sum 4.5233697;
    # p_0 = 0.8·1.3498588/4.5233697 + 0.05 = 0.2887354, p_1 = p_3 = 0.8/4.5233697 + 0.05 = 0.2268589,
    # p_2 = 0.8·1.1735109/4.5233697 + 0.05 = 0.2575468.
    bandit = Exp3(4, gamma=0.2)
    est = bandit.estimates([0, 0, 2], [1.0, 0.5, 0.8])
    assert est.tolist() == pytest.approx([6.0, 0.0, 3.2, 0.0])
    bandit.update([0, 0, 2], [1.0, 0.5, 0.8])
    expected = [0.2887354, 0.2268589, 0.2575468, 0.2268589]
    assert bandit.probabilities().tolist() == pytest.approx(expected, abs=1e-6)
    assert bandit.rounds == 3
    # the next update is importance-weighted by the *new* probabilities: 1/0.2268589 · 0.05 added to log w_1
    before = bandit.log_weights.clone()
    bandit.update([1], [1.0])
    # log-weights are kept up to a common shift: the change, relative to arm 0's, is 0.05 / 0.2268589 = 0.2204013 on
    # arm 1 and exactly nothing elsewhere
    step = (bandit.log_weights - before) - (bandit.log_weights[0] - before[0])
    assert step.tolist() == pytest.approx([0.0, 0.2204013, 0.0, 0.0], abs=1e-6)
    # log w = [0.3, 0.2204013, 0.16, 0]: e^x = 1.3498588, 1.2465769, 1.1735109, 1 (sum 4.7699466);
    # p_i = 0.8 e^x_i / 4.7699466 + 0.05
    assert bandit.probabilities().tolist() == pytest.approx([0.2763939, 0.2590718, 0.2468174, 0.2177168], abs=1e-6)
    assert bandit.rounds == 4


def test_zero_rewards_leave_probabilities_unchanged():
    bandit = Exp3(5, gamma=0.2)
    bandit.update([0, 1, 1, 4], [0.0, 0.0, 0.0, 0.0])
    assert torch.allclose(bandit.probabilities(), torch.full((5,), 0.2, dtype=torch.float64))


def test_floor_holds_however_lopsided_the_rewards():
    bandit = Exp3(4, gamma=0.2)
    for _ in range(200):
        bandit.update([0] * 16, [1.0] * 16)
    p = bandit.probabilities()
    assert torch.isfinite(bandit.log_weights).all()
    assert float(p[1:].min()) >= 0.05 - 1e-12  # γ/K
    assert float(p[0]) == pytest.approx(1 - 3 * 0.05, abs=1e-9)
    assert float(p.sum()) == pytest.approx(1.0)


def test_sampling_follows_probabilities_and_generator():
    bandit = Exp3(3, gamma=0.5)
    bandit.log_weights = torch.tensor([math.log(6.0), math.log(3.0), 0.0], dtype=torch.float64)
    # p = 0.5·[0.6, 0.3, 0.1] + 1/6 = [0.4667, 0.3167, 0.2167]
    draws = bandit.sample(30000, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=3).double() / 30000
    assert freq.tolist() == pytest.approx([0.3 + 1 / 6, 0.15 + 1 / 6, 0.05 + 1 / 6], abs=0.01)
    a = bandit.sample(10, torch.Generator().manual_seed(3))
    b = bandit.sample(10, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_state_dict_round_trip_and_refusal():
    bandit = Exp3(4, gamma=0.2)
    bandit.update([1, 3], [0.9, 0.2])
    other = Exp3(4, gamma=0.2)
    other.load_state_dict(bandit.state_dict())
    assert torch.equal(other.probabilities(), bandit.probabilities()) and other.rounds == 2
    with pytest.raises(ValueError, match="K=4"):
        Exp3(5, gamma=0.2).load_state_dict(bandit.state_dict())


@pytest.mark.parametrize(
    ("indices", "rewards", "match"),
    [
        ([0, 1], [0.5], "differ in length"),
        ([4], [0.5], r"in \[0, 4\)"),
        ([0], [1.5], "rewards must be in"),
        ([0], [float("nan")], "rewards must be in"),
    ],
)
def test_bad_updates_raise(indices, rewards, match):
    with pytest.raises(ValueError, match=match):
        Exp3(4).update(indices, rewards)


@pytest.mark.parametrize(("k", "gamma"), [(0, 0.2), (3, 0.0), (3, 1.5)])
def test_bad_construction_raises(k, gamma):
    with pytest.raises(ValueError):
        Exp3(k, gamma=gamma)


def test_linear_schedule():
    assert linear_schedule(0.6, 0.15, 0.0) == 0.6
    assert linear_schedule(0.6, 0.15, 0.5) == pytest.approx(0.375)
    assert linear_schedule(0.6, 0.15, 2.0) == pytest.approx(0.15)  # clipped
    assert linear_schedule(1.0, 0.0, 0.25) == pytest.approx(0.75)


def test_difficulty_reward():
    assert difficulty_reward(8.0, 6.0) == pytest.approx(1 / 3)  # (10 − 7)/9
    assert difficulty_reward(3.0, 1.0) == pytest.approx(8 / 9)  # best response exactly at the threshold counts
    assert difficulty_reward(2.0, 2.9) == 0.0  # every response below 3.0: penalised
    assert difficulty_reward(10.0, 10.0) == 0.0  # solved by everyone: nothing left to learn
    with pytest.raises(ValueError, match="score_b"):
        difficulty_reward(5.0, 11.0)


def test_preference_reward():
    assert preference_reward(7.4, 2.0, ideal_gap=0.6) == pytest.approx(1.0)  # gap 5.4/9 = 0.6
    # gap 1.0, ideal 0.6: exp(−0.16 / (2·0.0225)) = exp(−3.5556) = 0.0285655
    assert preference_reward(10.0, 1.0, ideal_gap=0.6) == pytest.approx(0.0285655, rel=1e-5)
    # a near tie (gap 0.09/9 = 0.01) against ideal 0.15: exp(−0.14² / 0.045) = 0.6469, times 0.01/(1/9) = 0.09
    assert preference_reward(4.09, 4.0, ideal_gap=0.15) == pytest.approx(0.0582215, rel=1e-5)
    # a tie is not discriminable: 0 at any ideal gap (the bump alone would give exp(−0.5) at 0.15)
    assert preference_reward(4.0, 4.0, ideal_gap=0.15) == 0.0
    assert preference_reward(10.0, 10.0, ideal_gap=0.0) == 0.0


def test_preference_reward_has_no_jump_at_the_tie():
    """Across the tie boundary at the late ideal gap 0.15: a judge-split near tie (gap 0.001, the bump alone 0.6106)
    earns 0.009 of the bump, 0.0054952; the reward goes to the exact tie's 0 as the gap does; one score point (δ = 1/9)
    earns the full bump exp(−(1/9 − 0.15)² / 0.045) = 0.9669508, half a point half of exp(−0.0944444² / 0.045)."""
    assert preference_reward(4.009, 4.0, ideal_gap=0.15) == pytest.approx(0.0054952, rel=1e-4)
    for gap in (1e-3, 1e-6, 1e-9):
        assert 0.0 < preference_reward(4.0 + gap, 4.0, 0.15) < gap  # ≤ 9·(gap/9)·1: continuous into the tie's 0
    assert preference_reward(4.0, 4.0, 0.15) == 0.0
    assert preference_reward(5.0, 4.0, 0.15) == pytest.approx(0.9669508, rel=1e-6)
    assert preference_reward(5.0 + 1e-9, 4.0, 0.15) == pytest.approx(0.9669508, rel=1e-6)  # no jump at δ either
    assert preference_reward(4.5, 4.0, 0.15) == pytest.approx(0.5 * 0.8201921, rel=1e-5)
    assert preference_reward(4.5, 4.0, 0.15, tie_gap=0.5 / 9) == pytest.approx(0.8201921, rel=1e-5)  # δ configurable
    with pytest.raises(ValueError, match="tie_gap"):
        preference_reward(4.5, 4.0, 0.15, tie_gap=0.0)
    with pytest.raises(ValueError, match="tie_gap"):
        CompositeReward(tie_gap=-0.1)


@pytest.mark.parametrize("iteration", range(30))
def test_under_binary_grading_a_tie_never_pays_more_than_a_split(iteration):
    """Reference grading scores 1 or 10; over a 30-iteration annealed schedule a split duel (1 vs 10) must pay at
    least what a tie (1–1 or 10–10) pays. Before the tie rule, a 10–10 tie paid 0.158 against 0.150 at iteration 22
    and 0.425 at iteration 29."""
    reward, progress = CompositeReward(), iteration / 29
    split = reward(1.0, 10.0, progress)
    assert split >= 0.3 * 0.5  # the difficulty term alone: (10 − 5.5)/9 = 0.5
    for tie in (1.0, 10.0):
        assert reward(tie, tie, progress) == 0.0 < split


def test_composite_reward_anneals_the_ideal_gap():
    # start (ideal 0.6): gap 0.6 → r_pref 1; r_diff = (10 − 4.7)/9 = 0.5888889 → 0.3·0.5888889 + 0.7 = 0.8766667
    assert CompositeReward()(7.4, 2.0, progress=0.0) == pytest.approx(0.8766667, rel=1e-6)
    # end (ideal 0.15): gap 1.35/9 = 0.15 → r_pref 1; r_diff = (10 − 4.325)/9 = 0.6305556 → 0.8891667
    assert CompositeReward()(5.0, 3.65, progress=1.0) == pytest.approx(0.8891667, rel=1e-6)
    # the same duel is worth less once the ideal gap has moved away from it
    assert CompositeReward()(7.4, 2.0, progress=1.0) < CompositeReward()(7.4, 2.0, progress=0.0)
    for a, b, t in [(1, 1, 0), (10, 1, 0.3), (5, 5, 1), (10, 10, 0.5)]:
        assert 0.0 <= CompositeReward()(a, b, t) <= 1.0


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(1, 12),
    gamma=st.floats(0.01, 1.0),
    rounds=st.lists(st.lists(st.tuples(st.integers(0, 11), st.floats(0.0, 1.0)), min_size=1, max_size=20), max_size=8),
)
def test_probabilities_stay_a_distribution_above_the_floor(k, gamma, rounds):
    bandit = Exp3(k, gamma=gamma)
    for duels in rounds:
        bandit.update([i % k for i, _ in duels], [r for _, r in duels])
        p = bandit.probabilities()
        assert float(p.sum()) == pytest.approx(1.0) and float(p.min()) >= gamma / k - 1e-12
