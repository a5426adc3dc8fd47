"""Comparing groups of debate runs: peak windows, merging, P(Best), gap recovery, the table and the JSON."""

import json

import numpy as np
import pytest
import torch
from helpers.provenance import check_provenance
from scipy import stats

from alignment_games.callbacks import beta_lower_bound, posterior_mean
from alignment_games.commands.debate_compare import main
from alignment_games.modules.evaluation.debate_compare import (
    compare_groups,
    dedup_evaluations,
    final_intervals,
    format_table,
    judge_trend,
    load_evaluations,
    peak_window,
)


def _evals(*pairs):
    return [{"successes": s, "trials": n, "step": 10 * (i + 1)} for i, (s, n) in enumerate(pairs)]


def test_peak_window_by_hand():
    run = _evals((5, 10), (8, 10), (9, 10), (2, 10))
    # pooled over the trailing 3: (5,10), (13,20), (22,30), (19,30): the third has the highest lower bound
    p = peak_window(run, window=3)
    assert (p["index"], p["step"], p["successes"], p["trials"]) == (2, 30, 22, 30)
    assert p["lower_bound"] == pytest.approx(beta_lower_bound(22, 30))
    # a lucky single evaluation on few trials does not beat a sustained one
    assert peak_window(_evals((3, 3), (60, 80), (62, 80)), window=1)["index"] == 2


def test_compare_groups_merges_peak_windows_and_recovers_the_gap():
    groups = {
        "RLAIF-A": [_evals((69, 98))],
        "Debate-AB": [_evals((30, 49)), _evals((44, 49))],  # merged: (74, 98)
        "RLVR": [_evals((79, 98))],
    }
    res = compare_groups(groups, upper="RLVR", baseline="RLAIF-A", window=1, draws=20_000, seed=1)
    ab = res["groups"]["Debate-AB"]
    assert (ab["successes"], ab["trials"]) == (74, 98)
    assert ab["peak_accuracy"] == pytest.approx(posterior_mean(74, 98)) and ab["observed_mean"] == pytest.approx(
        74 / 98
    )
    assert ab["gap_recovery"] == pytest.approx(0.5)  # (75/100 - 70/100) / (80/100 - 70/100)
    assert res["groups"]["RLVR"]["p_best"] is None  # the upper bound is not a contender
    shares = [res["groups"][k]["p_best"] for k in ("RLAIF-A", "Debate-AB")]
    assert sum(shares) == pytest.approx(1.0) and shares[1] > shares[0]
    table = format_table(res)
    assert table.splitlines()[0].startswith("| protocol | peak accuracy | 95% CI lower bound")
    assert table.splitlines()[2].startswith("| RLVR |")  # best peak accuracy first


def test_compare_refuses_unknown_groups():
    with pytest.raises(ValueError, match="not one of the groups"):
        compare_groups({"A": [_evals((1, 2))]}, upper="RLVR")


def test_command_line_writes_json(tmp_path, capsys):
    paths = {}
    for name, pairs in {"a": [(5, 10), (6, 10)], "ab": [(7, 10), (8, 10)], "rlvr": [(9, 10), (9, 10)]}.items():
        d = tmp_path / name
        d.mkdir()
        (d / "debate_evals.jsonl").write_text("\n".join(json.dumps(e) for e in _evals(*pairs)) + "\n")
        paths[name] = str(d)
    out = tmp_path / "cmp.json"
    main(
        [
            "--group",
            f"RLAIF-A={paths['a']}",
            "--group",
            f"Debate-AB={paths['ab']}",
            "--upper",
            f"RLVR={paths['rlvr']}",
            "--baseline",
            "RLAIF-A",
            "--draws",
            "1000",
            "--out",
            str(out),
        ]
    )
    res = json.loads(out.read_text())
    assert res["groups"]["Debate-AB"]["trials"] == 20 and res["draws"] == 1000
    read = {
        f"{g}[0]": f"{paths[n]}/debate_evals.jsonl"
        for g, n in (("RLAIF-A", "a"), ("Debate-AB", "ab"), ("RLVR", "rlvr"))
    }
    check_provenance(res, read)  # each run's evaluations by hash, the commit and the command
    assert "| Debate-AB |" in capsys.readouterr().out


def test_bad_evaluation_files_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="debate_evals.jsonl"):
        load_evaluations(str(tmp_path))
    bad = tmp_path / "debate_evals.jsonl"
    bad.write_text('{"successes": 5, "trials": 3}\n')
    with pytest.raises(ValueError, match="line 1"):
        load_evaluations(str(bad))


def test_a_resumed_runs_repeated_evaluation_counts_once(tmp_path):
    """A log appended by a resumed run holds step 20 twice: the later record replaces the earlier in its place."""
    rows = [
        {"step": 10, "batches_seen": 10, "successes": 5, "trials": 10},
        {"step": 20, "batches_seen": 20, "successes": 1, "trials": 10},
        {"step": 20, "batches_seen": 20, "successes": 7, "trials": 10},
        {"step": 30, "batches_seen": 30, "successes": 8, "trials": 10},
    ]
    path = tmp_path / "debate_evals.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = load_evaluations(str(path))
    assert [(e["step"], e["successes"]) for e in loaded] == [(10, 5), (20, 7), (30, 8)]
    assert sum(e["trials"] for e in loaded) == 30
    assert dedup_evaluations([{"successes": 1, "trials": 2}] * 2) == [{"successes": 1, "trials": 2}] * 2  # no step


def test_judge_trend_pools_the_first_and_last_windows_against_sklearn():
    from sklearn.metrics import matthews_corrcoef

    evals = [
        {"step": 20, "tp": 6, "fp": 5, "tn": 43, "fn": 0, "reward": 0.30},
        {"step": 40, "tp": 5, "fp": 6, "tn": 39, "fn": 1, "reward": 0.40},
        {"step": 60, "tp": 2, "fp": 20, "tn": 30, "fn": 0, "reward": 0.50},
        {"step": 80, "tp": 1, "fp": 25, "tn": 28, "fn": 2, "reward": 0.60},
    ]

    def labels(part):
        truth, said = [], []
        for e in part:
            for t, p, k in ((1, 1, "tp"), (0, 1, "fp"), (0, 0, "tn"), (1, 0, "fn")):
                truth += [t] * e[k]
                said += [p] * e[k]
        return truth, said

    trend = judge_trend(evals, window=2)
    assert trend["first"]["mcc"] == pytest.approx(matthews_corrcoef(*labels(evals[:2])))
    assert trend["last"]["mcc"] == pytest.approx(matthews_corrcoef(*labels(evals[2:])))
    assert trend["first"]["false_accepts"] == 11 and trend["last"]["false_accepts"] == 45
    assert trend["first"]["accept_rate"] == pytest.approx((6 + 5 + 5 + 6) / (54 + 51))
    assert trend["first"]["reward"] == pytest.approx(0.35) and trend["last"]["steps"] == [60, 80]
    assert judge_trend([{"step": 1, "successes": 1, "trials": 2}]) is None  # no confusion counts recorded


def _run(correct, accepts, items=None, tie=None):
    """One run whose last evaluation holds these per-problem results (problems listed in ``items`` order)."""
    n = len(correct)
    rows = {"item": items or list(range(n)), "referenced": [1] * n, "correct": correct, "accepts": accepts}
    rows |= {"tie": tie or [0] * n, "unparsed": [0] * n}
    return [
        {"step": 1, "successes": 0, "trials": n},
        {"step": 2, "successes": sum(correct), "trials": n, "problems": rows},
    ]


def test_final_intervals_resample_runs_and_problems_against_sklearn():
    from sklearn.metrics import matthews_corrcoef

    from alignment_games.modules.evaluation.intervals import (
        crossed_bootstrap_interval,
        crossed_bootstrap_weights,
        nested_bootstrap_interval,
        nested_bootstrap_weights,
        seed_t_interval,
    )

    a = [
        _run([1, 1, 0, 0, 1, 0], [1, 0, 0, 1, 1, 0]),
        _run([1, 0, 0, 0, 1, 1], [1, 0, 1, 0, 1, 1], tie=[0, 0, 1, 0, 0, 0]),
    ]
    # the same results listed in another problem order: rows are matched by item
    b = [_run([0, 1, 0, 0, 1, 1], [0, 1, 1, 0, 1, 0], items=[5, 4, 3, 2, 1, 0]), _run([1] * 3 + [0] * 3, [1] * 6)]
    out = final_intervals({"A": a, "B": b}, baseline="A", n_boot=300, seed=3)
    truth = [1, 1, 0, 0, 1, 0, 1, 0, 0, 0, 1, 1]
    said = [1, 0, 0, 1, 1, 0, 1, 0, None, 0, 1, 1]  # the tie is no verdict
    kept = [i for i, s in enumerate(said) if s is not None]
    assert out["A"]["accuracy"] == pytest.approx(6 / 12)
    assert out["A"]["mcc"] == pytest.approx(matthews_corrcoef([truth[i] for i in kept], [said[i] for i in kept]))
    correct = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 1, 1]], dtype=torch.float64)
    acc = out["A"]["accuracy_intervals"]
    assert acc["crossed"] == pytest.approx(crossed_bootstrap_interval(correct, 300, seed=3).tolist())
    assert acc["nested"] == pytest.approx(nested_bootstrap_interval(correct, 300, seed=3).tolist())
    assert acc["seed_t"] == pytest.approx(seed_t_interval(correct.mean(1)).tolist())
    for name, weights in (("crossed", crossed_bootstrap_weights), ("nested", nested_bootstrap_weights)):
        w = weights(2, 6, 300, seed=3).view(300, 12)
        mccs = [
            matthews_corrcoef(
                [truth[i] for i in kept], [said[i] for i in kept], sample_weight=[float(w[r, i]) for i in kept]
            )
            for r in range(300)
        ]
        assert out["A"]["mcc_intervals"][name] == pytest.approx(np.quantile(mccs, [0.025, 0.975]).tolist())
    per_run = [
        matthews_corrcoef([truth[i] for i in kept if i // 6 == s], [said[i] for i in kept if i // 6 == s])
        for s in (0, 1)
    ]
    assert out["A"]["mcc_intervals"]["seed_t"] == pytest.approx(
        list(stats.t.interval(0.95, 1, np.mean(per_run), stats.sem(per_run)))
    )
    assert "accuracy_diff_intervals" not in out["A"] and out["B"]["runs"] == 2 and out["B"]["problems"] == 6
    b_correct = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.float64)
    diff = out["B"]["accuracy_diff_intervals"]
    assert diff["crossed"] == pytest.approx(crossed_bootstrap_interval(b_correct - correct, 300, seed=3).tolist())
    assert diff["nested"] == pytest.approx(nested_bootstrap_interval(b_correct - correct, 300, seed=3).tolist())
    assert diff["seed_t"] == pytest.approx(seed_t_interval((b_correct - correct).mean(1)).tolist())
    same = final_intervals({"A": a, "C": list(a)}, baseline="A", n_boot=50)
    for key in ("accuracy_diff_intervals", "mcc_diff_intervals"):
        assert [same["C"][key][k] for k in ("crossed", "nested", "seed_t")] == [[0.0, 0.0]] * 3


def test_final_intervals_leave_out_groups_without_comparable_rows():
    old = [_evals((1, 4))]  # records from before per-problem rows
    other = [_run([1, 0], [1, 0]), _run([1, 0], [1, 0], items=[2, 3])]  # different problems
    assert final_intervals({"old": old, "other": other}) == {}
    table = format_table(compare_groups({"A": [_run([1, 0, 1], [1, 0, 0])]}, window=1, draws=100))
    assert "| A | accuracy 0.667, MCC 0.50 | **crossed bootstrap [0.000, 1.000]** · nested" in table
    assert "seed t" not in table  # one run: no spread over runs
