"""Deep-SMIDA policy-gradient estimators, eqs. (22)–(25) (App. D): B contexts × D leader × M follower samples."""

from __future__ import annotations

import torch
from torch import Tensor


def leave_one_out_baseline(values: Tensor, dim: int = -1, single: float | None = None) -> Tensor:
    """``b_{-j} = (n − 1)^{-1} Σ_{k≠j} v_k`` along ``dim`` (Kool et al., 2019); ``single``: a lone sample's constant.

    Raises:
        ValueError: when fewer than two samples lie along ``dim`` and ``single`` is ``None``.
    """
    n = values.shape[dim]
    if n == 1 and single is not None:
        return torch.full_like(values, single)
    if n < 2:
        raise ValueError(f"leave-one-out baselines need at least 2 samples along dim {dim}, got {n}")
    return (values.sum(dim=dim, keepdim=True) - values) / (n - 1)


def follower_advantages(
    utility: Tensor,
    logp_follower: Tensor,
    logp_follower_ref: Tensor,
    tau_follower: float,
    single_baseline: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Eq. (22)–(23): ``A = u − τ_F log(ω_φ/ω_ref)`` ``[B, D, M]``, its mean ``Ā^l`` ``[B, D]``, ``A − b^F_{−j}``."""
    if utility.shape != logp_follower.shape or utility.shape != logp_follower_ref.shape or utility.ndim != 3:
        raise ValueError(
            f"utility, logp_follower and logp_follower_ref must share a [B, D, M] shape, got {tuple(utility.shape)}, "
            f"{tuple(logp_follower.shape)}, {tuple(logp_follower_ref.shape)}"
        )
    a = utility - tau_follower * (logp_follower.detach() - logp_follower_ref.detach())
    return a, a.mean(dim=-1), a - leave_one_out_baseline(a, dim=-1, single=single_baseline)


def leader_advantages(
    a_bar: Tensor, logp_leader: Tensor, logp_leader_ref: Tensor, tau_leader: float, single_baseline: float | None = None
) -> Tensor:
    """Eq. (24)–(25): ``L^l = Ā^l + τ_L log(π_θ/π_ref)`` and ``L^l − b^L_{−l}``, shape ``[B, D]``."""
    if a_bar.shape != logp_leader.shape or a_bar.shape != logp_leader_ref.shape or a_bar.ndim != 2:
        raise ValueError(
            f"a_bar, logp_leader and logp_leader_ref must share a [B, D] shape, got {tuple(a_bar.shape)}, "
            f"{tuple(logp_leader.shape)}, {tuple(logp_leader_ref.shape)}"
        )
    lead = a_bar + tau_leader * (logp_leader.detach() - logp_leader_ref.detach())
    return lead - leave_one_out_baseline(lead, dim=-1, single=single_baseline)


def smida_surrogate_losses(
    utility: Tensor,
    logp_leader: Tensor,
    logp_leader_ref: Tensor,
    logp_follower: Tensor,
    logp_follower_ref: Tensor,
    tau_leader: float,
    tau_follower: float,
    single_baseline: float | None = None,
) -> dict[str, Tensor]:
    """Surrogate losses whose gradients are the deep-SMIDA estimators (23) and (25), both minimised.

    ``logp_leader`` ``[B, D]`` and ``logp_follower`` ``[B, D, M]`` carry gradients. ``single_baseline``: the constant
    baseline of a player with one sample (D = 1 or M = 1); ``None`` refuses one (Algorithm 2 asks D, M ≥ 2). Returns the
    losses and detached ``a_bar``, ``leader_kl``, ``follower_kl``, ``utility_mean``.
    """
    a, a_bar, adv_f = follower_advantages(utility, logp_follower, logp_follower_ref, tau_follower, single_baseline)
    adv_l = leader_advantages(a_bar, logp_leader, logp_leader_ref, tau_leader, single_baseline)
    return {
        "leader_loss": (adv_l.detach() * logp_leader).mean(),
        "follower_loss": -(adv_f.detach() * logp_follower).mean(),
        "a_bar": a_bar.detach(),
        "leader_kl": (logp_leader - logp_leader_ref).detach().mean(),
        "follower_kl": (logp_follower - logp_follower_ref).detach().mean(),
        "utility_mean": utility.detach().mean(),
    }
