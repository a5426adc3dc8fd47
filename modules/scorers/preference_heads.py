"""The heads of the preference ensemble: general preference models (App. E.2, eq. 27) and Bradley–Terry rewards."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def skew_symmetric_block_matrix(d: int) -> Tensor:
    """The fixed ``J``: ``d/2`` blocks ``[[0, 1], [-1, 0]]`` on the diagonal.

    Raises:
        ValueError: for an odd or non-positive ``d``.
    """
    if d <= 0 or d % 2:
        raise ValueError(f"embed_dim must be a positive even number, got {d}")
    j, idx = torch.zeros(d, d), torch.arange(0, d, 2)
    j[idx, idx + 1] = 1.0
    j[idx + 1, idx] = -1.0
    return j


def _member_weights(seeds: list[int], rows: int, hidden_size: int) -> Tensor:
    """``[k, rows, H]``: one N(0, 1/H) matrix per member, each from its own seed."""
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    return torch.stack([torch.randn(rows, hidden_size, generator=g) / math.sqrt(hidden_size) for g in gens])


class GPMHead(nn.Module):
    """``k`` GPM heads at once: ``W_i`` (bias-free, ``d × H``), shared fixed ``J``, scales ``λ_i = softplus(ρ_i)``.

    Args:
        hidden_size: Width ``H`` of the pooled representation.
        num_members: ``k``.
        embed_dim: ``d`` (even).
        init_scale: Initial ``λ``; the logit ``λ⟨Jz, z′⟩`` lies in ``[−λ, λ]``, so λ bounds the confidence.
        seeds: One seed per member for an independent initialisation of its head.
    """

    def __init__(self, hidden_size: int, num_members: int, embed_dim: int, init_scale: float, seeds: list[int]):
        super().__init__()
        self.weight = nn.Parameter(_member_weights(seeds, embed_dim, hidden_size))  # [k, d, H]
        rho = math.log(math.expm1(init_scale))  # softplus^{-1}
        self.rho = nn.Parameter(torch.full((num_members,), rho))
        self.register_buffer("J", skew_symmetric_block_matrix(embed_dim), persistent=False)

    def scale(self) -> Tensor:
        """λ, one per member, positive."""
        return F.softplus(self.rho)

    def embed(self, h: Tensor, member: int | None = None) -> Tensor:
        """``z``: ``[k, N, d]`` for all members, or ``[N, d]`` for one."""
        w = self.weight if member is None else self.weight[member]
        z = torch.einsum("...dh,nh->...nd", w, h.to(w.dtype))
        return F.normalize(z, dim=-1)

    def logits(self, za: Tensor, zb: Tensor, member: int | None = None) -> Tensor:
        """``λ_i ⟨J z_a, z_b⟩`` from embeddings ``[k, B, d]`` (→ ``[B, k]``) or ``[B, d]`` of one member (→ ``[B]``)."""
        bilinear = ((za @ self.J.T) * zb).sum(-1)
        return (self.scale()[:, None] * bilinear).T if member is None else self.scale()[member] * bilinear


class BTHead(nn.Module):
    """``k`` Bradley–Terry heads: scalar rewards ``r_i = w_i·h``, ``P_i = σ(r_i(a) − r_i(b))`` (antisymmetric too)."""

    def __init__(self, hidden_size: int, num_members: int, seeds: list[int]):
        super().__init__()
        self.weight = nn.Parameter(_member_weights(seeds, 1, hidden_size))  # [k, 1, H]

    def embed(self, h: Tensor, member: int | None = None) -> Tensor:
        """``r``: ``[k, N, 1]`` for all members, or ``[N, 1]`` for one."""
        w = self.weight if member is None else self.weight[member]
        return torch.einsum("...dh,nh->...nd", w, h.to(w.dtype))

    def logits(self, za: Tensor, zb: Tensor, member: int | None = None) -> Tensor:
        """``r_i(a) − r_i(b)``: ``[B, k]`` from ``[k, B, 1]``, or ``[B]`` for one member."""
        diff = (za - zb).squeeze(-1)
        return diff.T if member is None else diff
