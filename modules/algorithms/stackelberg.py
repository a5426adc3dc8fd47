"""Tabular Stackelberg Mirror Descent–Ascent (SMIDA) and the closed-form equilibrium (paper §4, App. B, C, F).

The Leader plays ``y ~ π(·|x)``, the Follower ``y′ ~ ω(·|x, y)`` and maximises what the Leader minimises (eq. 4).
Shapes: ``u`` and ``ω`` are ``[X, Y, Y]``, ``π`` is ``[X, Y]``, distributions over the last dimension; all in log space.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

# Reference distributions may come from float32 pipelines; rows within this of 1 are accepted and renormalised.
_SUM_TOLERANCE = 1e-5


class StepSizes(NamedTuple):
    """A run's KL weights and step sizes ``(τ_L, τ_F, η_L, η_F)``; condition (6) is :func:`check_step_sizes`."""

    tau_leader: float
    tau_follower: float
    eta_leader: float
    eta_follower: float


def check_step_sizes(tau_leader: float, tau_follower: float, eta_leader: float, eta_follower: float) -> None:
    """Refuse weights and step sizes that break ``τ_L, τ_F > 0`` or condition (6), ``0 < η_L τ_L < η_F τ_F ≤ 1``.

    The Follower, who solves the inner maximisation, is the fast player; no factor ``1 − η τ`` may turn negative.

    Raises:
        ValueError: naming the parameter at fault and the bound it breaks.
    """
    for name, value in zip(StepSizes._fields, (tau_leader, tau_follower, eta_leader, eta_follower)):
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


def _check_run(
    u: Tensor, pi_ref: Tensor, omega_ref: Tensor, step_sizes: Sequence[float], pi0: Tensor | None, omega0: Tensor | None
) -> torch.dtype:
    """Validate a run of Algorithm 1: the game, ``(τ_L, τ_F, η_L, η_F)`` against (6), and the optional start."""
    dtype = _check_game(u, pi_ref, omega_ref)
    check_step_sizes(*step_sizes)
    for name, p, ref in (("pi0", pi0, pi_ref), ("omega0", omega0, omega_ref)):
        if p is not None:
            _check_distribution(name, p, tuple(ref.shape))
    return dtype


# Below this many elements ``log_softmax`` is no faster, but its OpenMP region costs milliseconds on busy cores.
_LOG_SOFTMAX_MIN_NUMEL = 1 << 15


def log_normalise(z: Tensor) -> Tensor:
    """``z − logsumexp(z)`` over the last dimension (``log_softmax`` on large tensors; the two agree to rounding)."""
    if z.numel() >= _LOG_SOFTMAX_MIN_NUMEL:
        return torch.log_softmax(z, dim=-1)
    return z - torch.logsumexp(z, dim=-1, keepdim=True)


def _log_normalised(p: Tensor, dtype: torch.dtype, default: Tensor | None = None) -> Tensor:
    """``log p`` (``default`` when ``p`` is None) renormalised over the last dimension (removes float32 rounding)."""
    return log_normalise((default if p is None else p).to(dtype).log())


def kl(p: Tensor, q: Tensor, *, log_space: bool = False) -> Tensor:
    """``KL(p ‖ q) = Σ p log(p / q)`` over the last dim, clamped at 0; ``log_space``: inputs are log-probabilities."""
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


def _log_equilibrium(
    u: Tensor, pi_ref: Tensor, omega_ref: Tensor, tau_leader: float, tau_follower: float, check_taus: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """Validate the game (and the τ); ``(log π*, log ω*, log Z^L [X])``."""
    dtype = _check_game(u, pi_ref, omega_ref)
    for name, value in (("tau_leader", tau_leader), ("tau_follower", tau_follower)) if check_taus else ():
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite number > 0 (Theorem 4.2), got {name}={value!r}")
    scores = _log_normalised(omega_ref, dtype) + u.to(dtype) / tau_follower  # log(ω_ref · exp(u / τ_F))
    log_zf = torch.logsumexp(scores, dim=-1)
    # The leader reweights π_ref by exp(−r / τ_L) with r = τ_F log Z^F, the follower's optimal regularised value.
    leader = _log_normalised(pi_ref, dtype) - (tau_follower / tau_leader) * log_zf
    log_zl = torch.logsumexp(leader, dim=-1)
    return leader - log_zl.unsqueeze(-1), scores - log_zf.unsqueeze(-1), log_zl


def stackelberg_equilibrium(
    u: Tensor, pi_ref: Tensor, omega_ref: Tensor, tau_leader: float, tau_follower: float, *, log_space: bool = False
) -> tuple[Tensor, Tensor]:
    """The unique regularised Stackelberg equilibrium ``(π*, ω*)`` in closed form (Theorem 4.2, proof in B.4).

    ::

        ω*(y′|x, y) = ω_ref(y′|x, y) exp(u(x, y, y′) / τ_F) / Z^F(x, y)
        π*(y|x)     = π_ref(y|x) exp(−(τ_F / τ_L) log Z^F(x, y)) / Z^L(x)

    ``pi_ref`` and ``omega_ref`` are full-support references; ``log_space`` returns log-probabilities.

    Raises:
        ValueError: for a bad shape, a non-distribution, non-finite ``u`` or a non-positive τ.
        TypeError: for a non-tensor input.
    """
    log_pi, log_omega, _ = _log_equilibrium(u, pi_ref, omega_ref, tau_leader, tau_follower, check_taus=True)
    return (log_pi, log_omega) if log_space else (log_pi.exp(), log_omega.exp())


def _weights(rho: Tensor | None, x: int, like: Tensor) -> Tensor:
    if rho is None:
        return torch.full((x,), 1.0 / x, dtype=like.dtype, device=like.device)
    if tuple(rho.shape) != (x,) or not (rho > 0).all() or abs(float(rho.double().sum()) - 1.0) > _SUM_TOLERANCE:
        raise ValueError(f"rho must be a full-support distribution of shape [{x}], got shape {list(rho.shape)}")
    return rho.to(like)


def conditional_cost(u: Tensor, omega: Tensor, omega_ref: Tensor, tau_follower: float) -> Tensor:
    """The Leader's conditional cost ``r̂(x, y) = E_ω[u] − τ_F KL(ω ‖ ω_ref)`` of eq. (5), shape ``[X, Y]``."""
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
    """The regularised objective ``f(π, ω)`` of eq. (4) (a scalar), ``ρ`` uniform unless given."""
    per_context = (pi * conditional_cost(u, omega, omega_ref, tau_follower)).sum(-1) + tau_leader * kl(pi, pi_ref)
    return (_weights(rho, u.shape[0], per_context) * per_context).sum()


def equilibrium_value(
    u: Tensor, pi_ref: Tensor, omega_ref: Tensor, tau_leader: float, tau_follower: float, rho: Tensor | None = None
) -> Tensor:
    """``f(π*, ω*) = −τ_L E_ρ[log Z^L(x)]``, the game's value at the equilibrium (Lemma B.3 applied twice)."""
    log_zl = _log_equilibrium(u, pi_ref, omega_ref, tau_leader, tau_follower)[2]
    return (_weights(rho, u.shape[0], log_zl) * (-tau_leader * log_zl)).sum()


class SMIDAStep:
    """One iteration of Algorithm 1 on a fixed game, in log space, with the game's constant terms computed once.

    Both players move simultaneously from the iterate at ``t``::

        r̂_t(x, y)    = Σ_y′ ω_t (u − τ_F log(ω_t / ω_ref))                                        (eq. 5)
        log π_{t+1}  = (1 − η_L τ_L) log π_t + η_L τ_L log π_ref − η_L r̂_t  − log-normaliser   (Leader, descent)
        log ω_{t+1}  = (1 − η_F τ_F) log ω_t + η_F τ_F log ω_ref + η_F u    − log-normaliser   (Follower, ascent)

    Not validated (the inner loop): build it from a game checked as in :func:`smida`, with normalised log references.
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

    Under condition (6) the last iterate converges linearly to :func:`stackelberg_equilibrium` (Theorem 4.3; bounds in
    :func:`kl_bound`). ``pi0``/``omega0`` default to the references. ``return_trajectory`` also returns every iterate
    ``t = 0 … steps`` stacked (memory grows with ``steps · X · Y²``); ``log_space`` returns log-probabilities.

    Raises:
        ValueError: step sizes breaking condition (6) (naming the parameter and the bound), bad shapes or
            distributions (naming the argument), a negative ``steps``.
        TypeError: a non-tensor input or a non-integer ``steps``.
    """
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"steps must be an int, got {type(steps).__name__}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    dtype = _check_run(u, pi_ref, omega_ref, StepSizes(tau_leader, tau_follower, eta_leader, eta_follower), pi0, omega0)
    u = u.to(dtype)
    log_pi_ref, log_omega_ref = _log_normalised(pi_ref, dtype), _log_normalised(omega_ref, dtype)
    log_pi, log_omega = _log_normalised(pi0, dtype, pi_ref), _log_normalised(omega0, dtype, omega_ref)
    step = SMIDAStep(u, log_pi_ref, log_omega_ref, tau_leader, tau_follower, eta_leader, eta_follower)
    trajectory = [(log_pi, log_omega)]
    for _ in range(steps):
        log_pi, log_omega = step(log_pi, log_omega)
        if return_trajectory:
            trajectory.append((log_pi, log_omega))
    out = (log_pi, log_omega) if log_space else (log_pi.exp(), log_omega.exp())
    if not return_trajectory:
        return out
    pis, omegas = (torch.stack(iterates) for iterates in zip(*trajectory))
    return (*out, (pis, omegas) if log_space else (pis.exp(), omegas.exp()))


def _osc(v: Tensor) -> Tensor:
    """Oscillation ``max − min`` over the last dimension."""
    return v.amax(-1) - v.amin(-1)


def oscillations(u: Tensor, omega_ref: Tensor, tau_follower: float) -> tuple[float, float, float]:
    """The payoff oscillations of Theorem C.1: ``(D, D_F, D_L)``.

    ``D_F = max_{x,y} osc u(x, y, ·)``, ``D = max_x osc u(x, ·, ·)`` and ``D_L = max_x osc r(x, ·)`` with
    ``r = τ_F log Σ_y′ ω_ref exp(u / τ_F)`` the Follower's optimal value.
    """
    if u.ndim != 3 or tuple(omega_ref.shape) != tuple(u.shape):
        raise ValueError(
            f"u and omega_ref must both have shape [X, Y, Y], got {list(u.shape)}, {list(omega_ref.shape)}"
        )
    dtype = torch.promote_types(u.dtype, omega_ref.dtype)
    u = u.to(dtype)
    r = tau_follower * torch.logsumexp(_log_normalised(omega_ref, dtype) + u / tau_follower, dim=-1)
    return float(_osc(u.flatten(1)).max()), float(_osc(u).max()), float(_osc(r).max())


class KLBound(NamedTuple):
    """Per-step bounds of Theorem C.1 on both KL directions to the equilibrium, float64 over ``t = 0 … steps``.

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
    step_sizes: StepSizes | Sequence[float],
    steps: int,
    pi0: Tensor | None = None,
    omega0: Tensor | None = None,
) -> KLBound:
    """The bounds of Theorem C.1 (:class:`KLBound`) for ``t = 0 … steps``, with ``κ = η_F τ_F / (η_L τ_L)``.

    ``D``, ``D_F``, ``D_L`` are :func:`oscillations`. For another start (``pi0``/``omega0``) ``D_F / τ_F`` and
    ``D_L / τ_L`` become ``V_0 = max_{x,y} osc log(ω_0 / ω*)`` and ``M_0 = max_x osc log(π_0 / π*)``, and
    ``leader_simple`` becomes ``q_L^t (M_0 + η_L τ_F V_0 / (q_L − q_F))``. ``step_sizes`` is ``(τ_L, τ_F, η_L, η_F)``.

    Raises:
        ValueError: as :func:`smida`.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    start = kl_bound_start(u, pi_ref, omega_ref, step_sizes, pi0, omega0)
    return kl_bound_at(torch.arange(steps + 1, dtype=torch.float64), start, step_sizes)


def kl_bound_start(
    u: Tensor,
    pi_ref: Tensor,
    omega_ref: Tensor,
    step_sizes: StepSizes | Sequence[float],
    pi0: Tensor | None = None,
    omega0: Tensor | None = None,
) -> KLBound:
    """The ``t = 0`` values of :func:`kl_bound` (``M_0``, ``V_0`` and the coefficient of (15)), 0-d float64 tensors."""
    tau_leader, tau_follower, eta_leader, eta_follower = StepSizes(*step_sizes)
    dtype = _check_run(u, pi_ref, omega_ref, step_sizes, pi0, omega0)
    gap = eta_follower * tau_follower - eta_leader * tau_leader  # q_L − q_F > 0 by (6)
    if pi0 is None and omega0 is None:
        d, d_f, d_l = oscillations(u, omega_ref, tau_follower)
        m0, v0 = d_l / tau_leader, d_f / tau_follower
        kappa = (eta_follower * tau_follower) / (eta_leader * tau_leader)
        return _bound_tensors(m0, v0, (d / tau_leader) * kappa / (kappa - 1.0))
    log_pi_star, log_omega_star = stackelberg_equilibrium(
        u, pi_ref, omega_ref, tau_leader, tau_follower, log_space=True
    )
    m0 = float(_osc(_log_normalised(pi0, dtype, pi_ref) - log_pi_star).max())
    v0 = float(_osc(_log_normalised(omega0, dtype, omega_ref) - log_omega_star).max())
    return _bound_tensors(m0, v0, m0 + eta_leader * tau_follower * v0 / gap)


def _bound_tensors(leader: float, follower: float, leader_simple: float) -> KLBound:
    return KLBound(*(torch.tensor(v, dtype=torch.float64) for v in (leader, follower, leader_simple)))


def kl_bound_at(t: Tensor, start: KLBound, step_sizes: StepSizes | Sequence[float]) -> KLBound:
    """Theorem C.1's bounds at iterations ``t`` (a float64 tensor) from the start values of :func:`kl_bound_start`."""
    tau_leader, tau_follower, eta_leader, eta_follower = StepSizes(*step_sizes)
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
