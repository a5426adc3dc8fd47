"""The §5.3.2 ε-sweep (Fig. 2b) on oracle labels: with the paper's 11 queries per triplet, ε = 0, 0.1, 0.2 and 0.3
select four different sets of triplets; with 3 queries they collapse to two. The shipped evaluation configs build
their oracle from their own ``num_queries``, so a config that asks too few fails here."""

import inspect
import math
import os

import numpy as np
import pytest
import torch
import yaml
from helpers import ROOT
from lightning.pytorch.cli import instantiate_class

from alignment_games.modules.deep_smida import DeepSMIDA
from alignment_games.modules.evaluation.game_eval import (
    adversarial_report,
    candidate_yield_intervals,
    compare_pairs,
    reversal_capture,
)
from alignment_games.modules.scorers.oracle import PreferenceOracle

# The configs that run the paper's 11-query evaluations: the ε-sweep (deep-SMIDA, §5.3.2) and the held-out preference
# rates of the round robin's baselines (NLHF and SLHF, App. G.4).
EVALUATION_CONFIGS = [
    "deep_smida.yaml",
    "deep_smida_competent.yaml",
    "deep_smida_small_fo.yaml",
    "deep_smida_smollm2.yaml",
    "nlhf.yaml",
    "nlhf_smollm2.yaml",
    "slhf.yaml",
    "slhf_smollm2.yaml",
]
# The paper's sweep (Fig. 2b, App. G.3): deep-SMIDA's default margins.
PAPER_EPSILONS = (0.0, 0.1, 0.2, 0.3)
# Four triplets whose response a is truly better: P*(a ≻ b) = 6/11, 7/11, 8/11, 9/11, margins |P* − ½| of
# 0.045, 0.136, 0.227, 0.318 (one in each gap of the sweep); the ensemble prefers b on all four (mean 0.2).
P_STAR = (6 / 11, 7 / 11, 8 / 11, 9 / 11)


class Quota(PreferenceOracle):
    """Certain verdicts by hand: row i's response a wins the first ``round(P*_i · num_queries)`` of its queries, b the
    rest, whichever order they are shown in; its label is therefore exactly that count over ``num_queries``."""

    def __init__(self, p_star, **kw):
        super().__init__(**kw)
        self.wins = [round(p * self.num_queries) for p in p_star]
        self.calls = 0

    def first_wins_probability(self, prompts, firsts, seconds, references):
        q, self.calls = self.calls, self.calls + 1
        a_wins = [q < w for w in self.wins]
        return torch.tensor([float((f == "a") == a) for f, a in zip(firsts, a_wins)], dtype=torch.float64)


def _sweep(num_queries: int, epsilons=PAPER_EPSILONS) -> list[float]:
    """The share of the four labelled triplets that are ε-adversarial, for each ε, as deep-SMIDA computes it."""
    oracle = Quota(P_STAR, num_queries=num_queries, seed=0)
    p_star = oracle.label(["x"] * 4, ["a"] * 4, ["b"] * 4).float().view(2, 2)  # float32 [P, R], as in validation
    mean = torch.full((2, 2), 0.2)
    report = adversarial_report(torch.zeros(2, 2), p_star, mean, {}, epsilons, n_boot=10)
    return [report[str(eps)]["adversarial"][0] for eps in epsilons]


def test_the_paper_sweep_is_deep_smida_default():
    assert inspect.signature(DeepSMIDA).parameters["epsilons"].default == PAPER_EPSILONS


def test_eleven_queries_give_four_distinct_points_by_hand():
    # labels 6/11 … 9/11 exactly; each ε drops the triplet whose margin it reaches: 4/4, 3/4, 2/4, 1/4
    assert Quota(P_STAR, num_queries=11).label(["x"] * 4, ["a"] * 4, ["b"] * 4).tolist() == list(P_STAR)
    assert _sweep(11) == [1.0, 0.75, 0.5, 0.25]


def test_three_queries_collapse_the_sweep_to_two_points():
    """With 3 queries a label is 0, 1/3, 2/3 or 1, a margin of 1/6 or 1/2: ε 0 and 0.1 keep the same triplets, as do
    0.2 and 0.3, whatever the triplets. Here every label is 2/3 (round(3 P*) = 2), so the sweep reads 1, 1, 0, 0."""
    assert Quota(P_STAR, num_queries=3).label(["x"] * 4, ["a"] * 4, ["b"] * 4).tolist() == [2 / 3] * 4
    assert _sweep(3) == [1.0, 1.0, 0.0, 0.0]
    margins = [abs(k / 3 - 0.5) for k in range(4)]  # every margin 3 valid verdicts can give
    assert all((m > 0.0) == (m > 0.1) and (m > 0.2) == (m > 0.3) for m in margins)
    assert any((m > 0.1) != (m > 0.2) for m in margins)  # two points, not one


@pytest.mark.parametrize("name", EVALUATION_CONFIGS)
def test_each_evaluation_config_resolves_the_paper_sweep(name):
    """The config's own oracle settings, on the hand-built triplets: four distinct points, 1, 0.75, 0.5, 0.25 (a config
    with 3 queries gives 1, 1, 0, 0 and fails)."""
    with open(os.path.join(ROOT, "configs", name), encoding="utf-8") as f:
        spec = yaml.safe_load(f)["model"]["init_args"]["oracle"]
    num_queries = instantiate_class((), spec).num_queries
    points = _sweep(num_queries)
    assert points == [1.0, 0.75, 0.5, 0.25], f"configs/{name}: {num_queries} queries give the sweep {points}"
    assert num_queries == 11  # the paper's count, not merely one that resolves these four margins


def test_the_evaluation_configs_are_every_config_whose_model_has_an_oracle():
    """So a new config that runs the evaluation cannot escape the check above."""
    found = []
    for name in sorted(os.listdir(os.path.join(ROOT, "configs"))):
        if name.endswith(".yaml"):
            with open(os.path.join(ROOT, "configs", name), encoding="utf-8") as f:
                model = yaml.safe_load(f).get("model") or {}
            if (model.get("init_args") or {}).get("oracle") is not None:
                found.append(name)
    assert found == EVALUATION_CONFIGS


# ----------------------------------------------------------------------------- Fig. 2a's intervals, the reversal share
def test_candidate_yield_intervals_on_two_prompts_by_hand():
    """Two prompts resample to {0, 0}, {0, 1} or {1, 1}. The reference threshold at α = ½ is the resample's median:
    0.5, 1.5 or 2.5; the trained pair's yield is then 1, ½ or 0, and the reference pair's always ½."""
    trained = torch.tensor([[5.0, 5.0], [0.0, 0.0]])
    reference = torch.tensor([[0.0, 1.0], [2.0, 3.0]])
    out = candidate_yield_intervals(trained, reference, [0.5], n_boot=400)
    assert out == {0.5: {"trained": [0.0, 1.0], "reference": [0.5, 0.5]}}
    assert candidate_yield_intervals(trained, reference, [0.5], n_boot=400, chunk=7) == out  # chunks change nothing


def test_candidate_yield_intervals_match_scipy_bootstrap_and_re_estimate_the_threshold():
    """Against scipy's percentile bootstrap over prompt indices (its own resampling), and the threshold is recomputed
    in each resample: a trained pair equal to the reference gets the reference's (narrow) interval, where a fixed
    threshold would give it the wide interval of a plain share."""
    from scipy.stats import bootstrap

    g = torch.Generator().manual_seed(3)
    reference = torch.rand(200, 2, generator=g, dtype=torch.float64)
    trained = reference + 0.3 * torch.rand(200, 2, generator=g, dtype=torch.float64)
    t, r = trained.numpy(), reference.numpy()
    out = candidate_yield_intervals(trained, reference, [0.1, 0.3], n_boot=4000)
    for alpha in (0.1, 0.3):

        def share(idx, alpha=alpha):
            th = np.quantile(r[idx].ravel(), 1 - alpha, method="linear")
            return float((t[idx].ravel() >= th).mean())

        ref_ci = bootstrap((np.arange(200),), share, vectorized=False, n_resamples=4000, method="percentile", rng=1)
        ci = ref_ci.confidence_interval
        assert out[alpha]["trained"] == pytest.approx([ci.low, ci.high], abs=0.006)
        assert ci.high - ci.low > 0.05  # a real width, not a degenerate case
    same = candidate_yield_intervals(reference, reference, [0.1], n_boot=500)[0.1]
    assert same["trained"] == same["reference"] and same["trained"][1] - same["trained"][0] < 0.01


def test_candidate_yield_intervals_refuse_bad_input():
    ok = torch.zeros(3, 2)
    with pytest.raises(ValueError, match=r"\[P, R\] shape, got \(3, 2\) and \(2, 2\)"):
        candidate_yield_intervals(ok, ok[:2], [0.1])
    with pytest.raises(ValueError, match="alpha must be in"):
        candidate_yield_intervals(ok, ok, [1.0])
    with pytest.raises(ValueError, match="n_boot must be at least 1"):
        candidate_yield_intervals(ok, ok, [0.1], n_boot=0)


def test_compare_pairs_reports_the_yield_intervals():
    trained = torch.tensor([[5.0, 5.0], [0.0, 0.0]])
    reference = torch.tensor([[0.0, 1.0], [2.0, 3.0]])
    out = compare_pairs(trained, reference, alphas=(0.5,), n_boot=400)
    assert out["candidate_yield"]["0.5"] == {"trained": 0.5, "reference": 0.5}
    assert out["candidate_yield_ci"] == {"0.5": {"trained": [0.0, 1.0], "reference": [0.5, 0.5]}}


# two prompts × three triplets; the last triplet of prompt 1 has no valid oracle verdict
VARIANCE = torch.tensor([[0.9, 0.2, 0.8], [0.7, 0.1, 0.95]])
P_STAR_2x3 = torch.tensor([[0.9, 0.9, 0.2], [0.3, 0.8, float("nan")]])
P_BAR = torch.tensor([[0.3, 0.2, 0.6], [0.6, 0.9, 0.1]])


def test_reversal_capture_by_hand():
    """Reversals (ε = 0): (0,0), (0,1), (0,2), (1,0); (1,1) agrees, (1,2) is unlabelled. Candidates at threshold 0.75:
    (0,0) and (0,2) (the unlabelled (1,2) does not count): 2 of the 4 reversals. Prompt 0 alone captures 2 of 3,
    prompt 1 alone 0 of 1, so the resamples give 2/3, 2/4 or 0."""
    share, lo, hi = reversal_capture(VARIANCE, P_STAR_2x3, P_BAR, 0.75, n_boot=400)
    assert (share, lo, hi) == (pytest.approx(0.5), pytest.approx(0.0), pytest.approx(2 / 3))
    # ε = 0.35 keeps (0,0) and (0,1), both in prompt 0: 1 of 2 in every resample that has any
    assert reversal_capture(VARIANCE, P_STAR_2x3, P_BAR, 0.75, epsilon=0.35) == pytest.approx((0.5, 0.5, 0.5))
    assert reversal_capture(VARIANCE, P_STAR_2x3, P_BAR, 0.85) == pytest.approx((0.25, 0.0, 1 / 3))  # (0,0) only
    none = reversal_capture(VARIANCE, P_STAR_2x3, P_STAR_2x3.nan_to_num(0.5), 0.75)  # the ensemble agrees everywhere
    assert all(math.isnan(v) for v in none)
    with pytest.raises(ValueError, match=r"share a \[P, R\] shape"):
        reversal_capture(VARIANCE, P_STAR_2x3[:1], P_BAR, 0.75)
    with pytest.raises(ValueError, match="epsilon"):
        reversal_capture(VARIANCE, P_STAR_2x3, P_BAR, 0.75, epsilon=0.5)


def test_adversarial_report_holds_the_captured_share():
    out = adversarial_report(VARIANCE, P_STAR_2x3, P_BAR, {"0.1": 0.75}, epsilons=(0.0,), n_boot=400)["0.0"]
    assert out["captured"]["0.1"] == pytest.approx([0.5, 0.0, 2 / 3])
    # joint count = captured share × reversals = precision × candidates (2 = 0.5 · 4 = 1.0 · 2)
    labelled = 5
    assert out["joint"]["0.1"][0] * labelled == pytest.approx(out["captured"]["0.1"][0] * out["adversarial"][0] * 5)
    assert out["joint"]["0.1"][0] * labelled == pytest.approx(out["precision"]["0.1"][0] * out["candidates"]["0.1"])


def test_candidate_yield_figure_draws_the_bootstrap_bands():
    """Fig. 2(a)'s shading: one band per pair, whose edges are candidate_yield_intervals at the plotted α."""
    from alignment_games.modules.evaluation.figures import make_game_figures

    g = torch.Generator().manual_seed(0)
    reference = torch.rand(20, 2, generator=g, dtype=torch.float64)
    trained = reference + 0.2
    ax = make_game_figures(trained, reference, n_boot=100)["candidate_yield"].axes[0]
    assert len(ax.collections) == 2 and "prompt bootstrap" in ax.get_title()
    grid = torch.linspace(0.01, 0.5, 50, dtype=torch.float64).tolist()
    want = candidate_yield_intervals(trained, reference, grid, n_boot=100)
    top = ax.collections[0].get_paths()[0].vertices  # fill_between's outline: low edge forward, high edge back
    lows = [want[a]["trained"][0] for a in grid]
    assert top[1:51, 1].tolist() == pytest.approx(lows)
    flat = make_game_figures(trained.flatten(), reference.flatten())["candidate_yield"].axes[0]
    assert len(flat.collections) == 0 and "bootstrap" not in flat.get_title()
