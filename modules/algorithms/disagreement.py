"""Disagreement of an ensemble's probabilities ``p[..., k]`` that y≻y′ given x, over members (§3.1, App. F.1)."""

from __future__ import annotations

import torch
from torch import Tensor


def _check(p: Tensor) -> None:
    if p.ndim < 1 or p.shape[-1] < 1:
        raise ValueError(
            f"member probabilities must have a non-empty last (member) dimension, got shape {tuple(p.shape)}"
        )


def ensemble_variance(p: Tensor) -> Tensor:
    """Population variance of the members' probabilities, denominator k (App. E.3), ``[...]``."""
    _check(p)
    return p.var(dim=-1, unbiased=False)


def decision_uncertainty(p: Tensor) -> Tensor:
    """Decision uncertainty ``min(P̄, 1 - P̄) = 1/2 - |P̄ - 1/2|`` of the ensemble mean (App. F.1)."""
    _check(p)
    mean = p.mean(dim=-1)
    return torch.minimum(mean, 1.0 - mean)


def bernoulli_entropy(p: Tensor) -> Tensor:
    """Entropy in nats of Bernoulli(p), with ``0 log 0 = 0`` (``xlogy``), so H(0) = H(1) = 0 in any dtype."""
    q = 1.0 - p
    return -(torch.special.xlogy(p, p) + torch.special.xlogy(q, q))


def ensemble_jsd(p: Tensor) -> Tensor:
    """Jensen–Shannon divergence ``H(P̄) - mean_i H(P_i)`` among the members' Bernoulli predictions (App. F.1)."""
    _check(p)
    return (bernoulli_entropy(p.mean(dim=-1)) - bernoulli_entropy(p).mean(dim=-1)).clamp_min(0.0)
