"""Deep-SMIDA policy-gradient estimators, eqs. (22)–(25) of the Stackelberg preference-games paper (App. D).

Rollouts per step: B contexts × D leader samples × M follower samples per leader sample. From utilities and
sequence log-probabilities these return the advantages of the estimators and surrogate losses whose gradients they are.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["follower_advantages", "leader_advantages", "leave_one_out_baseline", "smida_surrogate_losses"]


def leave_one_out_baseline(values: Tensor, dim: int = -1, single: float | None = None) -> Tensor:
    """``b_{-j} = (n − 1)^{-1} Σ_{k≠j} v_k`` along ``dim`` (Kool et al., 2019).

    Args:
        values: The per-sample values.
        dim: The dimension of the samples.
        single: The baseline of a lone sample (``n = 1``, where the leave-one-out mean is undefined): a constant, so
            the estimator stays unbiased; ``None`` refuses a lone sample.

    Raises:
        ValueError: when fewer than two samples lie along ``dim`` and ``single`` is ``None`` (the baseline is
            undefined).
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
    """Eq. (22)–(23): ``A^{lj} = u − τ_F log(ω_φ/ω_ref)``, ``Ā^l``, and ``A^{lj} − b^F_{−j}``.

    Args:
        utility: ``u(x, y^l, y'^{lj})``, shape ``[B, D, M]``.
        logp_follower: ``log ω_φ(y'^{lj} | x, y^l)``, ``[B, D, M]`` (treated as a constant here).
        logp_follower_ref: ``log ω_ref(y'^{lj} | x, y^l)``, ``[B, D, M]``.
        tau_follower: ``τ_F``.
        single_baseline: ``b^F`` when M = 1 (see :func:`leave_one_out_baseline`); ``None`` refuses M = 1.

    Returns:
        ``(A, A_bar, advantage)`` with shapes ``[B, D, M]``, ``[B, D]``, ``[B, D, M]``.
    """
    if utility.shape != logp_follower.shape or utility.shape != logp_follower_ref.shape or utility.ndim != 3:
        raise ValueError(
            f"utility, logp_follower and logp_follower_ref must share a [B, D, M] shape, got {tuple(utility.shape)}, "
            f"{tuple(logp_follower.shape)}, {tuple(logp_follower_ref.shape)}"
        )
    a = utility - tau_follower * (logp_follower.detach() - logp_follower_ref.detach())
    return a, a.mean(dim=-1), a - leave_one_out_baseline(a, dim=-1, single=single_baseline)


def leader_advantages(
    a_bar: Tensor,
    logp_leader: Tensor,
    logp_leader_ref: Tensor,
    tau_leader: float,
    single_baseline: float | None = None,
) -> Tensor:
    """Eq. (24)–(25): ``L^l = Ā^l + τ_L log(π_θ/π_ref)`` and ``L^l − b^L_{−l}``, shape ``[B, D]``.

    ``single_baseline``: ``b^L`` when D = 1 (see :func:`leave_one_out_baseline`); ``None`` refuses D = 1.
    """
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
    """Surrogate losses whose gradients are the deep-SMIDA estimators (23) and (25).

    Both are minimised: the leader descends ``J^L``, and ``follower_loss = −(estimator)`` makes the follower ascend.

    Args:
        utility: ``[B, D, M]``.
        logp_leader: ``log π_θ(y^l | x)`` with gradients, ``[B, D]``.
        logp_leader_ref: ``log π_ref(y^l | x)``, ``[B, D]``.
        logp_follower: ``log ω_φ(y'^{lj} | x, y^l)`` with gradients, ``[B, D, M]``.
        logp_follower_ref: ``[B, D, M]``.
        tau_leader: ``τ_L``.
        tau_follower: ``τ_F``.
        single_baseline: The constant baseline of a player with one sample (D = 1 or M = 1), where the leave-one-out
            baseline is undefined; ``None`` (deep-SMIDA, whose Algorithm 2 asks D, M ≥ 2) refuses one sample.

    Returns:
        ``leader_loss``, ``follower_loss`` and detached diagnostics: ``a_bar`` (plug-in cost estimates), ``leader_kl``
        and ``follower_kl`` (Monte Carlo KL to the references), ``utility_mean``.
    """
    a, a_bar, adv_f = follower_advantages(utility, logp_follower, logp_follower_ref, tau_follower, single_baseline)
    adv_l = leader_advantages(a_bar, logp_leader, logp_leader_ref, tau_leader, single_baseline)
    follower_loss = -(adv_f.detach() * logp_follower).mean()
    leader_loss = (adv_l.detach() * logp_leader).mean()
    return {
        "leader_loss": leader_loss,
        "follower_loss": follower_loss,
        "a_bar": a_bar.detach(),
        "leader_kl": (logp_leader - logp_leader_ref).detach().mean(),
        "follower_kl": (logp_follower - logp_follower_ref).detach().mean(),
        "utility_mean": utility.detach().mean(),
    }
