import math

import pytest
import torch

from alignment_games.modules.algorithms.disagreement import (
    bernoulli_entropy,
    decision_uncertainty,
    ensemble_jsd,
    ensemble_variance,
)


def _h(p):
    return 0.0 if p in (0.0, 1.0) else -(p * math.log(p) + (1 - p) * math.log(1 - p))


def test_scores_against_direct_formulas():
    g = torch.Generator().manual_seed(0)
    p = torch.rand(50, 5, generator=g, dtype=torch.float64)
    for row, var, du, jsd in zip(p, ensemble_variance(p), decision_uncertainty(p), ensemble_jsd(p)):
        vals = row.tolist()
        mean = sum(vals) / 5
        assert var.item() == pytest.approx(sum((v - mean) ** 2 for v in vals) / 5, abs=1e-15)  # denominator k
        assert du.item() == pytest.approx(0.5 - abs(mean - 0.5), abs=1e-15)
        assert jsd.item() == pytest.approx(_h(mean) - sum(_h(v) for v in vals) / 5, abs=1e-12)


def test_known_values_and_edges():
    p = torch.tensor([[0.0, 1.0], [0.3, 0.3], [0.9, 0.7]], dtype=torch.float64)
    assert ensemble_variance(p).tolist() == pytest.approx([0.25, 0.0, 0.01])
    assert decision_uncertainty(p).tolist() == pytest.approx([0.5, 0.3, 0.2])
    # members at 0 and 1: mean 1/2 carries log 2 nats, the members none
    assert ensemble_jsd(p)[0].item() == pytest.approx(math.log(2), abs=1e-9)
    assert ensemble_jsd(p)[1].item() == pytest.approx(0.0, abs=1e-12)
    assert torch.isfinite(bernoulli_entropy(torch.tensor([0.0, 1.0]))).all()
    # 4·Var is the paper's utility in [0, 1]; the maximum is reached at two members split 0/1
    assert (4 * ensemble_variance(p)).max().item() == pytest.approx(1.0)


def test_empty_member_dimension_raises():
    with pytest.raises(ValueError, match="member"):
        ensemble_variance(torch.zeros(3, 0))
