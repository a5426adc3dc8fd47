"""Intervals over seeds × problems: each scheme by hand, the t interval against scipy, coverage on simulated data."""

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from alignment_games.modules.evaluation.intervals import (
    compare_intervals,
    crossed_bootstrap_interval,
    crossed_bootstrap_weights,
    format_intervals,
    nested_bootstrap_interval,
    nested_bootstrap_weights,
    percentile_interval,
    seed_intervals,
    seed_t_interval,
)

X = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]])  # 3 seeds × 4 problems


def test_the_weights_are_the_draws_they_document_by_hand():
    """Replay the documented draws with numpy-style loops: crossed (problems once, then seeds), nested (seeds, then
    problems per drawn seed)."""
    s, p, b = 3, 4, 50
    gen = torch.Generator().manual_seed(7)
    problems, seeds = torch.randint(p, (b, p), generator=gen), torch.randint(s, (b, s), generator=gen)
    crossed = crossed_bootstrap_weights(s, p, b, seed=7)
    gen = torch.Generator().manual_seed(7)
    drawn, within = torch.randint(s, (b, s), generator=gen), torch.randint(p, (b, s, p), generator=gen)
    nested = nested_bootstrap_weights(s, p, b, seed=7)
    x = X.numpy()
    for r in range(b):
        mean_crossed = np.mean([x[i, j] for i in seeds[r].tolist() for j in problems[r].tolist()])
        mean_nested = np.mean([x[drawn[r, k], j] for k in range(s) for j in within[r, k].tolist()])
        assert (crossed[r].numpy() * x).sum() / (s * p) == pytest.approx(mean_crossed)
        assert (nested[r].numpy() * x).sum() / (s * p) == pytest.approx(mean_nested)
        assert torch.linalg.matrix_rank(crossed[r]) == 1  # one problem draw for every seed: an outer product
    assert crossed.sum(dim=(1, 2)).eq(s * p).all() and nested.sum(dim=(1, 2)).eq(s * p).all()


def test_the_two_bootstraps_differ_where_the_problems_are_shared():
    """Problem effects alone (every seed the same row b): the crossed mean varies as var(b) / P, the nested one S times
    less, since each drawn seed draws its own problems; seed effects alone: both var(a) / S (population variances)."""
    b = torch.tensor([0.0, 1.0, 3.0, -2.0, 0.5])
    a = torch.tensor([1.0, -1.0, 2.5])
    s, p, n = 3, 5, 40_000
    shared = b.repeat(s, 1).double()
    by_seed = a[:, None].repeat(1, p).double()
    for weights, expected in ((crossed_bootstrap_weights, b.var(unbiased=False) / p), (nested_bootstrap_weights, None)):
        means = torch.einsum("bsp,sp->b", weights(s, p, n, seed=1), shared) / (s * p)
        want = expected if expected is not None else b.var(unbiased=False) / (p * s)
        assert float(means.var()) == pytest.approx(float(want), rel=0.03)
        means = torch.einsum("bsp,sp->b", weights(s, p, n, seed=2), by_seed) / (s * p)
        assert float(means.var()) == pytest.approx(float(a.var(unbiased=False) / s), rel=0.03)


def test_one_seed_is_the_problem_bootstrap_and_equal_values_have_no_spread():
    d = torch.tensor([1.0, 0.0, -1.0, 1.0, 0.0])
    one = crossed_bootstrap_interval(d[None], 20_000, seed=4).tolist()
    theirs = stats.bootstrap((d.numpy(),), np.mean, n_resamples=20_000, method="percentile", random_state=0)
    assert one == pytest.approx([theirs.confidence_interval.low, theirs.confidence_interval.high], abs=0.02)
    assert nested_bootstrap_interval(d[None], 20_000, seed=4).tolist() == pytest.approx(one, abs=0.02)
    for f in (crossed_bootstrap_interval, nested_bootstrap_interval):
        assert f(torch.full((3, 7), 0.25)).tolist() == [0.25, 0.25]
        assert f(X, 300, seed=3).tolist() == f(X, 300, seed=3).tolist()  # seeded
    assert seed_t_interval(torch.full((3,), 0.25)).tolist() == [0.25, 0.25]


def test_a_batch_draws_each_data_set_independently_with_the_same_result_shape():
    x = torch.from_numpy(np.random.default_rng(1).normal(size=(3, 30)))
    batch = torch.stack([x, x])  # the same data twice: independent draws give (slightly) different ends
    for f in (crossed_bootstrap_interval, nested_bootstrap_interval):
        ci = f(batch, 2000)
        assert ci.shape == (2, 2) and not ci[0].equal(ci[1])
        assert ci[0].tolist() == pytest.approx(ci[1].tolist(), abs=0.1)
    assert seed_t_interval(batch.mean(-1)).flatten().tolist() == pytest.approx(seed_t_interval(x.mean(-1)).tolist() * 2)


def test_percentile_interval_is_numpys_linear_quantile():
    v = torch.from_numpy(np.random.default_rng(0).normal(size=(2, 101)))
    assert percentile_interval(v, 0.9).numpy() == pytest.approx(np.quantile(v.numpy(), [0.05, 0.95], axis=-1).T)


def test_seed_t_interval_against_scipy_and_the_table():
    per_seed = torch.tensor([0.115, 0.005, -0.035])  # GRPO - RFT per seed, held-out accuracy
    v = per_seed.numpy().astype(float)
    theirs = stats.t.interval(0.95, df=2, loc=v.mean(), scale=stats.sem(v))
    assert seed_t_interval(per_seed).tolist() == pytest.approx(list(theirs))
    half = 4.302652729911275 * v.std(ddof=1) / np.sqrt(3)  # t(2) at 0.975, from the table
    assert seed_t_interval(per_seed).tolist() == pytest.approx([v.mean() - half, v.mean() + half])
    assert seed_t_interval(per_seed, 0.9).tolist() == pytest.approx(
        list(stats.t.interval(0.9, df=2, loc=v.mean(), scale=stats.sem(v)))
    )
    with pytest.raises(ValueError, match="at least 2 seeds, got 1"):
        seed_t_interval(torch.tensor([0.3]))


def test_compare_intervals_names_the_most_conservative_by_hand():
    out = compare_intervals({"crossed": [-0.05, 0.11], "nested": [0.01, 0.1], "seed_t": [-0.16, 0.22]})
    assert out["most_conservative"] == "seed_t" and out["excludes_null"] is False  # widest of those containing 0
    out = compare_intervals({"crossed": [0.0, 0.146], "nested": [0.021, 0.135], "seed_t": [0.028, 0.118]})
    assert out["most_conservative"] == "crossed" and not out["excludes_null"]  # an end at 0 contains it
    out = compare_intervals({"crossed": [0.02, 0.3], "nested": [0.01, 0.2], "seed_t": None})
    assert (out["most_conservative"], out["excludes_null"], out["seed_t"]) == ("nested", True, None)
    assert compare_intervals({"a": [0.6, 0.7], "b": [0.52, 0.9]}, null=0.5)["most_conservative"] == "b"
    assert not compare_intervals({"a": [0.1, 0.2], "b": [-0.3, -0.1]})["excludes_null"]  # opposite sides
    with pytest.raises(ValueError, match="no intervals"):
        compare_intervals({"crossed": None})


def test_seed_intervals_and_their_printed_form():
    out = seed_intervals(X, 400, seed=1)
    assert out["crossed"] == crossed_bootstrap_interval(X, 400, seed=1).tolist()
    assert out["nested"] == nested_bootstrap_interval(X, 400, seed=1).tolist()
    assert out["seed_t"] == seed_t_interval(X.mean(-1)).tolist()
    assert seed_intervals(X[:1], 100)["seed_t"] is None and seed_intervals(X, 100, crossed=False)["crossed"] is None
    text = format_intervals({"crossed": [-0.05, 0.1], "nested": [0.0, 0.2], "most_conservative": "nested"}, "+.1f", 100)
    assert text == "crossed bootstrap [-5.0, +10.0] · **nested bootstrap [+0.0, +20.0]**"


def _t_coverage_by_integration(seeds: int, q: float) -> float:
    """P(|mean − μ| ≤ q · sd / √S) for normal seed means, integrating the normal over the chi-square of the sd."""
    df = seeds - 1

    def covered_given(v: float) -> float:  # v = df · sd² / σ²; |Z| ≤ q · sqrt(v / df)
        return (2 * stats.norm.cdf(q * np.sqrt(v / df)) - 1) * stats.chi2.pdf(v, df)

    return integrate.quad(covered_given, 0, np.inf)[0]


def _coverage(tau, sigma, beta, experiments, n_boot, seeds=3, problems=20, chunk=250, seed=0):
    """Share of simulated studies whose interval holds the true mean 0: seed effects N(0, tau²), problem effects
    N(0, beta²) shared by the seeds, noise N(0, sigma²) per seed and problem; bootstraps on ``experiments`` studies."""
    gen = torch.Generator().manual_seed(seed)
    hits = {"crossed": 0, "nested": 0}
    for start in range(0, experiments, chunk):
        noise = lambda *shape: torch.randn(chunk, *shape, generator=gen, dtype=torch.float64)  # noqa: E731
        x = tau * noise(seeds, 1) + beta * noise(1, problems) + sigma * noise(seeds, problems)
        for name, f in (("crossed", crossed_bootstrap_interval), ("nested", nested_bootstrap_interval)):
            ci = f(x, n_boot, seed=seed + start)
            hits[name] += int(((ci[:, 0] <= 0) & (ci[:, 1] >= 0)).sum())
    return {k: v / experiments for k, v in hits.items()}


def _t_coverage(tau, sigma, beta, experiments, seeds=3, problems=20, seed=0):
    gen = torch.Generator().manual_seed(seed)
    noise = lambda *shape: torch.randn(experiments, *shape, generator=gen, dtype=torch.float64)  # noqa: E731
    x = tau * noise(seeds, 1) + beta * noise(1, problems) + sigma * noise(seeds, problems)
    ci = seed_t_interval(x.mean(-1))
    return float(((ci[:, 0] <= 0) & (ci[:, 1] >= 0)).double().mean())


def _within(observed: float, expected: float, n: int, sds: float = 4.0) -> bool:
    return abs(observed - expected) <= sds * np.sqrt(expected * (1 - expected) / n)


def test_coverage_with_three_seeds_that_differ():
    """Seeds that differ (tau 1) more than their problems' noise (sigma 0.5 over 20 problems): the t interval covers
    at its nominal 95% (normal seed means: exact, by integration), both bootstraps near 1 − 2^(1 − 3) = 0.75, the
    coverage of [min, max] of 3 seed means, which is where their percentile ends land with 3 seeds."""
    nominal = _t_coverage_by_integration(3, float(stats.t.ppf(0.975, 2)))
    assert nominal == pytest.approx(0.95, abs=1e-6)
    n_t, n_boot = 20_000, 500
    assert _within(_t_coverage(1.0, 0.5, 0.0, n_t), nominal, n_t)
    boot = _coverage(1.0, 0.5, 0.0, n_boot, n_boot=200)
    for name in ("crossed", "nested"):
        assert _within(boot[name], 0.75, n_boot, sds=3) or 0.75 <= boot[name] <= 0.82, (name, boot)
        assert boot[name] < 0.87, (name, boot)  # far below 95%: 4 standard errors at 500 studies is 0.04
    # a z interval with the sample sd would not be exact: its coverage by integration is what t corrects
    assert _t_coverage_by_integration(3, 1.96) == pytest.approx(stats.t.cdf(1.96, 2) - stats.t.cdf(-1.96, 2))


@pytest.mark.slow
@pytest.mark.parametrize(
    "tau, sigma, beta, expect",
    [
        (1.0, 0.5, 0.0, {"crossed": (0.72, 0.82), "nested": (0.72, 0.82)}),  # seeds differ: both near 0.75
        (0.0, 1.0, 0.0, {"crossed": (0.96, 1.0), "nested": (0.955, 1.0)}),  # seeds alike: problems counted twice
        (0.0, 1.0, 1.0, {"crossed": (0.93, 0.99), "nested": (0.85, 0.92)}),  # shared problem effects: crossed fits
    ],
)
def test_coverage_by_design(tau, sigma, beta, expect):
    """2,000 studies each: each bootstrap's coverage in its expected band; the t interval at 95% while the seed means
    carry every effect (no shared problem effects), below it where shared problems make the seed means correlated."""
    boot = _coverage(tau, sigma, beta, 2000, n_boot=500, seed=11)
    for name, (lo, hi) in expect.items():
        assert lo <= boot[name] <= hi, (name, boot)
    t = _t_coverage(tau, sigma, beta, 40_000, seed=12)
    if beta == 0:
        assert _within(t, 0.95, 40_000)
    else:
        assert t < 0.9
