"""Accuracy gains of trained policies: the paired bootstrap per seed, the three intervals across seeds, the command."""

import hashlib
import json

import pytest
import torch
from helpers.provenance import check_provenance

from alignment_games.commands.accuracy_gain import main
from alignment_games.datamodules.debate import single_step_problems
from alignment_games.datamodules.prompts import generated_rows
from alignment_games.modules.algorithms.arithmetic import generate_problems
from alignment_games.modules.evaluation.accuracy_gain import (
    HELD_OUT_SEED,
    paired_gain,
    seed_mean_gain,
)
from alignment_games.modules.evaluation.intervals import seed_intervals


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


def test_seed_mean_gain_by_hand_and_against_one_seeds_paired_gain():
    before = [False, False, True, True]
    afters = [[True, False, True, True], [True, True, True, False]]  # per problem: +1, +0.5, 0, -0.5 on average
    out = seed_mean_gain(before, afters)
    assert out["seeds"] == 2 and out["gain"] == 0.25
    diff = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, -1.0]])
    assert out["intervals"] == seed_intervals(diff)
    one = seed_mean_gain(before, afters[:1], seed=3)
    assert one["intervals"]["crossed"] == paired_gain(before, afters[0], seed=3)["gain_ci"]
    assert one["intervals"]["seed_t"] is None  # one seed: no spread to estimate
    # equal gains (0.5) on different problems: the t interval over the seeds has width 0, the bootstraps do not (a
    # resample drawing one seed twice sees only its problems); the widest names the most conservative
    equal = seed_mean_gain([False] * 6, [[True] * 3 + [False] * 3, [False] * 3 + [True] * 3])["intervals"]
    assert equal["seed_t"] == [0.5, 0.5] and equal["nested"][0] < 0.5 < equal["nested"][1]
    assert equal["crossed"][0] < equal["nested"][0] and equal["most_conservative"] == "crossed"
    # two seeds of two players: each seed's players averaged first, as one seed of the two
    pooled = seed_mean_gain(before, [*afters, *afters], players_per_seed=2)
    assert pooled["seeds"] == 2 and pooled["gain"] == 0.25
    one_seed = seed_mean_gain(before, afters, players_per_seed=2)["intervals"]  # the two seeds are this one, twice
    assert pooled["intervals"]["crossed"] == pytest.approx(one_seed["crossed"])
    assert pooled["intervals"]["seed_t"] == [0.25, 0.25] and one_seed["seed_t"] is None


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
    nothing = {"crossed": [0.0, 0.0], "nested": [0.0, 0.0], "seed_t": [0.0, 0.0], "null": 0.0, "excludes_null": False}
    assert report["across_seeds"] == {"seeds": 2, "gain": 0.0, "intervals": {**nothing, "most_conservative": "crossed"}}
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
    check_provenance(report, {"--base": tiny_lm_dir, "--trained[0]": tiny_lm_dir, "--trained[1]": other_lm_dir})


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
    check_provenance(report, {"--data": str(data)})  # printed without --out, it still names what it read
    assert report["per_seed"][0]["gain"] == 0.75  # the base answers only the first, the trained one all four
    with pytest.raises(SystemExit, match="has 5 rows, fewer than --num-problems 6"):
        main([*argv, "--num-problems", "6"])
    with pytest.raises(SystemExit, match="--problems file needs --data"):
        main(["--base", "base", "--trained", "trained", "--problems", "file"])
    data.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(SystemExit, match="row 0 has no gsm8k reference"):
        main([*argv, "--num-problems", "1"])
