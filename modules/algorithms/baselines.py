"""The Stackelberg paper's preference-optimisation baselines (App. G.4) as plain tensor functions.

* NLHF, Nash-MD-PG (Munos et al., 2024): π_θ plays against the geometric mixture ``π^β ∝ π_θ^{1−β} μ^β`` of itself
  and the reference μ, regularised by ``τ·KL(π_θ ‖ μ)``.
* SLHF (Pásztor et al., 2026) with one frozen preference model P0: deep-SMIDA with ``u(x, y, y′) = P0(y′ ≻ y | x)``
  (the Stackelberg paper's App. F).
"""

from __future__ import annotations

import torch
from torch import Tensor

from alignment_games.modules.algorithms.checks import require_in_range, require_positive
from alignment_games.modules.algorithms.smida_estimators import smida_surrogate_losses

# the baseline of a player with one sample a step (D = 1 or M = 1): the value ½ of the symmetric preference game
SLHF_SINGLE_BASELINE = 0.5


def check_preferences(name: str, p: Tensor) -> None:
    """Refuse preference probabilities that are not finite numbers in [0, 1].

    Raises:
        ValueError: naming ``name``, the first offending flat index and its value.
    """
    bad = ~(torch.isfinite(p) & (p >= 0) & (p <= 1))
    if bool(bad.any()):
        i = int(bad.reshape(-1).nonzero()[0])
        raise ValueError(f"{name} must be probabilities in [0, 1]; entry {i} is {float(p.reshape(-1)[i])}")


def geometric_mixture_logprobs(logp_policy: Tensor, logp_reference: Tensor, beta: float) -> Tensor:
    """Next-token log-probabilities of the geometric mixture ``π^β(·) ∝ π(·)^{1−β} μ(·)^β`` (Munos et al., §7).

    Formed one token at a time from both models' next-token distributions given the same prefix; ``β = 0`` is the
    policy, ``β = 1`` the reference. A ``−inf`` one model gives stays excluded unless its weight is 0.

    Raises:
        ValueError: when ``beta`` is not in [0, 1] or the shapes differ.
    """
    require_in_range("beta (the mixture's weight on the reference)", beta, 0, 1)
    if logp_policy.shape != logp_reference.shape:
        raise ValueError(
            f"logp_policy and logp_reference must share a shape, got {tuple(logp_policy.shape)} and "
            f"{tuple(logp_reference.shape)}"
        )
    # 0·(−inf) would be NaN: a weight of 0 drops that model's term entirely
    mixed = (
        (1.0 - beta) * logp_policy + beta * logp_reference if 0 < beta < 1 else logp_reference if beta else logp_policy
    )
    return torch.log_softmax(mixed, dim=-1)


def nash_md_pg_surrogate_loss(
    preference: Tensor, logp_policy: Tensor, logp_reference: Tensor, tau: float, baseline: float = 0.5
) -> dict[str, Tensor]:
    """Surrogate loss whose gradient is minus the Nash-MD-PG estimate (Munos et al., 2024, §7).

    For ``y ~ π_θ`` and ``y′ ~ π^β`` (held fixed), the estimate of ``∇_θ [P(π_θ ≻ π^β) − τ KL(π_θ ‖ μ)]`` is
    ``(P(y ≻ y′ | x) − b − τ log(π_θ(y|x) / μ(y|x))) ∇_θ log π_θ(y|x)`` with the constant baseline ``b = ½`` (the
    preference of a policy against itself). Returns ``loss`` and detached ``win_rate``, ``kl`` and ``advantage``.

    Raises:
        ValueError: for mismatched shapes, preferences outside [0, 1] or a non-positive ``tau``.
    """
    if preference.shape != logp_policy.shape or preference.shape != logp_reference.shape:
        raise ValueError(
            f"preference, logp_policy and logp_reference must share a shape, got {tuple(preference.shape)}, "
            f"{tuple(logp_policy.shape)}, {tuple(logp_reference.shape)}"
        )
    require_positive(tau=tau)
    check_preferences("preference", preference.detach())
    log_ratio = (logp_policy - logp_reference).detach()
    advantage = preference.detach() - baseline - tau * log_ratio
    return {
        "loss": -(advantage * logp_policy).mean(),
        "win_rate": preference.detach().mean(),
        "kl": log_ratio.mean(),
        "advantage": advantage,
    }


def slhf_surrogate_losses(preference: Tensor, *logps_and_taus: Tensor | float) -> dict[str, Tensor]:
    """SLHF's two-timescale updates against one frozen preference model P0 (the Stackelberg paper, App. F).

    ``u(x, y, y′) = P0(y′ ≻ y | x)`` in ``min_π max_ω E[u] + τ_L KL(π‖π_ref) − τ_F KL(ω‖ω_ref)`` is the regularised
    SLHF objective; the estimators are deep-SMIDA's (22)–(25) (:func:`smida_surrogate_losses`, + ``leader_win_rate``),
    whose arguments after ``utility`` follow ``preference`` (the four log-probabilities, τ_L, τ_F).
    With one sample a player (Table 3's budget) the leave-one-out baseline is undefined and the constant ½ (the
    symmetric game's value) replaces it, keeping the estimate unbiased. ``preference`` is ``[B, D, M]``, leader first.

    Raises:
        ValueError: for preferences outside [0, 1] (and the shape errors of the SMIDA estimators).
    """
    check_preferences("preference", preference.detach())
    out = smida_surrogate_losses(1.0 - preference, *logps_and_taus, single_baseline=SLHF_SINGLE_BASELINE)
    out["leader_win_rate"] = preference.detach().mean()
    return out
