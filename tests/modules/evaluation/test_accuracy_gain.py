"""Accuracy gains of trained policies: the paired bootstrap per seed, the t interval across seeds, the command."""

import json
import math

import pytest
from scipy import stats

from alignment_games.commands.accuracy_gain import main
from alignment_games.datamodules.prompts import generated_rows
from alignment_games.modules.algorithms.arithmetic import generate_problems
from alignment_games.modules.evaluation.accuracy_gain import HELD_OUT_SEED, paired_gain, seed_interval, seed_mean_gain


def test_paired_gain_by_hand_and_a_constant_difference_has_no_spread():
    out = paired_gain([True, False, False, False], [True, True, False, True])
    assert (out["n"], out["before"], out["after"], out["gain"]) == (4, 0.25, 0.75, 0.5)
    assert out["gain_ci"][0] <= 0.5 <= out["gain_ci"][1]
    same = paired_gain([False] * 5, [True] * 5)  # every problem gained: every resample gains 1
    assert same["gain"] == 1.0 and same["gain_ci"] == [1.0, 1.0]


def test_the_bootstrap_interval_matches_the_normal_one_on_many_problems():
    # 400 problems, 200 gained and 200 unchanged: gain 0.5, standard error sqrt(0.25 / 400) = 0.025
    before = [False] * 400
    after = [True] * 200 + [False] * 200
    lo, hi = paired_gain(before, after, n_boot=4000)["gain_ci"]
    assert lo == pytest.approx(0.5 - 1.96 * 0.025, abs=0.006) and hi == pytest.approx(0.5 + 1.96 * 0.025, abs=0.006)


def test_the_pairing_is_kept():
    # the same outcomes shuffled between problems: unpaired accuracies equal, paired differences not all zero
    before = [True, False] * 50
    after = [False, True] * 50
    out = paired_gain(before, after)
    assert out["gain"] == 0.0 and out["gain_ci"][0] < -0.1 and out["gain_ci"][1] > 0.1


def test_seed_interval_against_scipy_and_a_hand_value():
    values = [0.05, 0.07, 0.09]
    out = seed_interval(values)
    lo, hi = stats.t.interval(0.95, 2, loc=0.07, scale=stats.sem(values))
    assert out["ci"] == pytest.approx([lo, hi])
    assert out["ci"] == pytest.approx([0.07 - 4.302653 * 0.02 / math.sqrt(3), 0.07 + 4.302653 * 0.02 / math.sqrt(3)])
    assert out["sd"] == pytest.approx(0.02) and out["n"] == 3


def test_seed_mean_gain_by_hand_and_against_one_seeds_paired_gain():
    before = [False, False, True, True]
    afters = [[True, False, True, True], [True, True, True, False]]  # per problem: +1, +0.5, 0, -0.5 on average
    out = seed_mean_gain(before, afters)
    assert out["seeds"] == 2 and out["gain"] == 0.25
    lo, hi = out["gain_ci"]
    assert -0.5 <= lo < 0.25 < hi <= 1.0
    one = seed_mean_gain(before, afters[:1], seed=3)
    assert one["gain_ci"] == paired_gain(before, afters[0], seed=3)["gain_ci"]
    # equal gains on different problems: the t interval over seeds has width 0, this one does not
    equal = seed_mean_gain([False] * 6, [[True] * 3 + [False] * 3, [False] * 3 + [True] * 3])
    assert equal["gain"] == 0.5 and equal["gain_ci"] == [0.5, 0.5]  # each problem gains 0.5: no spread either
    apart = seed_mean_gain([False] * 6, [[True] * 3 + [False] * 3, [True] * 3 + [False] * 3])
    assert apart["gain"] == 0.5 and apart["gain_ci"][0] < 0.5 < apart["gain_ci"][1]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: paired_gain([True], [True, False]), "before has 1 problems but after has 2"),
        (lambda: paired_gain([], []), "no problems"),
        (lambda: paired_gain([True], [True], n_boot=0), "n_boot"),
        (lambda: seed_interval([0.1]), "at least 2 seeds"),
        (lambda: seed_mean_gain([True], []), "no trained policies"),
        (lambda: seed_mean_gain([True, False], [[True, True], [True]]), "trained policy 1 has 1"),
        (lambda: seed_mean_gain([], [[]]), "no problems"),
    ],
)
def test_bad_input_is_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_command_on_a_policy_against_itself(tiny_lm_dir, tmp_path):
    out = tmp_path / "gain.json"
    report = main(
        [
            "--base",
            str(tiny_lm_dir),
            "--trained",
            str(tiny_lm_dir),
            str(tiny_lm_dir),
            "--num-problems",
            "3",
            "--max-new-tokens",
            "4",
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == report
    assert [s["gain"] for s in report["per_seed"]] == [0.0, 0.0]
    assert report["across_seeds"]["mean"] == 0.0 and report["across_seeds"]["ci"] == [0.0, 0.0]
    assert report["seed_mean_over_problems"] == {"seeds": 2, "gain": 0.0, "gain_ci": [0.0, 0.0]}
    assert report["problems"] == {"n": 3, "seed": HELD_OUT_SEED, "steps": [2, 4]}


def test_the_default_problems_are_none_a_game_or_the_warm_start_trains_on():
    held_out = {p.question for p in generate_problems(2000, HELD_OUT_SEED)}
    games = {r["prompt"] for r in generated_rows(4000, 0 + 1_000_003)}  # PromptDataModule, seed 0
    warm_start = {p.question for p in generate_problems(4000, 0 + 2_000_003, 1, 4)}  # the SFT data, seed 0
    assert len(held_out) > 1900
    assert len(held_out & games) <= 2 and len(held_out & warm_start) <= 2


def test_players_per_seed_groups_a_pools_players_by_hand(monkeypatch):
    import alignment_games.commands.accuracy_gain as ag

    table = {
        "base": [False, False, True, True],
        "s0m0": [True, False, True, True],  # +0.25
        "s0m1": [True, True, True, True],  # +0.50
        "s1m0": [False, False, True, False],  # -0.25
        "s1m1": [True, True, True, True],  # +0.50
    }
    monkeypatch.setattr(ag, "solved", lambda path, *args: table[path])
    report = main(["--base", "base", "--trained", "s0m0", "s0m1", "s1m0", "s1m1", "--players-per-seed", "2"])
    seeds = report["per_seed"]
    assert [[p["gain"] for p in s["players"]] for s in seeds] == [[0.25, 0.5], [-0.25, 0.5]]
    assert [s["gain"] for s in seeds] == pytest.approx([0.375, 0.125])  # each seed: its players' mean
    assert report["across_seeds"]["mean"] == pytest.approx(0.25)
    assert report["seed_mean_over_problems"]["gain"] == pytest.approx(0.25)
    assert (report["seed_mean_over_problems"]["seeds"], report["seed_mean_over_problems"]["policies"]) == (2, 4)
    with pytest.raises(SystemExit, match="not groups of 3"):
        main(["--base", "base", "--trained", "s0m0", "s0m1", "--players-per-seed", "3"])
