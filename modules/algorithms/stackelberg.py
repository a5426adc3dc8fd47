"""Tabular Stackelberg Mirror Descent–Ascent (SMIDA) and the closed-form equilibrium (paper §4, App. B, C, F).

The contextual zero-sum game: after a context ``x`` the Leader plays ``y ~ π(·|x)``, the Follower sees ``(x, y)``
and plays ``y′ ~ ω(·|x, y)``; the Follower maximises and the Leader minimises, both KL-regularised (eq. 4)::

    f(π, ω) = E_{x~ρ, y~π, y′~ω}[u(x, y, y′)] + τ_L KL_ρ(π ‖ π_ref) − τ_F KL_{ρ,π}(ω ‖ ω_ref)

Shapes everywhere: ``u`` is ``[X, Y, Y]`` (context, leader action, follower action), ``π`` is ``[X, Y]`` and ``ω`` is
``[X, Y, Y]``, all distributions over the last dimension. Everything is computed in log space (``logsumexp``), and
vectorised over every context and action; only the iterations of Algorithm 1 are a Python loop.

* :func:`stackelberg_equilibrium`: the unique regularised equilibrium in closed form (Theorem 4.2 / B.4).
* :func:`smida`: Algorithm 1; :class:`SMIDAStep` is one iteration in log space (what the Lightning module calls).
* :func:`kl_bound`: the per-step bounds of Theorem C.1 on each player's KL to the equilibrium, both directions.
* :func:`kl`, :func:`kl_both`: KL divergences over the last dimension.
* Utilities as special cases (App. E.4, F): :func:`tabular_ensemble_variance` (``4·Var``), :func:`slhf_utility`,
  :func:`decision_uncertainty_utility`, :func:`jsd_utility`, :func:`directed_utility`; and
  :func:`random_preference_ensemble` to make games.

The context prior ``ρ`` plays no role in the equilibrium or in Algorithm 1 (both separate across contexts); it only
weights the aggregate quantities (:func:`game_value`), uniform unless given.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from modules.algorithms.disagreement import decision_uncertainty, ensemble_jsd, ensemble_variance

__all__ = [
    "KLBound",
    "SMIDAStep",
    "check_step_sizes",
    "conditional_cost",
    "decision_uncertainty_utility",
    "directed_utility",
    "equilibrium_value",
    "game_value",
    "jsd_utility",
    "kl",
    "kl_bound",
    "kl_bound_at",
    "kl_bound_start",
    "kl_both",
    "log_normalise",
    "oscillations",
    "random_preference_ensemble",
    "slhf_utility",
    "smida",
    "smida_step",
    "stackelberg_equilibrium",
    "tabular_ensemble_variance",
]

# Reference distributions may come from float32 pipelines; rows within this of 1 are accepted and renormalised.
_SUM_TOLERANCE = 1e-5


# --------------------------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------------------------


def check_step_sizes(tau_leader: float, tau_follower: float, eta_leader: float, eta_follower: float) -> None:
    """Refuse regularisation weights and step sizes that break ``τ_L, τ_F > 0`` or condition (6).

    Condition (6) is ``0 < η_L τ_L < η_F τ_F ≤ 1``: the Follower, who solves the inner maximisation, must be the fast
    player, and neither geometric factor ``1 − η τ`` may turn negative.

    Raises:
        ValueError: naming the parameter at fault and the bound it breaks.
    """
    for name, value in (
        ("tau_leader", tau_leader),
        ("tau_follower", tau_follower),
        ("eta_leader", eta_leader),
        ("eta_follower", eta_follower),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(
                f"{name} must be a finite number > 0 (Algorithm 1 needs tau_leader, tau_follower > 0 and "
                f"condition (6) needs 0 < eta * tau), got {name}={value!r}"
            )
    slow, fast = eta_leader * tau_leader, eta_follower * tau_follower
    if fast > 1.0:
        raise ValueError(
            f"condition (6) requires eta_follower * tau_follower <= 1, got eta_follower={eta_follower} * "
            f"tau_follower={tau_follower} = {fast:.6g}; use eta_follower <= 1 / tau_follower = {1.0 / tau_follower:.6g}"
        )
    if slow >= fast:
        raise ValueError(
            f"condition (6) requires eta_leader * tau_leader < eta_follower * tau_follower (the follower is the fast "
            f"player), got eta_leader={eta_leader} * tau_leader={tau_leader} = {slow:.6g} >= eta_follower="
            f"{eta_follower} * tau_follower={tau_follower} = {fast:.6g}; use eta_leader < "
            f"{fast / tau_leader:.6g}"
        )


def _check_distribution(name: str, p: Tensor, shape: tuple[int, ...]) -> None:
    if not isinstance(p, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(p).__name__}")
    if tuple(p.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)} to match u, got {list(p.shape)}")
    if not p.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {p.dtype}")
    bad = ~(p > 0) | ~torch.isfinite(p)
    if bad.any():
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name} must be a full-support distribution (every entry finite and > 0, as Theorem 4.2 assumes); "
            f"{int(bad.sum())} entries are not, the first at index {first}: {p[first].item()!r}"
        )
    err = (p.double().sum(-1) - 1.0).abs()
    if (err > _SUM_TOLERANCE).any():
        first = tuple(int(i) for i in (err > _SUM_TOLERANCE).nonzero()[0])
        raise ValueError(
            f"{name} must sum to 1 over its last dimension (tolerance {_SUM_TOLERANCE}); the row at index {first} "
            f"sums to {p.double().sum(-1)[first].item():.8g}"
        )


def _check_game(u: Tensor, pi_ref: Tensor, omega_ref: Tensor) -> torch.dtype:
    """Validate a game's shapes and distributions; return the common floating dtype."""
    if not isinstance(u, Tensor):
        raise TypeError(f"u must be a torch.Tensor, got {type(u).__name__}")
    if u.ndim != 3 or u.shape[1] != u.shape[2] or 0 in u.shape:
        raise ValueError(
            f"u must have shape [X, Y, Y] (context, leader action, follower action) with X, Y >= 1, got {list(u.shape)}"
        )
    if not u.is_floating_point():
        raise ValueError(f"u must be a floating-point tensor, got dtype {u.dtype}")
    if not torch.isfinite(u).all():
        raise ValueError(f"u must be finite; {int((~torch.isfinite(u)).sum())} entries are NaN or infinite")
    x, y, _ = u.shape
    _check_distribution("pi_ref", pi_ref, (x, y))
    _check_distribution("omega_ref", omega_ref, (x, y, y))
    for name, t in (("pi_ref", pi_ref), ("omega_ref", omega_ref)):
        if t.device != u.device:
            raise ValueError(f"{name} is on {t.device} but u is on {u.device}; put the game on one device")
    return torch.promote_types(torch.promote_types(u.dtype, pi_ref.dtype), omega_ref.dtype)


# Below this many elements ``log_softmax`` is no faster than subtracting ``logsumexp``, but it still opens an OpenMP
# parallel region, which costs a scheduler slice (milliseconds per call) whenever the other cores are busy.
_LOG_SOFTMAX_MIN_NUMEL = 1 << 15


def log_normalise(z: Tensor) -> Tensor:
    """``z − logsumexp(z)`` over the last dimension: log-weights to normalised log-probabilities.

    Uses ``log_softmax`` on large tensors (several times faster there on CPU) and ``logsumexp`` on small ones (where
    ``log_softmax``'s thread pool dominates); the two agree to rounding.
    """
    if z.numel() >= _LOG_SOFTMAX_MIN_NUMEL:
        return torch.log_softmax(z, dim=-1)
    return z - torch.logsumexp(z, dim=-1, keepdim=True)


def _log_normalised(p: Tensor, dtype: torch.dtype) -> Tensor:
    """``log p`` renormalised over the last dimension (removes the rounding a float32 source leaves)."""
    return log_normalise(p.to(dtype).log())


# --------------------------------------------------------------------------------------------------------------------
# KL divergences
# --------------------------------------------------------------------------------------------------------------------


def kl(p: Tensor, q: Tensor, *, log_space: bool = False) -> Tensor:
    """``KL(p ‖ q) = Σ p log(p / q)`` over the last dimension.

    Args:
        p: Probabilities (or log-probabilities with ``log_space=True``), shape ``[..., n]``.
        q: Same shape as ``p`` (broadcastable).
        log_space: Inputs are log-probabilities. Preferred near the equilibrium or for small τ, where probabilities
            underflow but their logarithms do not.

    Returns:
        Tensor of shape ``[...]``: 0 where ``p == q``, ``+inf`` where ``q`` misses mass of ``p``. Rounding below zero
        is clamped to 0 (KL is non-negative), so the values can be plotted on a log scale.

    Call it with the arguments swapped for the other direction, or use :func:`kl_both`.
    """
    if log_space:
        p_prob = p.exp()
        # 0 · log(0 / q) = 0: positions where p has no mass contribute nothing, even when q has none either.
        terms = torch.where(p_prob > 0, p_prob * (p - q), torch.zeros_like(p_prob))
    else:
        terms = torch.special.xlogy(p, p) - torch.special.xlogy(p, q)
    return terms.sum(-1).clamp_min(0.0)


def kl_both(p: Tensor, q: Tensor, *, log_space: bool = False) -> tuple[Tensor, Tensor]:
    """Both directions, ``(KL(p ‖ q), KL(q ‖ p))``, over the last dimension (see :func:`kl`)."""
    return kl(p, q, log_space=log_space), kl(q, p, log_space=log_space)


# --------------------------------------------------------------------------------------------------------------------
# Closed form (Theorem 4.2 / B.4) and values
# --------------------------------------------------------------------------------------------------------------------


def _log_equilibrium(
    u: Tensor, log_pi_ref: Tensor, log_omega_ref: Tensor, tau_leader: float, tau_follower: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(log π*, log ω*, log Z^F [X, Y], log Z^L [X])`` from normalised log references."""
    scores = log_omega_ref + u / tau_follower  # log(ω_ref · exp(u / τ_F))
    log_zf = torch.logsumexp(scores, dim=-1)
    log_omega = scores - log_zf.unsqueeze(-1)
    # The leader reweights π_ref by exp(−r / τ_L) with r = τ_F log Z^F, the follower's optimal regularised value.
    leader = log_pi_ref - (tau_follower / tau_leader) * log_zf
    log_zl = torch.logsumexp(leader, dim=-1)
    return leader - log_zl.unsqueeze(-1), log_omega, log_zf, log_zl


def stackelberg_equilibrium(
    u: Tensor,
    pi_ref: Tensor,
    omega_ref: Tensor,
    tau_leader: float,
    tau_follower: float,
    *,
    log_space: bool = False,
) -> tuple[Tensor, Tensor]:
    """The unique regularised Stackelberg equilibrium ``(π*, ω*)`` in closed form (Theorem 4.2, proof in B.4).

    ::

        ω*(y′|x, y) = ω_ref(y′|x, y) exp(u(x, y, y′) / τ_F) / Z^F(x, y)
        π*(y|x)     = π_ref(y|x) exp(−(τ_F / τ_L) log Z^F(x, y)) / Z^L(x)

    Args:
        u: Follower's utility (the Leader's cost), ``[X, Y, Y]``.
        pi_ref: Leader's full-support reference, ``[X, Y]``.
        omega_ref: Follower's full-support reference, ``[X, Y, Y]``.
        tau_leader: ``τ_L > 0``.
        tau_follower: ``τ_F > 0``.
        log_space: Return log-probabilities (exact even where probabilities underflow, e.g. for tiny τ).

    Returns:
        ``(π*, ω*)`` of shapes ``[X, Y]`` and ``[X, Y, Y]`` in the promoted dtype of the inputs.

    Raises:
        ValueError: for a bad shape, a non-distribution, non-finite ``u`` or a non-positive τ.
        TypeError: for a non-tensor input.

    Example:
        >>> u = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]], dtype=torch.float64)  # one context, two actions
        >>> half = torch.tensor(0.5, dtype=torch.float64)
        >>> pi, omega = stackelberg_equilibrium(u, half.expand(1, 2), half.expand(1, 2, 2), 1.0, 1.0)
        >>> omega[0].round(decimals=4)  # after y = 0 the follower leans to y′ = 1; after y = 1 it is indifferent
        tensor([[0.2689, 0.7311],
                [0.5000, 0.5000]], dtype=torch.float64)
        >>> pi[0].round(decimals=4)  # the leader avoids y = 0, where the follower's value log((1 + e) / 2) > ½
        tensor([0.4700, 0.5300], dtype=torch.float64)
    """
    dtype = _check_game(u, pi_ref, omega_ref)
    for name, value in (("tau_leader", tau_leader), ("tau_follower", tau_follower)):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite number > 0 (Theorem 4.2), got {name}={value!r}")
    log_pi, log_omega, _, _ = _log_equilibrium(
        u.to(dtype), _log_normalised(pi_ref, dtype), _log_normalised(omega_ref, dtype), tau_leader, tau_follower
    )
    return (log_pi, log_omega) if log_space else (log_pi.exp(), log_omega.exp())


def _weights(rho: Tensor | None, x: int, like: Tensor) -> Tensor:
    if rho is None:
        return torch.full((x,), 1.0 / x, dtype=like.dtype, device=like.device)
    if tuple(rho.shape) != (x,) or not (rho > 0).all() or abs(float(rho.double().sum()) - 1.0) > _SUM_TOLERANCE:
        raise ValueError(f"rho must be a full-support distribution of shape [{x}], got shape {list(rho.shape)}")
    return rho.to(like)


def conditional_cost(u: Tensor, omega: Tensor, omega_ref: Tensor, tau_follower: float) -> Tensor:
    """The Leader's conditional cost ``r̂(x, y) = E_ω[u] − τ_F KL(ω ‖ ω_ref)`` of eq. (5), shape ``[X, Y]``.

    At ``ω = ω*`` it is the Follower's optimal regularised value ``r = τ_F log Z^F`` (Lemma C.2), otherwise smaller.
    """
    return (omega * u).sum(-1) - tau_follower * kl(omega, omega_ref)


def game_value(
    u: Tensor,
    pi: Tensor,
    omega: Tensor,
    pi_ref: Tensor,
    omega_ref: Tensor,
    tau_leader: float,
    tau_follower: float,
    rho: Tensor | None = None,
) -> Tensor:
    """The regularised objective ``f(π, ω)`` of eq. (4) (a scalar), ``ρ`` uniform unless given.

    ``f(π, ω) = E_ρ[ Σ_y π(y|x) r̂(x, y) + τ_L KL(π(·|x) ‖ π_ref(·|x)) ]`` with ``r̂`` from :func:`conditional_cost`.
    """
    per_context = (pi * conditional_cost(u, omega, omega_ref, tau_follower)).sum(-1) + tau_leader * kl(pi, pi_ref)
    return (_weights(rho, u.shape[0], per_context) * per_context).sum()


def equilibrium_value(
    u: Tensor, pi_ref: Tensor, omega_ref: Tensor, tau_leader: float, tau_follower: float, rho: Tensor | None = None
) -> Tensor:
    """``f(π*, ω*) = −τ_L E_ρ[log Z^L(x)]``, the game's value at the equilibrium (Lemma B.3 applied twice)."""
    dtype = _check_game(u, pi_ref, omega_ref)
    _, _, _, log_zl = _log_equilibrium(
        u.to(dtype), _log_normalised(pi_ref, dtype), _log_normalised(omega_ref, dtype), tau_leader, tau_follower
    )
    return (_weights(rho, u.shape[0], log_zl) * (-tau_leader * log_zl)).sum()


# --------------------------------------------------------------------------------------------------------------------
# Algorithm 1
# --------------------------------------------------------------------------------------------------------------------


class SMIDAStep:
    """One iteration of Algorithm 1 on a fixed game, in log space, with the game's constant terms computed once.

    Both players move simultaneously from the iterate at ``t``::

        r̂_t(x, y)    = Σ_y′ ω_t (u − τ_F log(ω_t / ω_ref))                                        (eq. 5)
        log π_{t+1}  = (1 − η_L τ_L) log π_t + η_L τ_L log π_ref − η_L r̂_t  − log-normaliser   (Leader, descent)
        log ω_{t+1}  = (1 − η_F τ_F) log ω_t + η_F τ_F log ω_ref + η_F u    − log-normaliser   (Follower, ascent)

    The terms that do not change with ``t`` (``u + τ_F log ω_ref``, ``η_F (u + τ_F log ω_ref)``, ``η_L τ_L log π_ref``)
    are kept, so a step is a handful of passes over ``[X, Y, Y]`` (exp, two fused multiply-adds, a weighted sum, a
    log-softmax); see :func:`log_normalise` for the normalisation.

    The inputs are not validated (this is the inner loop): build it from a game checked as in :func:`smida`, with
    normalised log references and step sizes satisfying condition (6) (:func:`check_step_sizes`).

    Args:
        u: ``[X, Y, Y]``.
        log_pi_ref: ``[X, Y]`` normalised log-probabilities.
        log_omega_ref: ``[X, Y, Y]`` normalised log-probabilities.
        tau_leader: ``τ_L``.
        tau_follower: ``τ_F``.
        eta_leader: ``η_L``.
        eta_follower: ``η_F``.
    """

    def __init__(
        self,
        u: Tensor,
        log_pi_ref: Tensor,
        log_omega_ref: Tensor,
        tau_leader: float,
        tau_follower: float,
        eta_leader: float,
        eta_follower: float,
    ) -> None:
        self.tau_follower, self.eta_leader = tau_follower, eta_leader
        self.q_leader, self.q_follower = 1.0 - eta_leader * tau_leader, 1.0 - eta_follower * tau_follower
        self.cost_base = u + tau_follower * log_omega_ref  # r̂ = Σ ω (cost_base − τ_F log ω)
        self.follower_drive = eta_follower * self.cost_base  # η_F τ_F log ω_ref + η_F u
        self.leader_drive = (eta_leader * tau_leader) * log_pi_ref

    def __call__(self, log_pi: Tensor, log_omega: Tensor) -> tuple[Tensor, Tensor]:
        """``(log π_t, log ω_t) → (log π_{t+1}, log ω_{t+1})``; the inputs are not modified."""
        omega = log_omega.exp()
        r_hat = torch.add(self.cost_base, log_omega, alpha=-self.tau_follower).mul_(omega).sum(-1)
        leader = torch.add(self.leader_drive, log_pi, alpha=self.q_leader).sub_(r_hat, alpha=self.eta_leader)
        follower = torch.add(self.follower_drive, log_omega, alpha=self.q_follower)
        return log_normalise(leader), log_normalise(follower)


def smida_step(
    log_pi: Tensor,
    log_omega: Tensor,
    u: Tensor,
    log_pi_ref: Tensor,
    log_omega_ref: Tensor,
    tau_leader: float,
    tau_follower: float,
    eta_leader: float,
    eta_follower: float,
) -> tuple[Tensor, Tensor]:
    """One iteration of Algorithm 1 in log space, ``(log π_t, log ω_t) → (log π_{t+1}, log ω_{t+1})``.

    A one-off :class:`SMIDAStep`; in a loop build the :class:`SMIDAStep` once. Inputs are not validated.
    """
    step = SMIDAStep(u, log_pi_ref, log_omega_ref, tau_leader, tau_follower, eta_leader, eta_follower)
    return step(log_pi, log_omega)


def smida(
    u: Tensor,
    pi_ref: Tensor,
    omega_ref: Tensor,
    tau_leader: float,
    tau_follower: float,
    eta_leader: float,
    eta_follower: float,
    steps: int,
    pi0: Tensor | None = None,
    omega0: Tensor | None = None,
    return_trajectory: bool = False,
    *,
    log_space: bool = False,
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
    """Stackelberg Mirror Descent–Ascent, tabular form (Algorithm 1): ``steps`` iterations from ``(π_0, ω_0)``.

    Each step is a :class:`SMIDAStep`: the Leader takes a mirror-descent step on the conditional cost ``r̂_t`` induced
    by the current Follower (eq. 5), the Follower a mirror-ascent step on ``u``, both with the KL geometry and a
    geometric pull towards their references. Under condition (6) the last iterate converges linearly to
    :func:`stackelberg_equilibrium`, the Follower with factor ``1 − η_F τ_F`` and the Leader with ``1 − η_L τ_L``
    (Theorem 4.3; per-step bounds in :func:`kl_bound`).

    Args:
        u: Utility ``[X, Y, Y]``.
        pi_ref: Leader reference ``[X, Y]``, full support.
        omega_ref: Follower reference ``[X, Y, Y]``, full support.
        tau_leader: ``τ_L > 0``.
        tau_follower: ``τ_F > 0``.
        eta_leader: ``η_L`` with ``0 < η_L τ_L < η_F τ_F``.
        eta_follower: ``η_F`` with ``η_F τ_F ≤ 1``.
        steps: Number of iterations, ``>= 0``.
        pi0: Leader's initial policy (default ``π_ref``, as in Algorithm 1), full support.
        omega0: Follower's initial policy (default ``ω_ref``), full support.
        return_trajectory: Also return every iterate ``t = 0 … steps`` stacked as ``([steps + 1, X, Y],
            [steps + 1, X, Y, Y])``; memory grows with ``steps · X · Y²``, meant for small games.
        log_space: Return log-probabilities (also for the trajectory).

    Returns:
        ``(π_steps, ω_steps)``, or ``(π_steps, ω_steps, (πs, ωs))`` with ``return_trajectory``.

    Raises:
        ValueError: step sizes breaking condition (6) (naming the parameter and the bound), bad shapes or
            distributions (naming the argument), a negative ``steps``.
        TypeError: a non-tensor input or a non-integer ``steps``.
    """
    dtype = _check_game(u, pi_ref, omega_ref)
    check_step_sizes(tau_leader, tau_follower, eta_leader, eta_follower)
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"steps must be an int, got {type(steps).__name__}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    x, y, _ = u.shape
    if pi0 is not None:
        _check_distribution("pi0", pi0, (x, y))
    if omega0 is not None:
        _check_distribution("omega0", omega0, (x, y, y))
    u = u.to(dtype)
    log_pi_ref, log_omega_ref = _log_normalised(pi_ref, dtype), _log_normalised(omega_ref, dtype)
    log_pi = log_pi_ref if pi0 is None else _log_normalised(pi0, dtype)
    log_omega = log_omega_ref if omega0 is None else _log_normalised(omega0, dtype)
    step = SMIDAStep(u, log_pi_ref, log_omega_ref, tau_leader, tau_follower, eta_leader, eta_follower)
    trajectory = [(log_pi, log_omega)]
    for _ in range(steps):
        log_pi, log_omega = step(log_pi, log_omega)
        if return_trajectory:
            trajectory.append((log_pi, log_omega))
    out = (log_pi, log_omega) if log_space else (log_pi.exp(), log_omega.exp())
    if not return_trajectory:
        return out
    pis = torch.stack([p for p, _ in trajectory])
    omegas = torch.stack([o for _, o in trajectory])
    return (*out, (pis, omegas) if log_space else (pis.exp(), omegas.exp()))


# --------------------------------------------------------------------------------------------------------------------
# Theorem C.1
# --------------------------------------------------------------------------------------------------------------------


def _osc(v: Tensor) -> Tensor:
    """Oscillation ``max − min`` over the last dimension."""
    return v.amax(-1) - v.amin(-1)


def oscillations(u: Tensor, omega_ref: Tensor, tau_follower: float) -> tuple[float, float, float]:
    """The payoff oscillations of Theorem C.1: ``(D, D_F, D_L)``.

    ``D_F = max_{x,y} osc u(x, y, ·)``, ``D = max_x osc u(x, ·, ·)`` and ``D_L = max_x osc r(x, ·)`` with
    ``r = τ_F log Σ_y′ ω_ref exp(u / τ_F)`` the Follower's optimal value. ``D_F ≤ D`` and ``D_L ≤ D``.
    """
    if u.ndim != 3 or tuple(omega_ref.shape) != tuple(u.shape):
        raise ValueError(
            f"u and omega_ref must both have shape [X, Y, Y], got {list(u.shape)}, {list(omega_ref.shape)}"
        )
    dtype = torch.promote_types(u.dtype, omega_ref.dtype)
    u = u.to(dtype)
    r = tau_follower * torch.logsumexp(_log_normalised(omega_ref, dtype) + u / tau_follower, dim=-1)
    d = (u.flatten(1).amax(-1) - u.flatten(1).amin(-1)).max()
    return float(d), float(_osc(u).max()), float(_osc(r).max())


class KLBound(NamedTuple):
    """Per-step bounds of Theorem C.1, each a float64 tensor over ``t = 0 … steps`` (0-d from :func:`kl_bound_start`).

    Each bounds, for every context (and every leader action for the follower), *both* directions of the KL between
    the iterate and the equilibrium, hence also their ``ρ``-averages of Theorem 4.3.

    Attributes:
        leader: eq. (14), ``q_L^t D_L / τ_L + η_L D_F (q_L^t − q_F^t) / (q_L − q_F)``.
        follower: eq. (13), ``q_F^t D_F / τ_F``.
        leader_simple: eq. (15), ``q_L^t (D / τ_L) κ / (κ − 1)``, looser than ``leader``.
    """

    leader: Tensor
    follower: Tensor
    leader_simple: Tensor


def kl_bound(
    u: Tensor,
    pi_ref: Tensor,
    omega_ref: Tensor,
    tau_leader: float,
    tau_follower: float,
    eta_leader: float,
    eta_follower: float,
    steps: int,
    pi0: Tensor | None = None,
    omega0: Tensor | None = None,
) -> KLBound:
    """The bounds of Theorem C.1 on ``max(KL(π* ‖ π_t), KL(π_t ‖ π*))`` and the Follower's analogue, ``t = 0 … steps``.

    With ``q_L = 1 − η_L τ_L``, ``q_F = 1 − η_F τ_F`` and ``κ = η_F τ_F / (η_L τ_L) > 1``:

    * Follower (13): ``max_{x,y} KL ≤ q_F^t D_F / τ_F``;
    * Leader (14): ``max_x KL ≤ q_L^t D_L / τ_L + η_L D_F (q_L^t − q_F^t) / (q_L − q_F)``;
    * Leader, simpler (15): ``max_x KL ≤ q_L^t (D / τ_L) κ / (κ − 1)``. The text of (15) lost its fraction bars;
      ``κ / (κ − 1)`` is what the proof gives: ``D_L, D_F ≤ D`` and ``Σ_k q_L^{t−1−k} q_F^k ≤ q_L^t / (q_L − q_F)``
      turn (14) into ``q_L^t D (1/τ_L + η_L / (η_F τ_F − η_L τ_L)) = q_L^t (D / τ_L) κ / (κ − 1)``.

    ``D``, ``D_F``, ``D_L`` are the oscillations of :func:`oscillations`. The proof uses them only through the
    oscillations of the initial log-ratios, ``V_0 = max_{x,y} osc log(ω_0 / ω*)`` and ``M_0 = max_x osc log(π_0 / π*)``,
    which at Algorithm 1's start ``(π_ref, ω_ref)`` are exactly ``D_F / τ_F`` and ``D_L / τ_L``. For another start
    (``pi0``/``omega0``) the same argument gives ``follower = q_F^t V_0`` and ``leader = q_L^t M_0 + η_L τ_F V_0
    (q_L^t − q_F^t) / (q_L − q_F)``, and ``leader_simple`` becomes ``q_L^t (M_0 + η_L τ_F V_0 / (q_L − q_F))``; that is
    what is returned then.

    Raises:
        ValueError: as :func:`smida`.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    start = kl_bound_start(u, pi_ref, omega_ref, tau_leader, tau_follower, eta_leader, eta_follower, pi0, omega0)
    return kl_bound_at(
        torch.arange(steps + 1, dtype=torch.float64), start, tau_leader, tau_follower, eta_leader, eta_follower
    )


def kl_bound_start(
    u: Tensor,
    pi_ref: Tensor,
    omega_ref: Tensor,
    tau_leader: float,
    tau_follower: float,
    eta_leader: float,
    eta_follower: float,
    pi0: Tensor | None = None,
    omega0: Tensor | None = None,
) -> KLBound:
    """The ``t = 0`` values of :func:`kl_bound` (``M_0``, ``V_0`` and the coefficient of (15)), 0-d float64 tensors.

    Together with :func:`kl_bound_at` this evaluates the bound at any iteration without a pass over the game, which is
    how the Lightning module logs it every step.
    """
    dtype = _check_game(u, pi_ref, omega_ref)
    check_step_sizes(tau_leader, tau_follower, eta_leader, eta_follower)
    x, y, _ = u.shape
    gap = eta_follower * tau_follower - eta_leader * tau_leader  # q_L − q_F > 0 by (6)
    if pi0 is None and omega0 is None:
        d, d_f, d_l = oscillations(u, omega_ref, tau_follower)
        m0, v0 = d_l / tau_leader, d_f / tau_follower
        kappa = (eta_follower * tau_follower) / (eta_leader * tau_leader)
        return _bound_tensors(m0, v0, (d / tau_leader) * kappa / (kappa - 1.0))
    if pi0 is not None:
        _check_distribution("pi0", pi0, (x, y))
    if omega0 is not None:
        _check_distribution("omega0", omega0, (x, y, y))
    log_pi_star, log_omega_star = stackelberg_equilibrium(
        u, pi_ref, omega_ref, tau_leader, tau_follower, log_space=True
    )
    log_pi0 = _log_normalised(pi_ref if pi0 is None else pi0, dtype)
    log_omega0 = _log_normalised(omega_ref if omega0 is None else omega0, dtype)
    m0 = float(_osc(log_pi0 - log_pi_star).max())
    v0 = float(_osc(log_omega0 - log_omega_star).max())
    return _bound_tensors(m0, v0, m0 + eta_leader * tau_follower * v0 / gap)


def _bound_tensors(leader: float, follower: float, leader_simple: float) -> KLBound:
    return KLBound(*(torch.tensor(v, dtype=torch.float64) for v in (leader, follower, leader_simple)))


def kl_bound_at(
    t: Tensor, start: KLBound, tau_leader: float, tau_follower: float, eta_leader: float, eta_follower: float
) -> KLBound:
    """Theorem C.1's bounds at iterations ``t`` (a float64 tensor) from the start values of :func:`kl_bound_start`."""
    q_l, q_f = 1.0 - eta_leader * tau_leader, 1.0 - eta_follower * tau_follower
    t = torch.as_tensor(t, dtype=torch.float64)
    pow_l, pow_f = q_l**t, q_f**t
    # Σ_{k<t} q_L^{t−1−k} q_F^k, the Follower's tracking error accumulated by the Leader.
    geometric = (pow_l - pow_f) / (q_l - q_f)
    return KLBound(
        leader=pow_l * start.leader + eta_leader * tau_follower * start.follower * geometric,
        follower=pow_f * start.follower,
        leader_simple=pow_l * start.leader_simple,
    )


# --------------------------------------------------------------------------------------------------------------------
# Utilities (App. E.4 and F) and random games
# --------------------------------------------------------------------------------------------------------------------


def _check_preferences(name: str, p: Tensor, ensemble: bool) -> None:
    want = 4 if ensemble else 3
    shape = "[k, X, Y, Y]" if ensemble else "[X, Y, Y]"
    if not isinstance(p, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(p).__name__}")
    if p.ndim != want or p.shape[-1] != p.shape[-2] or 0 in p.shape:
        raise ValueError(f"{name} must have shape {shape} with P[..., y, y′] = P(y ≻ y′ | x), got {list(p.shape)}")
    if not p.is_floating_point() or not ((p >= 0) & (p <= 1)).all():
        raise ValueError(f"{name} must hold probabilities in [0, 1]")
    gap = (p + p.transpose(-1, -2) - 1.0).abs().max()
    if gap > _SUM_TOLERANCE:
        raise ValueError(
            f"{name} must be antisymmetric, P(y ≻ y′) + P(y′ ≻ y) = 1, as the paper's preference models are "
            f"(eq. 27); the largest violation is {float(gap):.3g}"
        )


def tabular_ensemble_variance(P: Tensor) -> Tensor:
    """The paper's utility ``u = 4·Var_i P_i(y ≻ y′ | x)`` of a tabular ensemble (§3.1, App. E.4), ``[X, Y, Y]``.

    Population variance over the members (denominator k, App. E.3), times 4. We return ``4·Var`` rather than
    ``Var`` because it is the utility the paper trains with (App. E.4, "giving a score in [0, 1]"), and on [0, 1] it
    shares its scale with the other utilities (decision uncertainty ≤ ½, JSD ≤ log 2, SLHF ≤ 1), so the same τ's mean
    a comparable strength of regularisation. The choice changes no equilibrium: scaling ``u`` by ``c`` is the same
    game with ``τ_L, τ_F`` scaled by ``c`` (and ``η`` by ``1/c``), so ``Var`` with ``τ / 4`` reproduces ``4·Var`` with
    ``τ`` exactly.

    Because every member is antisymmetric the utility is symmetric in ``(y, y′)``, and it vanishes on the diagonal
    ``y′ = y``: copying the Leader is the Follower's worst reply, not its best (contrast
    :func:`decision_uncertainty_utility`).

    Args:
        P: Members' preference matrices ``[k, X, Y, Y]``, ``P[i, x, y, y′] = P_i(y ≻ y′ | x)``, antisymmetric.
    """
    _check_preferences("P", P, ensemble=True)
    return 4.0 * ensemble_variance(P.movedim(0, -1))


def slhf_utility(P: Tensor) -> Tensor:
    """``u(x, y, y′) = P(y′ ≻ y | x)``, ``[X, Y, Y]``: the Follower seeks a reply preferred to the Leader's (App. F).

    The SLHF preference game (Pásztor et al., 2026) as a special case of the framework.

    Args:
        P: One preference model's matrices ``[X, Y, Y]``, ``P[x, y, y′] = P(y ≻ y′ | x)``, antisymmetric (for an
            ensemble pass e.g. its mean ``P.mean(0)``).
    """
    _check_preferences("P", P, ensemble=False)
    return P.transpose(-1, -2).clone()


def decision_uncertainty_utility(P: Tensor) -> Tensor:
    """``u = min(P̄, 1 − P̄) = ½ − |P̄ − ½|`` of the ensemble mean (App. F.1), ``[X, Y, Y]``.

    The copying failure of App. F.1: antisymmetry gives ``P_i(y ≻ y) = ½`` for every member, so ``u(x, y, y) = ½``, the
    largest value the utility can take; ``y′ = y`` is a best response to every Leader action and the Leader cannot push
    the Follower's value below ½.

    Args:
        P: ``[k, X, Y, Y]`` antisymmetric member matrices.
    """
    _check_preferences("P", P, ensemble=True)
    return decision_uncertainty(P.movedim(0, -1))


def jsd_utility(P: Tensor) -> Tensor:
    """Jensen–Shannon divergence ``H(P̄) − mean_i H(P_i)`` among the members' Bernoulli predictions (App. F.1).

    Zero when all members agree (in particular on ``y′ = y``), at most ``log 2``. Shape ``[X, Y, Y]``.

    Args:
        P: ``[k, X, Y, Y]`` antisymmetric member matrices.
    """
    _check_preferences("P", P, ensemble=True)
    return ensemble_jsd(P.movedim(0, -1))


def directed_utility(P: Tensor, member: int, lam: float) -> Tensor:
    """The directed objective of App. F.2, ``4·Var + λ P_j(y′ ≻ y | x)`` for member ``j`` (``[X, Y, Y]``).

    The paper writes ``Var + λ_paper P_j``; on the ``4·Var`` scale of :func:`tabular_ensemble_variance` this utility is
    ``4 (Var + (λ / 4) P_j)``, i.e. the paper's objective with ``λ_paper = λ / 4``, scaled by 4 (the same game with the
    τ's scaled by 4).

    Args:
        P: ``[k, X, Y, Y]`` antisymmetric member matrices.
        member: Index ``j`` of the targeted member.
        lam: ``λ ≥ 0``.
    """
    _check_preferences("P", P, ensemble=True)
    if not -P.shape[0] <= member < P.shape[0]:
        raise ValueError(f"member must index one of the {P.shape[0]} members, got {member}")
    if not lam >= 0:
        raise ValueError(f"lam must be >= 0, got {lam}")
    return tabular_ensemble_variance(P) + lam * P[member].transpose(-1, -2)


def random_preference_ensemble(
    k: int,
    X: int,
    Y: int,
    generator: torch.Generator | None = None,
    *,
    scale: float = 2.0,
    spread: float = 1.0,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """A random tabular ensemble of ``k`` antisymmetric preference models, ``[k, X, Y, Y]``.

    Member ``i`` has ``P_i(y ≻ y′ | x) = σ(S_i(x, y, y′))`` with skew-symmetric scores ``S_i = scale · A + spread ·
    B_i`` (``A`` shared, ``B_i`` the member's own, both standard Gaussian made skew-symmetric), so the members agree
    on average and disagree by an amount that varies across pairs; preferences are intransitive, like the GPM of
    eq. (27). Antisymmetry holds bit for bit, ``P + Pᵀ == 1`` and ``diag P == ½``: each pair's larger probability
    ``p = σ(|S|) ≥ ½`` is computed once and its partner is ``1 − p``, which is exact for ``p ≥ ½`` (Sterbenz), and
    so is their sum.

    Args:
        k: Ensemble size ``>= 1``.
        X: Number of contexts ``>= 1``.
        Y: Number of actions ``>= 1``.
        generator: Source of randomness (a seeded ``torch.Generator`` for reproducible games).
        scale: Standard deviation of the shared skew scores.
        spread: Standard deviation of each member's own skew scores (0: the members agree exactly).
        dtype: Floating dtype of the result.
    """
    for name, value in (("k", k), ("X", X), ("Y", Y)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    def skew(*shape: int) -> Tensor:
        a = torch.randn(*shape, Y, Y, generator=generator, dtype=dtype)
        return (a - a.transpose(-1, -2)) / math.sqrt(2.0)  # (a − b) = −(b − a) exactly; unit variance off-diagonal

    scores = scale * skew(1, X) + spread * skew(k, X)
    larger = torch.sigmoid(scores.abs())
    return torch.where(scores >= 0, larger, 1.0 - larger)
