import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import roc_auc_score, roc_curve

from alignment_games.modules.algorithms.disagreement import ensemble_jsd
from alignment_games.modules.evaluation.figures import make_figures
from alignment_games.modules.evaluation.preference_report import (
    build_report,
    decile_accuracy,
    error_auroc,
    error_rate_curve,
    json_safe,
    prompt_bootstrap,
    roc_curve_points,
    top_fraction_error_rate,
    top_fraction_lift,
    variance_summary,
)

REQUIRED_KEYS = {
    "ensemble_accuracy",
    "member_accuracy",
    "auroc",
    "decile_accuracy",
    "top10_error_rate",
    "overall_error_rate",
    "variance_summary",
    "n_pairs",
    "n_prompts",
}


def _random_inputs(n=400, k=5, n_prompts=60, seed=0):
    gen = torch.Generator().manual_seed(seed)
    truth = torch.rand(n, generator=gen)
    spread = 0.25 * torch.rand(n, 1, generator=gen)
    probs = (truth[:, None] + spread * torch.randn(n, k, generator=gen)).clamp(0, 1)
    labels = (torch.rand(n, generator=gen) < truth).long()
    prompts = torch.randint(0, n_prompts, (n,), generator=gen) * 7 + 3  # arbitrary, non-contiguous ids
    return probs, labels, prompts


# ----------------------------------------------------------------------------------------------------------------------
# AUROC and ROC
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_error_auroc_matches_sklearn_with_ties(seed):
    rng = np.random.default_rng(seed)
    n = 300
    scores = np.round(rng.random(n), 1)  # 11 distinct values: many ties
    errors = (rng.random(n) < 0.2 + 0.5 * scores).astype(np.int64)
    got = error_auroc(torch.tensor(scores), torch.tensor(errors))
    assert got == pytest.approx(roc_auc_score(errors, scores), abs=1e-12)


def test_error_auroc_hand_computed():
    # errors at scores 0.8 and 0.3; correct at 0.1, 0.3, 0.5.
    # pairs (error > correct): 0.8 beats all three -> 3; 0.3 beats 0.1 (1), ties 0.3 (1/2), loses to 0.5 -> 1.5.
    scores = torch.tensor([0.1, 0.8, 0.3, 0.5, 0.3])
    errors = torch.tensor([0, 1, 1, 0, 0])
    assert error_auroc(scores, errors) == pytest.approx(4.5 / 6, abs=1e-15)
    assert error_auroc(-scores, errors) == pytest.approx(1.5 / 6, abs=1e-15)
    assert error_auroc(scores, errors.bool()) == pytest.approx(4.5 / 6, abs=1e-15)


def test_error_auroc_perfect_and_all_tied():
    assert error_auroc(torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.tensor([0, 0, 1, 1])) == 1.0
    assert error_auroc(torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.tensor([1, 1, 0, 0])) == 0.0
    assert error_auroc(torch.full((6,), 0.3), torch.tensor([1, 0, 1, 0, 0, 0])) == 0.5


@pytest.mark.parametrize("errors", [[0, 0, 0], [1, 1, 1]])
def test_error_auroc_one_class_is_half(errors):
    scores = torch.tensor([0.3, 0.1, 0.9])
    assert error_auroc(scores, torch.tensor(errors)) == 0.5
    fpr, tpr = roc_curve_points(scores, torch.tensor(errors))
    assert fpr.tolist() == [0.0, 1.0] and tpr.tolist() == [0.0, 1.0]


def test_roc_curve_points_match_sklearn():
    rng = np.random.default_rng(3)
    scores = np.round(rng.random(200), 2)
    errors = (rng.random(200) < scores).astype(np.int64)
    fpr, tpr = roc_curve_points(torch.tensor(scores), torch.tensor(errors))
    ref_fpr, ref_tpr, _ = roc_curve(errors, scores, drop_intermediate=False)
    np.testing.assert_allclose(fpr.numpy(), ref_fpr, atol=1e-12)
    np.testing.assert_allclose(tpr.numpy(), ref_tpr, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(min_value=0, max_value=6), st.booleans()),
        min_size=2,
        max_size=40,
    ).filter(lambda xs: len({e for _, e in xs}) == 2)
)
def test_auroc_equals_roc_area_and_flips_under_negation(items):
    scores = torch.tensor([float(s) for s, _ in items])
    errors = torch.tensor([e for _, e in items])
    auc = error_auroc(scores, errors)
    fpr, tpr = roc_curve_points(scores, errors)
    assert torch.trapezoid(tpr, fpr).item() == pytest.approx(auc, abs=1e-12)
    assert error_auroc(-scores, errors) == pytest.approx(1.0 - auc, abs=1e-12)
    assert fpr[0] == 0 and tpr[0] == 0 and fpr[-1] == 1 and tpr[-1] == 1


# ----------------------------------------------------------------------------------------------------------------------
# deciles and top fractions
# ----------------------------------------------------------------------------------------------------------------------


def test_decile_accuracy_hand_built():
    # 20 items, scores in reverse item order, so the lowest-score decile holds items 19 and 18.
    scores = torch.arange(20, 0, -1).double()
    correct = torch.zeros(20, dtype=torch.long)
    correct[[19, 18, 17, 15, 0]] = 1  # decile 1: items 19, 18 -> 1.0; decile 2: 17, 16 -> 0.5; decile 3: 15, 14 -> .5
    expected = [1.0, 0.5, 0.5, 0, 0, 0, 0, 0, 0, 0.5]  # decile 10: items 1, 0 -> 0.5
    assert decile_accuracy(scores, correct) == expected


def test_decile_accuracy_uneven_bins_and_stable_ties():
    # 25 tied scores: stable sort keeps item order; tensor_split gives bin sizes 3,3,3,3,3,2,2,2,2,2.
    correct = torch.zeros(25, dtype=torch.long)
    correct[:3] = 1  # the whole first bin
    correct[15] = 1  # first item of bin 6 (items 15, 16)
    got = decile_accuracy(torch.zeros(25), correct)
    assert got == [1.0, 0, 0, 0, 0, 0.5, 0, 0, 0, 0]


def test_decile_accuracy_fewer_items_than_bins_gives_nan():
    got = decile_accuracy(torch.tensor([0.3, 0.1, 0.2]), torch.tensor([1, 0, 1]))
    assert got[:3] == [0.0, 1.0, 1.0]  # lowest score first: 0.1 (wrong), 0.2, 0.3
    assert all(math.isnan(v) for v in got[3:]) and len(got) == 10


def test_top_fraction_error_rate_hand_computed():
    scores = torch.arange(30).double()
    errors = torch.zeros(30, dtype=torch.long)
    errors[[29, 27, 26, 0, 1]] = 1  # top 3 scores are items 29, 28, 27 -> 2 errors; top 4 would give 3/4
    assert top_fraction_error_rate(scores, errors) == pytest.approx(2 / 3, abs=1e-15)
    assert top_fraction_error_rate(scores, errors, fraction=0.05) == 0.5  # ceil(1.5) = 2 items: 29, 28
    assert top_fraction_error_rate(scores, errors, fraction=1 / 30) == 1.0
    assert top_fraction_error_rate(scores, errors, fraction=1.0) == pytest.approx(5 / 30, abs=1e-15)
    # 0.07 * 100 is 7.000000000000001 in floating point, but exactly 7 items must be selected (the 8th is correct).
    errors = torch.zeros(100, dtype=torch.long)
    errors[93:] = 1
    assert top_fraction_error_rate(torch.arange(100).double(), errors, fraction=0.07) == 1.0


def test_top_fraction_lift_hand_computed_and_banded():
    """§5.2's headline: the top-10% error rate over the overall one (the paper's 40.6% / 24.3% = 1.67)."""
    scores = torch.arange(30).double()
    errors = torch.zeros(30, dtype=torch.long)
    errors[[29, 27, 26, 0, 1]] = 1  # top 3: two errors (2/3), overall 5/30
    assert top_fraction_lift(scores, errors) == pytest.approx((2 / 3) / (5 / 30), abs=1e-12)  # 4.0
    assert math.isnan(top_fraction_lift(scores, torch.zeros(30, dtype=torch.long)))
    # in the report: the same ratio, and a prompt-bootstrap band around it (one item per prompt here)
    probs = torch.stack(
        [torch.full((30,), 0.5) + 0.01 * scores / 30 * (torch.arange(5.0)[:, None] - 2).T[:, i] for i in range(5)],
        dim=1,
    ).clamp(0, 1)
    labels = (probs.mean(1) < 0.5).long()
    labels[:15] = (probs.mean(1)[:15] >= 0.5).long()  # errors only where mean >= 0.5 among the first 15
    report = build_report(probs, labels, torch.arange(30), n_boot=100)
    variance = probs.var(dim=1, unbiased=False)
    errors = ((probs.mean(1) >= 0.5).long() != labels).long()
    assert report["top10_lift"] == pytest.approx(top_fraction_lift(variance, errors), abs=1e-12)


def _lift(variance: np.ndarray, errors: np.ndarray) -> float:
    """§5.2's lift written out: the error rate of the ceil(10%) highest variances (stable order) over the overall."""
    top = np.argsort(-variance, kind="stable")[: math.ceil(len(variance) / 10)]
    return errors[top].mean() / errors.mean()


def test_top_fraction_lift_band_is_a_prompt_bootstrap_as_scipy_draws_it():
    """The lift's band against scipy's percentile bootstrap over prompts, its own resamples and the lift of `_lift`.

    80 prompts of two items with the same members' probabilities and label: resampling items instead of prompts
    would narrow the band by about 1 / sqrt(2); the band of another statistic (the top-10% error rate, the top 20%)
    lies elsewhere. Monte Carlo error of the report's 97.5% quantile (400 resamples): about 0.05; scipy's (20000):
    under 0.01.
    """
    from scipy.stats import bootstrap

    g = torch.Generator().manual_seed(5)
    per_prompt = torch.rand(80, 4, generator=g, dtype=torch.float64)
    probs = per_prompt.repeat_interleave(2, dim=0)  # two items a prompt, alike
    variance, mean = probs.var(dim=1, unbiased=False), probs.mean(dim=1)
    # the oracle disagrees with the ensemble more often where the members disagree
    flip = torch.rand(80, generator=g, dtype=torch.float64).repeat_interleave(2) < 0.1 + 4 * variance
    labels = ((mean >= 0.5) ^ flip).long()
    prompts = torch.arange(80).repeat_interleave(2)
    report = build_report(probs, labels, prompts, n_boot=400, seed=0)
    var_np, err_np = variance.numpy(), flip.numpy().astype(float)
    assert report["top10_lift"] == pytest.approx(_lift(var_np, err_np), abs=1e-12)

    def lift_of(prompt_draw):
        items = np.concatenate([2 * prompt_draw, 2 * prompt_draw + 1])
        return _lift(var_np[items], err_np[items])

    ref = bootstrap(
        (np.arange(80),), lift_of, n_resamples=20000, method="percentile", vectorized=False, random_state=1
    ).confidence_interval
    band = report["bands"]["top10_lift"]
    assert (band["low"], band["high"]) == pytest.approx((ref.low, ref.high), abs=0.15)


def test_error_rate_curve_hand_computed_and_ties_broken_by_item_order():
    scores = torch.tensor([1.0, 5.0, 5.0, 3.0, 2.0, 4.0, 0.0, 5.0, 1.0, 2.0])
    errors = torch.tensor([0, 1, 0, 1, 0, 0, 1, 1, 0, 0])
    # descending stable order: items 1, 2, 7 (score 5), 5, 3, 4, 9, 0, 8, 6
    # errors in that order:     1, 0, 1,            0, 1, 0, 0, 0, 0, 1
    got = error_rate_curve(scores, errors, [0.1, 0.2, 0.3, 0.5, 1.0])
    expected = torch.tensor([1 / 1, 1 / 2, 2 / 3, 3 / 5, 4 / 10], dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-15)
    assert got.dtype == torch.float64


# ----------------------------------------------------------------------------------------------------------------------
# variance summary
# ----------------------------------------------------------------------------------------------------------------------


def test_variance_summary_matches_numpy():
    rng = np.random.default_rng(7)
    v = rng.gamma(0.6, 0.01, size=1001)
    e = rng.random(1001) < 0.25
    out = variance_summary(torch.tensor(v, dtype=torch.float32), torch.tensor(e))
    v32 = v.astype(np.float32).astype(np.float64)  # the float32 input is widened to float64 inside
    assert out["mean"] == pytest.approx(v32.mean(), rel=1e-12)
    assert out["median"] == pytest.approx(np.median(v32), rel=1e-12)
    assert out["variance"] == pytest.approx(np.var(v32), rel=1e-10)
    assert out["std"] == pytest.approx(np.std(v32), rel=1e-10)
    assert out["max"] == pytest.approx(v32.max(), rel=0) and out["min"] == pytest.approx(v32.min(), rel=0)
    for p in (25, 75, 90, 95, 99):
        assert out[f"p{p}"] == pytest.approx(np.percentile(v32, p), rel=1e-12), p
    assert out["fraction_above_threshold"] == pytest.approx(np.mean(v32 > 0.02), abs=1e-15)
    assert out["threshold"] == 0.02
    assert out["mean_when_error"] == pytest.approx(v32[e].mean(), rel=1e-12)
    assert out["mean_when_correct"] == pytest.approx(v32[~e].mean(), rel=1e-12)
    assert all(type(x) is float for x in out.values())


def test_variance_summary_even_count_median_interpolates_and_no_errors_keys():
    out = variance_summary(torch.tensor([0.04, 0.01, 0.03, 0.02], dtype=torch.float64))
    assert out["median"] == pytest.approx(0.025, abs=1e-15)  # not torch.median's lower middle 0.02
    assert out["fraction_above_threshold"] == 0.5  # 0.02 itself is not above
    assert "mean_when_error" not in out and "mean_when_correct" not in out
    one_group = variance_summary(torch.tensor([0.01, 0.02], dtype=torch.float64), torch.tensor([0, 0]))
    assert math.isnan(one_group["mean_when_error"]) and one_group["mean_when_correct"] == pytest.approx(0.015)


# ----------------------------------------------------------------------------------------------------------------------
# prompt bootstrap
# ----------------------------------------------------------------------------------------------------------------------


def test_prompt_bootstrap_deterministic_for_a_seed():
    probs, labels, prompts = _random_inputs(n=200, n_prompts=40)
    x = probs.mean(dim=1)

    def stat(idx):
        return torch.stack([x[idx].mean(), x[idx].std()])

    a = prompt_bootstrap(stat, prompts, n_boot=100, seed=11)
    b = prompt_bootstrap(stat, prompts, n_boot=100, seed=11)
    c = prompt_bootstrap(stat, prompts, n_boot=100, seed=12)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert a[0].shape == (2,) and a[0].dtype == torch.float64
    assert bool((a[0] < a[1]).all())


def test_prompt_bootstrap_band_is_the_prompt_level_normal_band_on_a_clear_case():
    """100 prompts of 5 items whose correctness is mostly the prompt's (an easy or hard prompt, 10% of items flipped):
    the 95% percentile band of the mean is about ``point ± 1.96·SE`` with SE the plug-in standard error of the 100
    prompt means (0.0331 here), not of the 500 items (0.0192): resampling items instead of prompts, or another
    level, lands outside 0.25 SE of it."""
    gen = torch.Generator().manual_seed(0)
    prompts = torch.arange(100).repeat_interleave(5)
    easy = (torch.rand(100, generator=gen) < 0.8).double().repeat_interleave(5)
    correct = (easy - (torch.rand(500, generator=gen) < 0.1).double()).abs()
    point, se = correct.mean(), correct.view(100, 5).mean(1).std(unbiased=False) / 10
    assert float(se) == pytest.approx(0.0331415, rel=1e-4) and float(point) == pytest.approx(0.758)
    low, high = prompt_bootstrap(lambda idx: correct[idx].mean(), prompts, n_boot=2000, seed=0)
    assert low.shape == () and high.shape == ()
    assert float(low) == pytest.approx(float(point - 1.959964 * se), abs=0.25 * float(se))
    assert float(high) == pytest.approx(float(point + 1.959964 * se), abs=0.25 * float(se))


def test_prompt_bootstrap_resamples_whole_prompts():
    # Prompt sizes 1, 2, 3, 4: in every replicate each drawn prompt enters whole, once per draw, 4 draws in total.
    prompts = torch.tensor([10, 20, 20, 30, 30, 30, 40, 40, 40, 40])
    seen = []

    def stat(idx):
        seen.append(idx.clone())
        return idx.double().mean()

    prompt_bootstrap(stat, prompts, n_boot=50, seed=1)
    assert len(seen) == 50
    sizes = {10: 1, 20: 2, 30: 3, 40: 4}  # prompt id -> number of items (checked below through the multiplicities)
    for idx in seen:
        mult = torch.bincount(idx, minlength=10)
        draws = 0
        for pid in sizes:
            m = mult[prompts == pid]
            assert bool((m == m[0]).all()), "items of one prompt must be drawn together"
            draws += int(m[0])
        assert draws == 4
    assert len({tuple(i.tolist()) for i in seen}) > 5  # replicates differ


def test_prompt_bootstrap_band_is_prompt_level():
    # Two prompts of 3 items: all errors in prompt 0, none in prompt 1. Resampling prompts gives error rates
    # 0, 1/2, 1 with probabilities 1/4, 1/2, 1/4, so the 95% band is [0, 1] and the central 40% band is [1/2, 1/2].
    # (Resampling items instead would give multiples of 1/6 and a 95% band of about [1/6, 5/6].)
    errors = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    prompts = torch.tensor([0, 0, 0, 1, 1, 1])
    low, high = prompt_bootstrap(lambda idx: errors[idx].mean(), prompts, n_boot=2000, seed=0)
    assert (low.item(), high.item()) == (0.0, 1.0)
    low, high = prompt_bootstrap(lambda idx: errors[idx].mean(), prompts, n_boot=2000, seed=0, level=0.4)
    assert (low.item(), high.item()) == (0.5, 0.5)


def test_prompt_bootstrap_rejects_bad_arguments():
    with pytest.raises(ValueError, match="groups"):
        prompt_bootstrap(lambda idx: idx.double().mean(), torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match="n_boot"):
        prompt_bootstrap(lambda idx: idx.double().mean(), torch.tensor([0, 1]), n_boot=0)
    with pytest.raises(ValueError, match="level"):
        prompt_bootstrap(lambda idx: idx.double().mean(), torch.tensor([0, 1]), level=1.0)


# ----------------------------------------------------------------------------------------------------------------------
# build_report
# ----------------------------------------------------------------------------------------------------------------------


def _hand_case():
    """10 triplets, 4 members with probabilities a - d, a - d, a + d, a + d (dyadic, so exact in floating point).

    Mean a, population variance d^2 with d increasing by row, so the variance deciles are the rows in order.
    """
    a64 = torch.tensor([56, 48, 20, 44, 16, 40, 24, 36, 28, 32], dtype=torch.float64)  # a = a64 / 64
    d64 = torch.arange(1, 11, dtype=torch.float64)
    probs = torch.stack([a64 - d64, a64 - d64, a64 + d64, a64 + d64], dim=1) / 64
    # ensemble predicts a >= 1/2: [1,1,0,1,0,1,0,1,0,1] (row 9 is a tie at exactly 1/2 -> 1); errors at rows 7, 9
    labels = torch.tensor([1, 1, 0, 1, 0, 1, 0, 0, 0, 0])
    prompts = torch.tensor([5, 5, 9, 9, 2, 2, 7, 7, 1, 1])
    return probs, labels, prompts


def test_build_report_hand_built_case():
    probs, labels, prompts = _hand_case()
    r = build_report(probs, labels, prompts, n_boot=0)
    assert REQUIRED_KEYS <= set(r)
    assert "bands" not in r
    assert r["n_pairs"] == 10 and r["n_prompts"] == 5 and r["n_members"] == 4 and r["n_errors"] == 2
    assert r["ensemble_accuracy"] == pytest.approx(0.8, abs=1e-15)
    assert r["overall_error_rate"] == pytest.approx(0.2, abs=1e-15)
    # members 0, 1 predict a - d >= 1/2 -> exactly the labels; members 2, 3 predict a + d >= 1/2 -> wrong at 7, 8, 9
    assert r["member_accuracy"] == pytest.approx([1.0, 1.0, 0.7, 0.7], abs=1e-15)
    assert r["decile_accuracy"] == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    assert r["top10_error_rate"] == 1.0  # the top-variance row 9 is an error
    # variance: errors at ranks 8 and 10 of 10 -> (7 + 8) / 16 pairs
    assert r["auroc"]["variance"] == pytest.approx(15 / 16, abs=1e-15)
    # decision uncertainty (x16): [2,4,5,5,4,6,6,7,7,8]; error 8 beats all 8, error 7 beats 7 and ties one
    assert r["auroc"]["decision_uncertainty"] == pytest.approx(15.5 / 16, abs=1e-15)
    jsd = ensemble_jsd(probs)
    errors = np.array([0, 0, 0, 0, 0, 0, 0, 1, 0, 1])
    assert r["auroc"]["jsd"] == pytest.approx(roc_auc_score(errors, jsd.numpy()), abs=1e-12)
    assert r["top10_error_rate_by_score"]["decision_uncertainty"] == 1.0
    variance = (torch.arange(1, 11, dtype=torch.float64) / 64) ** 2
    assert r["variance_summary"]["mean"] == pytest.approx(variance.mean().item(), rel=1e-12)
    assert r["variance_summary"]["max"] == pytest.approx((10 / 64) ** 2, rel=1e-12)
    assert r["variance_summary"]["mean_when_error"] == pytest.approx(((8 / 64) ** 2 + (10 / 64) ** 2) / 2, rel=1e-12)
    p_bar = (probs.mean(dim=1)).numpy()
    y = labels.numpy()
    nll = -np.mean(y * np.log(p_bar) + (1 - y) * np.log(1 - p_bar))
    assert r["ensemble_nll"] == pytest.approx(nll, rel=1e-12)
    p0 = probs[:, 0].numpy()
    assert r["member_nll"][0] == pytest.approx(-np.mean(y * np.log(p0) + (1 - y) * np.log(1 - p0)), rel=1e-12)
    assert r["error_rate_curve"]["variance"][-1] == pytest.approx(0.2, abs=1e-15)
    assert r["error_rate_curve"]["fractions"][9] == 0.1
    assert r["error_rate_curve"]["variance"][9] == 1.0
    assert r["error_rate_curve"]["variance"][29] == pytest.approx(2 / 3, abs=1e-15)  # top 3 rows 9, 8, 7
    json.dumps(r, allow_nan=False)


def test_build_report_tie_at_half_predicts_preferred():
    probs = torch.tensor([[0.5, 0.5], [0.25, 0.75], [0.5, 0.5]])
    r = build_report(probs, torch.tensor([1, 1, 0]), torch.tensor([0, 1, 2]), n_boot=0)
    assert r["ensemble_accuracy"] == pytest.approx(2 / 3)
    assert r["member_accuracy"] == pytest.approx([1 / 3, 2 / 3])


def test_build_report_bands_bracket_estimates_and_are_json_safe():
    probs, labels, prompts = _random_inputs(n=600, n_prompts=120, seed=1)
    r = build_report(probs, labels, prompts, n_boot=60, seed=3)
    bands = r["bands"]
    assert bands["n_boot"] == 60 and bands["level"] == 0.95
    lo, hi = bands["ensemble_accuracy"]["low"], bands["ensemble_accuracy"]["high"]
    assert lo < r["ensemble_accuracy"] < hi
    assert bands["overall_error_rate"]["low"] == pytest.approx(1 - hi)
    for name in ("variance", "decision_uncertainty", "jsd"):
        assert bands["auroc"]["low"][name] < r["auroc"][name] < bands["auroc"]["high"][name]
        assert len(bands["error_rate_curve"]["low"][name]) == len(r["error_rate_curve"]["fractions"])
    assert len(bands["decile_accuracy"]["low"]) == 10
    assert all(low <= high for low, high in zip(bands["decile_accuracy"]["low"], bands["decile_accuracy"]["high"]))
    again = build_report(probs, labels, prompts, n_boot=60, seed=3)
    assert again["bands"] == bands
    json.dumps(json_safe(r), allow_nan=False)


def test_json_safe_replaces_nan():
    # row 0: spread 0.25, mean 0.5 -> predicts 1, label 1 (correct); row 1: spread 0.125, mean 0.25 -> error
    probs = torch.tensor([[0.25, 0.75], [0.125, 0.375]], dtype=torch.float64)
    r = build_report(probs, torch.tensor([1, 1]), torch.tensor([0, 0]), n_boot=0)
    assert math.isnan(r["decile_accuracy"][5])
    safe = json_safe(r)
    assert safe["decile_accuracy"][:3] == [0.0, 1.0, None]  # lowest variance (the error) first
    assert safe["variance_summary"]["mean_when_error"] == r["variance_summary"]["mean_when_error"]
    json.dumps(safe, allow_nan=False)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"labels": torch.tensor([1, 0, 1])}, "labels"),
        ({"prompt_ids": torch.tensor([0, 1])}, "prompt_ids"),
        ({"member_probs": torch.empty(0, 3)}, "member_probs"),
        ({"member_probs": torch.rand(4)}, "member_probs"),
        ({"member_probs": torch.tensor([[0.2, 1.5]] * 4)}, "member_probs"),
        ({"labels": torch.tensor([1, 0, 2, 1])}, "labels"),
        ({"prompt_ids": torch.tensor([], dtype=torch.long)}, "prompt_ids"),
    ],
)
def test_build_report_and_figures_reject_bad_input(kwargs, name):
    args = {"member_probs": torch.rand(4, 3), "labels": torch.tensor([1, 0, 1, 1]), "prompt_ids": torch.arange(4)}
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        build_report(**args, n_boot=0)
    with pytest.raises(ValueError, match=name):
        make_figures(**args, n_boot=0)


@pytest.mark.parametrize(
    ("fn", "args"),
    [
        (error_auroc, ()),
        (roc_curve_points, ()),
        (top_fraction_error_rate, ()),
        (error_rate_curve, ([0.5],)),
    ],
)
def test_score_functions_reject_mismatched_or_empty(fn, args):
    with pytest.raises(ValueError, match="errors"):
        fn(torch.rand(5), torch.tensor([0, 1, 0]), *args)
    with pytest.raises(ValueError, match="scores"):
        fn(torch.tensor([]), torch.tensor([], dtype=torch.long), *args)
    with pytest.raises(ValueError, match="scores"):
        fn(torch.tensor([0.1, float("nan")]), torch.tensor([0, 1]), *args)
    with pytest.raises(ValueError, match="errors"):
        fn(torch.rand(3), torch.tensor([0, 2, 1]), *args)


def test_fraction_validation():
    with pytest.raises(ValueError, match="fractions"):
        error_rate_curve(torch.rand(5), torch.tensor([0, 1, 0, 1, 1]), [0.0, 0.5])
    with pytest.raises(ValueError, match="fractions"):
        top_fraction_error_rate(torch.rand(5), torch.tensor([0, 1, 0, 1, 1]), fraction=1.5)
    with pytest.raises(ValueError, match="correct"):
        decile_accuracy(torch.rand(5), torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="variance"):
        variance_summary(torch.tensor([]))
    with pytest.raises(ValueError, match="errors"):
        variance_summary(torch.rand(3), torch.tensor([0, 1]))


# ----------------------------------------------------------------------------------------------------------------------
# figures
# ----------------------------------------------------------------------------------------------------------------------


def test_make_figures_draws_the_three_figures():
    from matplotlib.figure import Figure

    probs, labels, prompts = _random_inputs(n=300, n_prompts=50)
    report = build_report(probs, labels, prompts, n_boot=20)
    figures = make_figures(probs, labels, prompts, n_boot=0)
    assert set(figures) == {"decile_accuracy", "roc_curves", "error_rate_vs_fraction"}
    assert all(isinstance(f, Figure) for f in figures.values())
    roc_axes = figures["roc_curves"].axes[0]
    assert len(roc_axes.lines) == 4  # three scores and the diagonal
    with pytest.raises(ValueError, match="n_pairs"):
        make_figures(probs[:10], labels[:10], prompts[:10], report=report)
