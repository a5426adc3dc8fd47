"""The §5.3.2 ε-sweep (Fig. 2b) on oracle labels: with the paper's 11 queries per triplet, ε = 0, 0.1, 0.2 and 0.3
select four different sets of triplets; with 3 queries they collapse to two. The shipped evaluation configs build
their oracle from their own ``num_queries``, so a config that asks too few fails here."""

import inspect
import os

import pytest
import torch
import yaml
from helpers import ROOT
from lightning.pytorch.cli import instantiate_class

from alignment_games.modules.deep_smida import DeepSMIDA
from alignment_games.modules.evaluation.game_eval import adversarial_report
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
