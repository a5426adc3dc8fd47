"""The Stackelberg paper's preference-optimisation baselines (App. G.4) as plain tensor functions.

* NLHF, Nash-MD-PG (Munos et al., 2024): the policy π_θ plays against the geometric mixture
  ``π^β ∝ π_θ^{1−β} μ^β`` of itself and the reference μ, regularised by ``τ·KL(π_θ ‖ μ)``;
  :func:`geometric_mixture_logprobs` gives the mixture's next-token distribution and
  :func:`nash_md_pg_surrogate_loss` the policy-gradient estimate.
* SLHF (Pásztor et al., 2026) with one frozen preference model P0: the Stackelberg paper's App. F states that
  deep-SMIDA with ``u(x, y, y′) = P0(y′ ≻ y | x)`` is the regularised SLHF objective in minimisation form;
  :func:`slhf_surrogate_losses` takes P0's leader-first probabilities and returns both players' losses.
"""

from __future__ import annotations

import torch
from torch import Tensor

from alignment_games.modules.algorithms.smida_estimators import smida_surrogate_losses

# the baseline of a player with one sample a step (D = 1 or M = 1): the value ½ of the symmetric preference game
SLHF_SINGLE_BASELINE = 0.5

__all__ = ["check_preferences", "geometric_mixture_logprobs", "nash_md_pg_surrogate_loss", "slhf_surrogate_losses"]


def check_preferences(name: str, p: Tensor) -> None:
    """Refuse preference probabilities that are not finite numbers in [0, 1], naming ``name`` and the first row.

    Raises:
        ValueError: naming ``name``, the first offending flat index and its value.
    """
    bad = ~(torch.isfinite(p) & (p >= 0) & (p <= 1))
    if bool(bad.any()):
        i = int(bad.reshape(-1).nonzero()[0])
        raise ValueError(f"{name} must be probabilities in [0, 1]; entry {i} is {float(p.reshape(-1)[i])}")


def geometric_mixture_logprobs(logp_policy: Tensor, logp_reference: Tensor, beta: float) -> Tensor:
    """Next-token log-probabilities of the geometric mixture ``π^β(·) ∝ π(·)^{1−β} μ(·)^β`` (Munos et al., §7).

    Nash-MD-PG forms the mixture one token at a time (the "one-step-at-a-time" regularised policy): each step's
    distribution is the normalised geometric mixture of the two models' next-token distributions given the same
    prefix. ``β = 0`` is the policy, ``β = 1`` the reference. Both inputs are log-probabilities over the last dim
    (already tempered when sampling at a temperature); ``−inf`` (a token one model excludes) stays excluded unless
    its weight is 0.

    Raises:
        ValueError: when ``beta`` is not in [0, 1] or the shapes differ.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta (the mixture's weight on the reference) must be in [0, 1], got {beta}")
    if logp_policy.shape != logp_reference.shape:
        raise ValueError(
            f"logp_policy and logp_reference must share a shape, got {tuple(logp_policy.shape)} and "
            f"{tuple(logp_reference.shape)}"
        )
    # 0·(−inf) would be NaN: a weight of 0 drops that model's term entirely
    if beta == 0.0:
        mixed = logp_policy
    elif beta == 1.0:
        mixed = logp_reference
    else:
        mixed = (1.0 - beta) * logp_policy + beta * logp_reference
    return torch.log_softmax(mixed, dim=-1)


def nash_md_pg_surrogate_loss(
    preference: Tensor, logp_policy: Tensor, logp_reference: Tensor, tau: float, baseline: float = 0.5
) -> dict[str, Tensor]:
    """Surrogate loss whose gradient is minus the Nash-MD-PG estimate (Munos et al., 2024, §7).

    For ``y ~ π_θ(·|x)`` and ``y′ ~ π^β(·|x)`` (the mixture, held fixed: no gradient flows through the opponent),
    the estimate of ``∇_θ [P(π_θ ≻ π^β) − τ KL(π_θ ‖ μ)]`` is
    ``(P(y ≻ y′ | x) − b − τ log(π_θ(y|x) / μ(y|x))) ∇_θ log π_θ(y|x)``, with the constant baseline ``b = ½``
    that Munos et al. use (it is the preference of a policy against itself; any constant keeps the estimate
    unbiased since ``E[∇ log π_θ] = 0``). Samples are rows of any shape; the loss is the mean over them.

    Args:
        preference: ``P(y ≻ y′ | x)`` of the frozen preference model, the policy's response first.
        logp_policy: ``log π_θ(y | x)`` with gradients (same shape).
        logp_reference: ``log μ(y | x)`` (same shape).
        tau: τ, the KL weight (> 0).
        baseline: b.

    Returns:
        ``loss`` (to minimise) and detached diagnostics: ``win_rate`` (mean preference), ``kl`` (Monte Carlo KL to μ),
        ``advantage`` (the per-sample weights).

    Raises:
        ValueError: for mismatched shapes, preferences outside [0, 1] or a non-positive ``tau``.
    """
    if preference.shape != logp_policy.shape or preference.shape != logp_reference.shape:
        raise ValueError(
            f"preference, logp_policy and logp_reference must share a shape, got {tuple(preference.shape)}, "
            f"{tuple(logp_policy.shape)}, {tuple(logp_reference.shape)}"
        )
    if not tau > 0:
        raise ValueError(f"tau must be positive, got {tau}")
    check_preferences("preference", preference.detach())
    log_ratio = (logp_policy - logp_reference).detach()
    advantage = preference.detach() - baseline - tau * log_ratio
    return {
        "loss": -(advantage * logp_policy).mean(),
        "win_rate": preference.detach().mean(),
        "kl": log_ratio.mean(),
        "advantage": advantage,
    }


def slhf_surrogate_losses(
    preference: Tensor,
    logp_leader: Tensor,
    logp_leader_ref: Tensor,
    logp_follower: Tensor,
    logp_follower_ref: Tensor,
    tau_leader: float,
    tau_follower: float,
) -> dict[str, Tensor]:
    """SLHF's two-timescale updates against one frozen preference model P0, as the Stackelberg paper states them.

    App. F: ``u(x, y, y′) = P0(y′ ≻ y | x)`` in the game ``min_π max_ω E[u] + τ_L KL(π‖π_ref) − τ_F KL(ω‖ω_ref)``
    recovers the regularised SLHF objective (the Leader maximises the chance that its answer beats the Follower's
    refinement; the Follower, seeing it, maximises the chance of beating it). The estimators are deep-SMIDA's
    (22)–(25) with leave-one-out baselines (:func:`smida_surrogate_losses`); the learning rates are the two
    timescales (Follower faster, App. C.2). The Stackelberg paper gives no other form of StackelbergGDA's updates,
    so this is the one implemented.

    At Table 3's budget (two responses a prompt: one Leader answer, D = 1, and one Follower refinement, M = 1) the
    leave-one-out baselines are undefined; a player with one sample takes the constant baseline ½ instead, the value
    of the symmetric game (``P0(y ≻ y) = ½``) and the constant Munos et al. use in Nash-MD-PG. A constant keeps the
    estimate unbiased (``E[∇ log π] = 0``); with D, M ≥ 2 the leave-one-out baselines are used as before.

    Args:
        preference: ``P0(y ≻ y′ | x)``, the leader's response first, ``[B, D, M]``.
        logp_leader: ``log π_θ(y | x)`` with gradients, ``[B, D]``.
        logp_leader_ref: ``log π_ref(y | x)``, ``[B, D]``.
        logp_follower: ``log ω_φ(y′ | x, y)`` with gradients, ``[B, D, M]``.
        logp_follower_ref: ``log ω_ref(y′ | x, y)``, ``[B, D, M]``.
        tau_leader: τ_L.
        tau_follower: τ_F.

    Returns:
        :func:`smida_surrogate_losses`' dict, with ``leader_win_rate`` (mean ``P0(y ≻ y′)``) added.

    Raises:
        ValueError: for preferences outside [0, 1] (and the shape errors of the SMIDA estimators).
    """
    check_preferences("preference", preference.detach())
    out = smida_surrogate_losses(
        1.0 - preference,
        logp_leader,
        logp_leader_ref,
        logp_follower,
        logp_follower_ref,
        tau_leader,
        tau_follower,
        single_baseline=SLHF_SINGLE_BASELINE,
    )
    out["leader_win_rate"] = preference.detach().mean()
    return out
