"""Accuracy gains of trained policies: the paired bootstrap per seed, the two-level one across seeds, the command."""

import hashlib
import json

import numpy as np
import pytest
import torch
from scipy import stats

from alignment_games.commands.accuracy_gain import main
from alignment_games.datamodules.debate import single_step_problems
from alignment_games.datamodules.prompts import generated_rows
from alignment_games.modules.algorithms.arithmetic import generate_problems
from alignment_games.modules.evaluation.accuracy_gain import (
    HELD_OUT_SEED,
    paired_gain,
    seed_mean_gain,
    two_level_interval,
)


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


def test_two_level_degenerate_cases_by_hand():
    d = torch.tensor([1.0, 0.0, -1.0, 1.0, 0.0])
    one = two_level_interval(d[None], seed=4)
    assert two_level_interval(d.repeat(3, 1), seed=4) == pytest.approx(one)  # equal seeds: the problem bootstrap
    assert one == paired_gain([False, False, True, False, False], [True, False, False, True, False], seed=4)["gain_ci"]
    assert two_level_interval(torch.full((3, 7), 0.25)) == [0.25, 0.25]  # nothing varies: width 0
    assert two_level_interval(d.repeat(3, 1), seed=4) == two_level_interval(d.repeat(3, 1), seed=4)  # seeded


@pytest.mark.parametrize("level", ["seeds", "problems"])
def test_two_level_reduces_to_scipys_one_level_bootstrap(level):
    values = torch.from_numpy(np.random.default_rng(0).normal(0.1, 0.2, 40))
    # each seed constant over the problems: only the seeds vary; one seed: only the problems
    diff = values[:, None].repeat(1, 5) if level == "seeds" else values[None]
    ours = two_level_interval(diff, n_boot=20000, seed=1)
    theirs = stats.bootstrap((values.numpy(),), np.mean, n_resamples=20000, method="percentile", random_state=2)
    assert ours == pytest.approx([theirs.confidence_interval.low, theirs.confidence_interval.high], abs=0.006)


def test_two_level_covers_where_one_level_does_not():
    # 10 seeds x 50 problems: a seed effect (sd 0.2), a problem effect (sd 0.3) and noise (sd 0.3) around a true
    # gain of 0; the mean's variance is 0.04/10 + 0.09/50 + 0.09/500: mostly the seeds'. Resampling the problems
    # alone (the seeds' mean per problem) sees about a third of it, the seeds alone (their means) about two thirds
    gen = torch.Generator().manual_seed(0)
    covered = {"two-level": 0, "problems only": 0, "seeds only": 0}
    reps = 300
    for r in range(reps):
        noise = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
        d = 0.2 * noise(10, 1) + 0.3 * noise(1, 50) + 0.3 * noise(10, 50)
        for name, x in (("two-level", d), ("problems only", d.mean(0)[None]), ("seeds only", d.mean(1)[:, None])):
            lo, hi = two_level_interval(x, n_boot=1000, seed=r)
            covered[name] += lo <= 0 <= hi
    assert covered["two-level"] / reps >= 0.88
    assert covered["problems only"] / reps <= 0.82 and covered["seeds only"] / reps <= 0.90
    lo, hi = two_level_interval(d)
    for one_level in (d.mean(0)[None], d.mean(1)[:, None]):  # wider than either one level on the same data
        a, b = two_level_interval(one_level)
        assert hi - lo > b - a


def test_seed_mean_gain_by_hand_and_against_one_seeds_paired_gain():
    before = [False, False, True, True]
    afters = [[True, False, True, True], [True, True, True, False]]  # per problem: +1, +0.5, 0, -0.5 on average
    out = seed_mean_gain(before, afters)
    assert out["seeds"] == 2 and out["gain"] == 0.25
    lo, hi = out["gain_ci"]
    assert -0.5 <= lo < 0.25 < hi <= 1.0
    one = seed_mean_gain(before, afters[:1], seed=3)
    assert one["gain_ci"] == paired_gain(before, afters[0], seed=3)["gain_ci"]
    # equal gains (0.5) on different problems: a t interval over the seeds has width 0; the problems averaged over
    # the seeds gain 0.5 each, so a problem bootstrap of that has width 0 too; drawing the seeds as well does not
    equal = seed_mean_gain([False] * 6, [[True] * 3 + [False] * 3, [False] * 3 + [True] * 3])
    assert equal["gain"] == 0.5 and equal["gain_ci"][0] < 0.5 < equal["gain_ci"][1]
    # two seeds of two players: each seed's players averaged first, as one seed of the two
    pooled = seed_mean_gain(before, [*afters, *afters], players_per_seed=2)
    assert pooled["seeds"] == 2 and pooled["gain"] == 0.25
    assert pooled["gain_ci"] == pytest.approx(seed_mean_gain(before, afters, players_per_seed=2)["gain_ci"])


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: paired_gain([True], [True, False]), "before has 1 problems but after has 2"),
        (lambda: paired_gain([], []), "no problems"),
        (lambda: paired_gain([True], [True], n_boot=0), "n_boot"),
        (lambda: seed_mean_gain([True], [[True]] * 3, players_per_seed=2), "3 trained policies are not groups of 2"),
        (lambda: seed_mean_gain([True], []), "no trained policies"),
        (lambda: seed_mean_gain([True, False], [[True, True], [True]]), "trained policy 1 has 1"),
        (lambda: seed_mean_gain([], [[]]), "no problems"),
    ],
)
def test_bad_input_is_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.fixture(scope="module")
def other_lm_dir(tmp_path_factory):
    from alignment_games.modules.lm.models import build_tiny_causal_lm

    return build_tiny_causal_lm(tmp_path_factory.mktemp("other"), seed=1)


def test_the_command_writes_each_model_and_each_problem(tiny_lm_dir, other_lm_dir, tmp_path):
    out = tmp_path / "gain.json"
    argv = ["--base", tiny_lm_dir, "--trained", tiny_lm_dir, other_lm_dir, "--num-problems", "3"]
    report = main([*argv, "--max-new-tokens", "4", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert [s["gain"] for s in report["per_seed"]] == [0.0, 0.0]  # byte soup solves nothing, before or after
    assert report["across_seeds"] == {"seeds": 2, "gain": 0.0, "gain_ci": [0.0, 0.0]}
    assert report["problems"] == {"n": 3, "seed": HELD_OUT_SEED, "kind": "arithmetic", "steps": [2, 4]}
    digest = lambda folder: hashlib.sha256(open(f"{folder}/model.safetensors", "rb").read()).hexdigest()  # noqa: E731
    assert [(m["path"], m["sha256"]) for m in report["trained"]] == [
        (p, digest(p)) for p in (tiny_lm_dir, other_lm_dir)
    ]
    assert report["base"]["name_or_path"] == tiny_lm_dir and report["base"]["sha256"]
    rows_file = tmp_path / "gain.problems.jsonl"
    assert report["per_problem"] == {
        "file": rows_file.name,
        "rows": 3,
        "sha256": hashlib.sha256(rows_file.read_bytes()).hexdigest(),
    }
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    problems = generate_problems(3, HELD_OUT_SEED, 2, 4)
    assert [(r["sha256"], r["reference"]) for r in rows] == [
        (hashlib.sha256(p.question.encode()).hexdigest(), str(p.answer)) for p in problems
    ]
    assert rows[0]["correct"] == {"base": False, "trained[0]": False, "trained[1]": False}
    assert set(rows[0]["answer"]) == {"base", "trained[0]", "trained[1]"}
    assert set(report["answered"]) == set(rows[0]["answer"])
    assert report["answered"]["base"] == sum(r["answer"]["base"] is not None for r in rows) / 3


def test_the_command_scores_the_single_step_problems_the_debate_data_generates(monkeypatch):
    import alignment_games.commands.accuracy_gain as ag

    seen = {}

    rows = single_step_problems(400, seed=HELD_OUT_SEED, max_operand=30)

    def final_answers(path, prompts, *args):
        seen[path] = prompts
        sums = [int(r["a"]) + int(r["b"]) for r in rows]
        if path == "base":  # boxes the odd sums' problems, one too high: a format but no right answer
            return [str(t + 1) if t % 2 else None for t in sums]
        return [str(t) if t % 2 == 0 else "x" for t in sums]  # the trained one boxes every answer, the even sums right

    monkeypatch.setattr(ag, "final_answers", final_answers)
    monkeypatch.setattr(ag, "base_identity", lambda path: {"name_or_path": path})
    monkeypatch.setattr(ag, "describe_models", lambda paths, *args: [{"path": p} for p in paths])
    report = main(["--base", "base", "--trained", "trained", "--problems", "single_step", "--max-operand", "30"])
    assert seen["trained"] == seen["base"] == [r["prompt"] for r in rows]
    assert max(r["a"] for r in rows) == 30 and min(r["b"] for r in rows) == 1
    assert report["problems"] == {"n": 400, "seed": HELD_OUT_SEED, "kind": "single_step", "max_operand": 30}
    even = sum(int(r["reference"]) % 2 == 0 for r in rows)
    assert report["per_seed"][0]["gain"] == even / 400
    assert report["answered"] == {"base": (400 - even) / 400, "trained[0]": 1.0}


def test_the_command_refuses_a_model_twice_or_on_another_base(tiny_lm_dir, other_lm_dir, tmp_path):
    import shutil

    from alignment_games.modules.lm.base_identity import base_identity

    with pytest.raises(ValueError, match="are the same path"):
        main(["--base", tiny_lm_dir, "--trained", tiny_lm_dir, f"{tiny_lm_dir}/."])  # one folder, two spellings
    shutil.copytree(tiny_lm_dir, tmp_path / "copy")
    with pytest.raises(ValueError, match=f"{tiny_lm_dir}' and '.*copy' are the same weights .sha256 [0-9a-f]{{64}}"):
        main(["--base", tiny_lm_dir, "--trained", tiny_lm_dir, str(tmp_path / "copy")])
    adapter = tmp_path / "adapter"  # an export trained on another base than --base
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    (adapter / "export.json").write_text(json.dumps({"base_identity": base_identity(other_lm_dir)}))
    with pytest.raises(
        ValueError, match=f"--trained '{adapter}': .*frozen base '{other_lm_dir}'.*given is '{tiny_lm_dir}'"
    ):
        main(["--base", tiny_lm_dir, "--trained", str(adapter)])
    with pytest.raises(FileNotFoundError, match="--trained: 'nowhere' is not a local model folder"):
        main(["--base", tiny_lm_dir, "--trained", "nowhere"])


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
    refs = [str(p.answer) for p in generate_problems(400, HELD_OUT_SEED, 2, 4)][:4]
    monkeypatch.setattr(
        ag, "final_answers", lambda path, *args: [r if c else str(int(r) + 1) for r, c in zip(refs, table[path])]
    )
    monkeypatch.setattr(ag, "base_identity", lambda path: {"name_or_path": path})
    monkeypatch.setattr(ag, "describe_models", lambda paths, *args: [{"path": p} for p in paths])
    report = main(["--base", "base", "--trained", "s0m0", "s0m1", "s1m0", "s1m1", "--players-per-seed", "2"])
    seeds = report["per_seed"]
    assert [[p["gain"] for p in s["players"]] for s in seeds] == [[0.25, 0.5], [-0.25, 0.5]]
    assert [s["gain"] for s in seeds] == pytest.approx([0.375, 0.125])  # each seed: its players' mean
    assert (report["across_seeds"]["seeds"], report["across_seeds"]["gain"]) == (2, pytest.approx(0.25))
    with pytest.raises(SystemExit, match="not groups of 3"):
        main(["--base", "base", "--trained", "s0m0", "s0m1", "--players-per-seed", "3"])


def test_the_command_scores_the_first_rows_of_a_file_by_its_reference_format(monkeypatch, tmp_path):
    """GSM8K's layout: the answer after ``####``; the report names the file by its sha256; bad files are refused."""
    import alignment_games.commands.accuracy_gain as ag

    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(5)]
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = {}

    def final_answers(path, prompts, *args):
        seen[path] = prompts
        return [str(2 * i) if path == "trained" or i == 0 else None for i in range(len(prompts))]

    monkeypatch.setattr(ag, "final_answers", final_answers)
    monkeypatch.setattr(ag, "base_identity", lambda path: {"name_or_path": path})
    monkeypatch.setattr(ag, "describe_models", lambda paths, *args: [{"path": p} for p in paths])
    argv = ["--base", "base", "--trained", "trained", "--problems", "file", "--data", str(data)]
    report = main([*argv, "--num-problems", "4"])
    assert seen["base"] == seen["trained"] == [r["question"] for r in rows[:4]]
    assert report["problems"]["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    assert report["problems"]["kind"] == "file" and report["problems"]["n"] == 4
    assert report["per_seed"][0]["gain"] == 0.75  # the base answers only the first, the trained one all four
    with pytest.raises(SystemExit, match="has 5 rows, fewer than --num-problems 6"):
        main([*argv, "--num-problems", "6"])
    with pytest.raises(SystemExit, match="--problems file needs --data"):
        main(["--base", "base", "--trained", "trained", "--problems", "file"])
    data.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(SystemExit, match="row 0 has no gsm8k reference"):
        main([*argv, "--num-problems", "1"])
