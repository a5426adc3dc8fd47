"""Arms of a study compared on the same problems: accuracies and paired differences by hand, and the refusals."""

import collections
import itertools
import json

import pytest
from helpers.provenance import check_provenance

from alignment_games.commands.compare_arms import main
from alignment_games.modules.evaluation.audit import problem_rows, write_report

PROMPTS, REFS = ["a?", "b?", "c?", "d?"], ["1", "2", "3", "4"]
BASE = [False, True, False, False]


def _report(path, seeds: list[list[list[bool]]], base=BASE, prompts=PROMPTS) -> str:
    """An accuracy_gain report of ``seeds[s][player]`` results per problem, written as the command writes it."""
    results = {"base": base}
    flat = [player for seed in seeds for player in seed]
    results.update({f"trained[{i}]": r for i, r in enumerate(flat)})
    report = {"trained": [{"path": f"p{i}"} for i in range(len(flat))], "per_seed": [{} for _ in seeds]}
    write_report(report, str(path), problem_rows(prompts, REFS, results), {})
    return str(path)


def _exact_bootstrap_cdfs(d: list[list[float]]) -> dict[str, dict[float, float]]:
    """The exact distributions of the mean of ``d[seed][problem]`` under the crossed bootstrap (seeds and problems each
    drawn with replacement) and the nested one (seeds drawn, then problems for each drawn seed), by enumeration."""
    seeds, problems = len(d), len(d[0])
    draws = list(itertools.product(range(problems), repeat=problems))
    row = [[sum(d[s][p] for p in ps) for ps in draws] for s in range(seeds)]  # a seed's sum over each problem draw
    crossed, nested = collections.Counter(), collections.Counter()
    for ss in itertools.product(range(seeds), repeat=seeds):
        crossed.update(sum(row[s][k] for s in ss) / (seeds * problems) for k in range(len(draws)))
        for sums in itertools.product(*(row[s] for s in ss)):
            nested[sum(sums) / (seeds * problems)] += 1
    out = {}
    for name, counts in (("crossed", crossed), ("nested", nested)):
        total, run, out[name] = sum(counts.values()), 0, {}
        for v in sorted(counts):
            run += counts[v]
            out[name][v] = run / total
    return out


def test_accuracies_and_paired_differences_by_hand(tmp_path):
    t, f = True, False
    # pool: 2 seeds x 2 players; seed means per problem: [1, .5, 0, 0] and [1, 1, .5, 0] -> accuracy (0.375 + 0.625) / 2
    pool = _report(tmp_path / "pool.json", [[[t, t, f, f], [t, f, f, f]], [[t, t, t, f], [t, t, f, f]]])
    single = _report(tmp_path / "single.json", [[[t, f, f, f]], [[t, t, f, f]]])  # 0.25 and 0.5
    out = main([f"single={single}", f"pool={pool}", "--out", str(tmp_path / "c.json")])
    assert out["baseline"] == "single" and out["problems"] == 4 and out["base"] == 0.25
    arms = out["arms"]
    assert arms["pool"]["players_per_seed"] == 2 and arms["single"]["players_per_seed"] == 1
    assert arms["pool"]["per_seed"] == [0.375, 0.625] and arms["pool"]["accuracy"] == 0.5
    assert arms["single"]["accuracy"] == 0.375 and "difference" not in arms["single"]
    assert arms["pool"]["difference"] == pytest.approx(0.125)
    diff = arms["pool"]["difference_intervals"]
    for name, cdf in _exact_bootstrap_cdfs([[0, 0.5, 0, 0], [0, 0, 0.5, 0]]).items():  # the seeds' differences
        # 2.5%: the smallest value, 0 (probability 0.19 crossed, 0.10 nested); 97.5%: the cdf reaches 0.9746 (crossed)
        # or 0.9727 (nested) at 0.25, too close to 0.975 for 2,000 draws to say which side: the estimate lies between
        below, above = max(v for v, c in cdf.items() if c < 0.975), min(v for v, c in cdf.items() if c >= 0.975)
        assert diff[name][0] == min(v for v, c in cdf.items() if c >= 0.025) == 0.0
        assert (below, above) == (0.25, {"crossed": 0.375, "nested": 0.3125}[name])
        assert below <= diff[name][1] <= above
    # per seed both differences are 0.125: the t interval over seeds has no width, the bootstraps decide
    assert diff["seed_t"] == pytest.approx([0.125, 0.125]) and diff["most_conservative"] != "seed_t"
    assert diff["excludes_null"] is False  # the bootstraps' lower ends reach 0
    assert arms["pool"]["accuracy_intervals"]["null"] == 0.25  # the base's accuracy
    assert json.loads((tmp_path / "c.json").read_text()) == out
    # what it read: each arm's report and its per-problem file, by hash
    rows = {f"{n} rows": str(tmp_path / f"{n}.problems.jsonl") for n in ("single", "pool")}
    check_provenance(out, {"single": single, "pool": pool, **rows})


def test_a_constant_difference_has_no_spread(tmp_path):
    a = _report(tmp_path / "a.json", [[[False] * 4], [[False] * 4]])
    b = _report(tmp_path / "b.json", [[[True] * 4], [[True] * 4]])
    diff = main([f"a={a}", f"b={b}"])["arms"]["b"]["difference_intervals"]
    assert [diff[k] for k in ("crossed", "nested", "seed_t")] == [[1.0, 1.0]] * 3 and diff["excludes_null"]


def test_refusals_name_the_arm_or_file(tmp_path):
    a = _report(tmp_path / "a.json", [[[True, False, False, True]]])
    other = _report(tmp_path / "o.json", [[[True] * 4]], prompts=["w?", "x?", "y?", "z?"])
    with pytest.raises(SystemExit, match="arm o: other problems"):
        main([f"a={a}", f"o={other}"])
    rebased = _report(tmp_path / "r.json", [[[True] * 4]], base=[True] * 4)
    with pytest.raises(SystemExit, match="arm r: other problems or base"):
        main([f"a={a}", f"r={rebased}"])
    two = _report(tmp_path / "two.json", [[[True] * 4], [[True] * 4]])
    with pytest.raises(SystemExit, match="2 seeds against 1"):
        main([f"a={a}", f"two={two}"])
    (tmp_path / "a.problems.jsonl").write_text((tmp_path / "a.problems.jsonl").read_text().replace("true", "false"))
    with pytest.raises(SystemExit, match="sha256 is not the one"):
        main([f"a={a}", f"two={two}"])
    for bad in ([f"a={a}"], [f"a={a}", f"a={two}"], [f"a={a}", "b="]):
        with pytest.raises(SystemExit):
            main(bad)
