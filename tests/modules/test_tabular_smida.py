"""Tabular SMIDA (paper §4, App. B, C, F): closed form, Algorithm 1, Theorem C.1, utilities, and the Lightning run."""

import math
import os

import numpy as np
import pytest
import torch
from helpers import ROOT
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize_scalar
from scipy.special import xlogy

from alignment_games import train
from alignment_games.datamodules.steps import StepDataModule
from alignment_games.modules.algorithms.stackelberg import (
    SMIDAStep,
    check_step_sizes,
    conditional_cost,
    equilibrium_value,
    game_value,
    kl,
    kl_both,
    kl_bound,
    kl_bound_start,
    log_normalise,
    oscillations,
    smida,
    stackelberg_equilibrium,
)
from alignment_games.modules.algorithms.tabular_games import (
    decision_uncertainty_utility,
    directed_utility,
    jsd_utility,
    load_game,
    random_game,
    random_preference_ensemble,
    slhf_utility,
    tabular_ensemble_variance,
)
from alignment_games.modules.tabular_smida import TabularSMIDA

CONFIG = os.path.join(ROOT, "configs", "smida_tabular.yaml")
F64 = torch.float64
# KL computed in float64 bottoms out around 1e-16; the bound keeps falling below that.
FLOOR = 1e-13


def game(x, y, seed, utility="variance", reference="random"):
    g = random_game(x, y, 4, utility, reference, seed)
    return g["u"], g["pi_ref"], g["omega_ref"]


def max_kl(p, q):
    """max over every context (and leader action) of both KL directions: what Theorem C.1 bounds."""
    a, b = kl_both(p, q)
    return torch.maximum(a, b).flatten(1).amax(-1)


def steps_to(start, tau_l, eta_l, target):
    """A t by which both Theorem C.1 bounds are below target: q_F < q_L, so q_L^t (C_L + V_0) covers both."""
    constant = float(start.leader_simple) + float(start.follower)
    return int(math.ceil(math.log(target / constant) / math.log(1.0 - eta_l * tau_l)))


# (X, Y, τ_L, τ_F, η_L, η_F, utility): several sizes, τ's, step sizes (η_F τ_F = 1 included) and utilities.
GAMES = [
    (1, 2, 1.0, 1.0, 0.3, 0.9, "variance"),
    (3, 5, 0.1, 0.2, 2.0, 4.0, "variance"),
    (5, 7, 0.05, 0.05, 1.0, 20.0, "jsd"),
    (4, 6, 0.5, 0.02, 0.2, 30.0, "slhf"),
    (2, 9, 0.02, 0.1, 10.0, 5.0, "decision_uncertainty"),
]


# --------------------------------------------------------------------------------------------------------------------
# Algorithm 1 reaches the closed form, within Theorem C.1's bounds at every step
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("x,y,tau_l,tau_f,eta_l,eta_f,utility", GAMES)
def test_smida_reaches_the_closed_form_within_the_bound_at_every_step(x, y, tau_l, tau_f, eta_l, eta_f, utility):
    u, pi_ref, omega_ref = game(x, y, seed=x * 10 + y, utility=utility)
    pi_star, omega_star = stackelberg_equilibrium(u, pi_ref, omega_ref, tau_l, tau_f)
    start = kl_bound_start(u, pi_ref, omega_ref, (tau_l, tau_f, eta_l, eta_f))
    # The proof bounds the oscillation of log(π_t / π*), not only the KL: below 1e-12 the probabilities agree to ~1e-12.
    steps = steps_to(start, tau_l, eta_l, 1e-12)
    pi, omega, (pis, omegas) = smida(u, pi_ref, omega_ref, tau_l, tau_f, eta_l, eta_f, steps, return_trajectory=True)

    torch.testing.assert_close(pi, pi_star, rtol=0, atol=1e-10)
    torch.testing.assert_close(omega, omega_star, rtol=0, atol=1e-10)
    assert torch.equal(pis[-1], pi) and torch.equal(omegas[-1], omega) and len(pis) == steps + 1
    torch.testing.assert_close(pis[0], pi_ref)  # Algorithm 1 starts at the references

    bound = kl_bound(u, pi_ref, omega_ref, (tau_l, tau_f, eta_l, eta_f), steps)
    leader = max_kl(pis, pi_star.expand_as(pis))
    follower = max_kl(omegas, omega_star.expand_as(omegas))
    assert (leader <= bound.leader + FLOOR).all()
    assert (follower <= bound.follower + FLOOR).all()
    assert (bound.leader <= bound.leader_simple + 1e-15).all()  # (14) is the sharper form of (15)
    # the bounds are not vacuous: they start above the KL and fall geometrically with factor q_L (resp. q_F)
    assert leader[0] > 0 and bound.leader[-1] < 1e-12 and bound.follower[-1] < 1e-12
    # the ρ-averaged KLs of Theorem 4.3 are averages of what was bounded
    assert (kl(pis, pi_star.expand_as(pis)).mean(-1) <= bound.leader + FLOOR).all()


@settings(max_examples=50, deadline=None)
@given(
    x=st.integers(1, 4),
    y=st.integers(1, 6),
    seed=st.integers(0, 10_000),
    tau_l=st.floats(0.02, 2.0),
    tau_f=st.floats(0.02, 2.0),
    slow=st.floats(0.05, 0.6),
    ratio=st.floats(1.05, 10.0),
    random_start=st.booleans(),
)
def test_every_iterate_is_under_the_theorem_c1_bound_property(x, y, seed, tau_l, tau_f, slow, ratio, random_start):
    fast = min(1.0, slow * ratio)
    eta_l, eta_f = slow / tau_l, fast / tau_f
    u, pi_ref, omega_ref = game(x, y, seed)
    gen = torch.Generator().manual_seed(seed)
    pi0 = torch.softmax(3 * torch.randn(x, y, generator=gen, dtype=F64), -1) if random_start else None
    omega0 = torch.softmax(3 * torch.randn(x, y, y, generator=gen, dtype=F64), -1) if random_start else None
    steps = 120
    _, _, (pis, omegas) = smida(
        u, pi_ref, omega_ref, tau_l, tau_f, eta_l, eta_f, steps, pi0, omega0, return_trajectory=True
    )
    pi_star, omega_star = stackelberg_equilibrium(u, pi_ref, omega_ref, tau_l, tau_f)
    bound = kl_bound(u, pi_ref, omega_ref, (tau_l, tau_f, eta_l, eta_f), steps, pi0, omega0)
    assert (max_kl(pis, pi_star.expand_as(pis)) <= bound.leader * (1 + 1e-9) + FLOOR).all()
    assert (max_kl(omegas, omega_star.expand_as(omegas)) <= bound.follower * (1 + 1e-9) + FLOOR).all()
    assert (bound.leader <= bound.leader_simple * (1 + 1e-12)).all()


def test_bound_constants_are_the_oscillations_of_theorem_c1():
    # hand-made u: D_F = max_{x,y} osc u(x,y,·) = osc(−3, 1) = 4, D = max_x osc u(x,·,·) = 1.5 − (−3) = 4.5
    u = torch.tensor([[[0.0, 3.0], [1.0, 2.0]], [[1.0, 1.5], [-3.0, 1.0]]], dtype=F64)
    omega_ref = torch.full((2, 2, 2), 0.5, dtype=F64)
    pi_ref = torch.full((2, 2), 0.5, dtype=F64)
    tau_l, tau_f = 0.5, 0.25
    d, d_f, d_l = oscillations(u, omega_ref, tau_f)
    assert (d, d_f) == (4.5, 4.0)
    r = tau_f * torch.log((0.5 * torch.exp(u / tau_f)).sum(-1))  # the follower's optimal value, by hand
    assert d_l == pytest.approx(float((r.amax(-1) - r.amin(-1)).max()), abs=1e-14)
    assert d_l <= d and d_f <= d
    # started at the references, M_0 = D_L / τ_L and V_0 = D_F / τ_F are the oscillations of the initial log-ratios
    eta_l, eta_f = 0.2, 2.0
    named = kl_bound_start(u, pi_ref, omega_ref, (tau_l, tau_f, eta_l, eta_f))
    generic = kl_bound_start(u, pi_ref, omega_ref, (tau_l, tau_f, eta_l, eta_f), pi0=pi_ref, omega0=omega_ref)
    assert float(named.leader) == pytest.approx(d_l / tau_l, abs=1e-12)
    assert float(named.follower) == pytest.approx(d_f / tau_f, abs=1e-12)
    assert float(generic.leader) == pytest.approx(float(named.leader), abs=1e-12)
    assert float(generic.follower) == pytest.approx(float(named.follower), abs=1e-12)
    kappa = (eta_f * tau_f) / (eta_l * tau_l)
    assert float(named.leader_simple) == pytest.approx(d / tau_l * kappa / (kappa - 1))
    # eq. (13) and (14) by hand at t = 3
    b = kl_bound(u, pi_ref, omega_ref, (tau_l, tau_f, eta_l, eta_f), 3)
    q_l, q_f = 1 - eta_l * tau_l, 1 - eta_f * tau_f
    assert float(b.follower[3]) == pytest.approx(q_f**3 * d_f / tau_f)
    leader = q_l**3 * d_l / tau_l + eta_l * d_f * (q_l**2 + q_l * q_f + q_f**2)
    assert float(b.leader[3]) == pytest.approx(leader)


def test_module_iterations_equal_the_pure_function_bit_for_bit(tmp_path):
    u, pi_ref, omega_ref = game(3, 4, seed=5)
    path = tmp_path / "game.pt"
    torch.save({"u": u, "pi_ref": pi_ref, "omega_ref": omega_ref}, path)
    model = TabularSMIDA(game_path=str(path), tau_leader=0.1, tau_follower=0.2, eta_leader=1.0, eta_follower=3.0)
    for _ in range(7):
        model.smida_iteration()
    log_pi, log_omega = smida(u, pi_ref, omega_ref, 0.1, 0.2, 1.0, 3.0, 7, log_space=True)
    assert torch.equal(model.log_pi, log_pi) and torch.equal(model.log_omega, log_omega)
    assert int(model.iteration) == 7
    star = stackelberg_equilibrium(u, pi_ref, omega_ref, 0.1, 0.2, log_space=True)
    assert torch.equal(model.log_pi_star, star[0]) and torch.equal(model.log_omega_star, star[1])
    m = model.metrics()
    bound = kl_bound(u, pi_ref, omega_ref, (0.1, 0.2, 1.0, 3.0), 7)
    assert float(m["leader/kl_bound"]) == pytest.approx(float(bound.leader[7]), rel=1e-12)
    assert float(m["follower/kl_bound"]) == pytest.approx(float(bound.follower[7]), rel=1e-12)
    assert float(m["leader/kl_max"]) <= float(m["leader/kl_bound"])
    step = SMIDAStep(u, log_normalise(pi_ref.log()), log_normalise(omega_ref.log()), 0.1, 0.2, 1.0, 3.0)
    model.smida_iteration()
    assert torch.equal(step(log_pi, log_omega)[0], model.log_pi)


# --------------------------------------------------------------------------------------------------------------------
# The closed form, checked independently
# --------------------------------------------------------------------------------------------------------------------


def test_follower_closed_form_is_the_softmax_best_response_and_meets_first_order_conditions():
    u, pi_ref, omega_ref = game(4, 5, seed=1)
    tau_l, tau_f = 0.3, 0.07
    pi_star, omega_star = stackelberg_equilibrium(u, pi_ref, omega_ref, tau_l, tau_f)
    torch.testing.assert_close(omega_star, torch.softmax(omega_ref.log() + u / tau_f, -1), rtol=0, atol=1e-13)
    # KKT on the simplex, full support: u − τ_F log(ω*/ω_ref) is constant over y′ for every (x, y)
    stationarity = u - tau_f * (omega_star.log() - omega_ref.log())
    assert (stationarity.amax(-1) - stationarity.amin(-1)).max() < 1e-12
    # leader: its cost r̂ at ω* (eq. 5, a plug-in sum, no logsumexp) plus τ_L log(π*/π_ref) is constant over y
    r = conditional_cost(u, omega_star, omega_ref, tau_f)
    leader_stationarity = r + tau_l * (pi_star.log() - pi_ref.log())
    assert (leader_stationarity.amax(-1) - leader_stationarity.amin(-1)).max() < 1e-12
    # Lemma C.2: r̂ at the equilibrium is the follower's optimal value τ_F log Z^F, and no other ω does better
    torch.testing.assert_close(r, tau_f * torch.logsumexp(omega_ref.log() + u / tau_f, -1), rtol=0, atol=1e-12)
    other = torch.softmax(torch.randn(4, 5, 5, dtype=F64, generator=torch.Generator().manual_seed(0)), -1)
    assert (conditional_cost(u, other, omega_ref, tau_f) <= r + 1e-12).all()


def _kl_np(p, q):
    return float(np.sum(xlogy(p, p) - xlogy(p, q)))


def test_closed_form_matches_brute_force_stackelberg_on_a_tiny_game():
    """Y = 2: the follower's best response to each leader action, then the leader's best commitment, found by
    one-dimensional numerical optimisation: no Lemma B.3, no closed form."""
    u, pi_ref, omega_ref = game(3, 2, seed=11)
    tau_l, tau_f = 0.3, 0.2
    un, pr, orf = u.numpy(), pi_ref.numpy(), omega_ref.numpy()
    pi_bf, omega_bf = np.zeros((3, 2)), np.zeros((3, 2, 2))
    for x in range(3):
        values = np.zeros(2)
        for y in range(2):

            def neg_phi(q, x=x, y=y):
                nu = np.array([q, 1 - q])
                return -(nu @ un[x, y] - tau_f * _kl_np(nu, orf[x, y]))

            res = minimize_scalar(neg_phi, bounds=(0, 1), method="bounded", options={"xatol": 1e-12})
            omega_bf[x, y] = [res.x, 1 - res.x]
            values[y] = -res.fun

        def leader_cost(p, x=x, values=values):
            pi = np.array([p, 1 - p])
            return pi @ values + tau_l * _kl_np(pi, pr[x])

        res = minimize_scalar(leader_cost, bounds=(0, 1), method="bounded", options={"xatol": 1e-12})
        pi_bf[x] = [res.x, 1 - res.x]
    pi_star, omega_star = stackelberg_equilibrium(u, pi_ref, omega_ref, tau_l, tau_f)
    np.testing.assert_allclose(omega_star.numpy(), omega_bf, atol=1e-6)
    np.testing.assert_allclose(pi_star.numpy(), pi_bf, atol=1e-6)


def test_equilibrium_is_a_saddle_point_with_the_closed_form_value():
    u, pi_ref, omega_ref = game(3, 4, seed=2)
    tau_l, tau_f = 0.2, 0.1
    pi_star, omega_star = stackelberg_equilibrium(u, pi_ref, omega_ref, tau_l, tau_f)
    rho = torch.tensor([0.2, 0.5, 0.3], dtype=F64)
    v = game_value(u, pi_star, omega_star, pi_ref, omega_ref, tau_l, tau_f, rho)
    torch.testing.assert_close(v, equilibrium_value(u, pi_ref, omega_ref, tau_l, tau_f, rho), rtol=0, atol=1e-13)
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        pi = torch.softmax(2 * torch.randn(3, 4, generator=gen, dtype=F64), -1)
        omega = torch.softmax(2 * torch.randn(3, 4, 4, generator=gen, dtype=F64), -1)
        # f(π*, ω) ≤ f(π*, ω*) ≤ f(π, ω*)  (Theorem B.2)
        assert game_value(u, pi_star, omega, pi_ref, omega_ref, tau_l, tau_f, rho) <= v + 1e-13
        assert game_value(u, pi, omega_star, pi_ref, omega_ref, tau_l, tau_f, rho) >= v - 1e-13


def test_equilibrium_is_a_fixed_point_of_algorithm_1():
    u, pi_ref, omega_ref = game(3, 5, seed=4)
    pi_star, omega_star = stackelberg_equilibrium(u, pi_ref, omega_ref, 0.1, 0.3)
    pi, omega = smida(u, pi_ref, omega_ref, 0.1, 0.3, 1.0, 3.0, 1, pi0=pi_star, omega0=omega_star)
    torch.testing.assert_close(pi, pi_star, rtol=0, atol=1e-14)
    torch.testing.assert_close(omega, omega_star, rtol=0, atol=1e-14)


def test_log_space_equilibrium_survives_where_probabilities_underflow():
    u, pi_ref, omega_ref = game(2, 4, seed=6)
    log_pi, log_omega = stackelberg_equilibrium(u, pi_ref, omega_ref, 1e-3, 1e-4, log_space=True)
    assert torch.isfinite(log_pi).all() and torch.isfinite(log_omega).all()
    torch.testing.assert_close(log_omega.logsumexp(-1), torch.zeros(2, 4, dtype=F64), rtol=0, atol=1e-12)


def test_variance_scale_is_a_rescaling_of_the_taus():
    """4·Var with (τ, η) is the same game as Var with (τ / 4, 4 η): the documented choice changes no equilibrium."""
    P = random_preference_ensemble(4, 3, 5, torch.Generator().manual_seed(7))
    u4 = tabular_ensemble_variance(P)
    _, pi_ref, omega_ref = game(3, 5, seed=7)
    a = stackelberg_equilibrium(u4, pi_ref, omega_ref, 0.2, 0.1)
    b = stackelberg_equilibrium(u4 / 4, pi_ref, omega_ref, 0.05, 0.025)
    for s, t in zip(a, b):
        torch.testing.assert_close(s, t, rtol=0, atol=1e-13)
    a = smida(u4, pi_ref, omega_ref, 0.2, 0.1, 1.0, 5.0, 30)
    b = smida(u4 / 4, pi_ref, omega_ref, 0.05, 0.025, 4.0, 20.0, 30)
    for s, t in zip(a, b):
        torch.testing.assert_close(s, t, rtol=0, atol=1e-13)


# --------------------------------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "taus_etas,match",
    [
        ((1.0, 1.0, 0.5, 1.5), r"eta_follower \* tau_follower <= 1"),
        ((1.0, 1.0, 0.5, 0.5), r"eta_leader \* tau_leader < eta_follower \* tau_follower"),
        ((0.5, 0.1, 1.0, 2.0), r"eta_leader \* tau_leader < eta_follower \* tau_follower.*use eta_leader < 0.4"),
        ((0.0, 1.0, 0.5, 1.0), r"tau_leader must be a finite number > 0"),
        ((1.0, -1.0, 0.5, 1.0), r"tau_follower must be"),
        ((1.0, 1.0, 0.0, 1.0), r"eta_leader must be"),
        ((1.0, 1.0, 0.1, float("nan")), r"eta_follower must be"),
    ],
)
def test_condition_6_violations_are_refused(taus_etas, match):
    tau_l, tau_f, eta_l, eta_f = taus_etas
    u, pi_ref, omega_ref = game(2, 3, seed=0)
    with pytest.raises(ValueError, match=match):
        check_step_sizes(tau_l, tau_f, eta_l, eta_f)
    with pytest.raises(ValueError, match=match):
        smida(u, pi_ref, omega_ref, tau_l, tau_f, eta_l, eta_f, 5)
    with pytest.raises(ValueError, match=match):
        kl_bound(u, pi_ref, omega_ref, (tau_l, tau_f, eta_l, eta_f), 5)
    with pytest.raises(ValueError, match=match):
        TabularSMIDA(
            num_contexts=2, num_actions=3, tau_leader=tau_l, tau_follower=tau_f, eta_leader=eta_l, eta_follower=eta_f
        )


def test_boundary_of_condition_6_is_accepted():
    check_step_sizes(1.0, 1.0, 0.999, 1.0)  # η_F τ_F = 1 is allowed, the follower then jumps to ω* in one step
    u, pi_ref, omega_ref = game(2, 3, seed=0)
    _, omega = smida(u, pi_ref, omega_ref, 1.0, 1.0, 0.5, 1.0, 1)
    torch.testing.assert_close(omega, stackelberg_equilibrium(u, pi_ref, omega_ref, 1.0, 1.0)[1], rtol=0, atol=1e-14)


def _bad_inputs():
    u, pi_ref, omega_ref = game(2, 3, seed=0)
    zero = pi_ref.clone()
    zero[1, 2] = 0.0
    unnormalised = omega_ref * 1.01
    nan_u = u.clone()
    nan_u[0, 0, 0] = float("nan")
    return [
        ((u[0], pi_ref, omega_ref), {}, ValueError, r"u must have shape \[X, Y, Y\]"),
        ((u[:, :, :2], pi_ref, omega_ref), {}, ValueError, r"u must have shape"),
        ((u, pi_ref[:, :2], omega_ref), {}, ValueError, r"pi_ref must have shape \[2, 3\]"),
        ((u, pi_ref, omega_ref[:1]), {}, ValueError, r"omega_ref must have shape \[2, 3, 3\]"),
        ((u, zero, omega_ref), {}, ValueError, r"pi_ref must be a full-support distribution.*\(1, 2\)"),
        ((u, pi_ref, unnormalised), {}, ValueError, r"omega_ref must sum to 1"),
        ((nan_u, pi_ref, omega_ref), {}, ValueError, r"u must be finite"),
        ((u, pi_ref.numpy(), omega_ref), {}, TypeError, r"pi_ref must be a torch.Tensor"),
        ((u.long(), pi_ref, omega_ref), {}, ValueError, r"u must be a floating-point"),
        ((u, pi_ref, omega_ref), {"pi0": pi_ref[:1]}, ValueError, r"pi0 must have shape"),
        ((u, pi_ref, omega_ref), {"omega0": zero.unsqueeze(-1).expand(2, 3, 3)}, ValueError, r"omega0 must"),
    ]


@pytest.mark.parametrize("case", range(11))
def test_bad_inputs_are_refused_naming_the_argument(case):
    args, kwargs, error, match = _bad_inputs()[case]
    with pytest.raises(error, match=match):
        smida(*args, 0.1, 0.1, 1.0, 2.0, 3, **kwargs)
    if not kwargs:
        with pytest.raises(error, match=match):
            stackelberg_equilibrium(*args, 0.1, 0.1)


def test_bad_steps_are_refused():
    u, pi_ref, omega_ref = game(2, 3, seed=0)
    with pytest.raises(ValueError, match="steps must be >= 0"):
        smida(u, pi_ref, omega_ref, 0.1, 0.1, 1.0, 2.0, -1)
    with pytest.raises(TypeError, match="steps must be an int"):
        smida(u, pi_ref, omega_ref, 0.1, 0.1, 1.0, 2.0, 2.5)


def test_game_files_and_datamodule_are_validated(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        load_game(tmp_path / "missing.pt")
    torch.save({"u": torch.zeros(1, 2, 2)}, tmp_path / "partial.pt")
    with pytest.raises(ValueError, match=r"must hold a dict of tensors \['u', 'pi_ref', 'omega_ref'\]"):
        TabularSMIDA(game_path=str(tmp_path / "partial.pt"))
    with pytest.raises(ValueError, match="steps_per_epoch"):
        StepDataModule(steps_per_epoch=0)
    assert list(StepDataModule(steps_per_epoch=3).train_dataloader()) == [0, 1, 2]


def test_resuming_onto_a_different_game_is_refused():
    saved = TabularSMIDA(num_contexts=3, num_actions=4, seed=0)
    with pytest.raises(ValueError, match="different game"):
        TabularSMIDA(num_contexts=3, num_actions=4, seed=1).on_load_checkpoint({"state_dict": saved.state_dict()})
    TabularSMIDA(num_contexts=3, num_actions=4, seed=0).on_load_checkpoint({"state_dict": saved.state_dict()})


# --------------------------------------------------------------------------------------------------------------------
# KL helpers
# --------------------------------------------------------------------------------------------------------------------


def test_kl_values_directions_and_edge_cases():
    p = torch.tensor([0.5, 0.5], dtype=F64)
    q = torch.tensor([0.25, 0.75], dtype=F64)
    forward = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    reverse = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert float(kl(p, q)) == pytest.approx(forward, abs=1e-15)
    a, b = kl_both(p, q)
    assert float(a) == pytest.approx(forward, abs=1e-15) and float(b) == pytest.approx(reverse, abs=1e-15)
    assert float(kl(p.log(), q.log(), log_space=True)) == pytest.approx(forward, abs=1e-15)
    assert float(kl(p, p)) == 0.0
    zero_p = torch.tensor([1.0, 0.0], dtype=F64)
    assert float(kl(zero_p, q)) == pytest.approx(math.log(4.0))  # 0 log 0 = 0
    assert float(kl(zero_p.log(), q.log(), log_space=True)) == pytest.approx(math.log(4.0))
    assert math.isinf(float(kl(q, zero_p)))  # q has mass where zero_p has none
    batch = torch.softmax(torch.randn(3, 4, 5, dtype=F64), -1)
    assert kl(batch, batch.flip(0)).shape == (3, 4)


# --------------------------------------------------------------------------------------------------------------------
# Utilities (App. E.4, F)
# --------------------------------------------------------------------------------------------------------------------


def test_random_ensemble_is_exactly_antisymmetric_and_reproducible():
    P = random_preference_ensemble(5, 4, 6, torch.Generator().manual_seed(0))
    assert P.shape == (5, 4, 6, 6) and P.dtype == F64
    assert torch.equal(P + P.transpose(-1, -2), torch.ones_like(P))  # bit for bit, not approximately
    assert torch.equal(P.diagonal(dim1=-2, dim2=-1), torch.full((5, 4, 6), 0.5, dtype=F64))
    assert ((P > 0) & (P < 1)).all()
    assert torch.equal(P, random_preference_ensemble(5, 4, 6, torch.Generator().manual_seed(0)))
    assert P.var(0).max() > 1e-3  # members disagree
    same = random_preference_ensemble(3, 2, 4, torch.Generator().manual_seed(1), spread=0.0)
    assert torch.equal(same[0], same[1])
    P32 = random_preference_ensemble(2, 3, 7, torch.Generator().manual_seed(2), scale=5.0, dtype=torch.float32)
    assert torch.equal(P32 + P32.transpose(-1, -2), torch.ones_like(P32))
    with pytest.raises(ValueError, match="Y must be an int >= 1"):
        random_preference_ensemble(2, 3, 0)


def test_variance_jsd_and_slhf_utilities():
    P = random_preference_ensemble(4, 3, 5, torch.Generator().manual_seed(3))
    u = tabular_ensemble_variance(P)
    manual = 4 * ((P - P.mean(0)) ** 2).mean(0)  # population variance, denominator k (App. E.3), times 4 (E.4)
    torch.testing.assert_close(u, manual, rtol=0, atol=1e-15)
    torch.testing.assert_close(u, u.transpose(-1, -2), rtol=0, atol=1e-15)  # antisymmetry makes Var symmetric
    assert (u >= 0).all() and (u <= 1).all()
    assert torch.equal(u.diagonal(dim1=-2, dim2=-1), torch.zeros(3, 5, dtype=F64))  # copying is the worst reply
    j = jsd_utility(P)
    assert torch.equal(j.diagonal(dim1=-2, dim2=-1), torch.zeros(3, 5, dtype=F64))
    assert (j >= 0).all() and (j <= math.log(2)).all()
    two = torch.tensor([0.2, 0.8], dtype=F64).view(2, 1, 1, 1) * torch.ones(2, 1, 2, 2, dtype=F64)
    two[:, :, 1, 0] = 1 - two[:, :, 0, 1]
    two[:, :, 0, 0] = two[:, :, 1, 1] = 0.5
    h = -(0.2 * math.log(0.2) + 0.8 * math.log(0.8))
    assert float(jsd_utility(two)[0, 0, 1]) == pytest.approx(math.log(2) - h, abs=1e-15)
    s = slhf_utility(P[0])
    assert torch.equal(s[:, 1, 3], P[0][:, 3, 1])  # u(x, y, y′) = P(y′ ≻ y | x)
    assert torch.equal(s + s.transpose(-1, -2), torch.ones_like(s))
    d = directed_utility(P, member=2, lam=0.5)
    torch.testing.assert_close(d, u + 0.5 * P[2].transpose(-1, -2), rtol=0, atol=0)
    with pytest.raises(ValueError, match="antisymmetric"):
        tabular_ensemble_variance(torch.full((2, 1, 3, 3), 0.3, dtype=F64))
    with pytest.raises(ValueError, match=r"\[k, X, Y, Y\]"):
        decision_uncertainty_utility(P[0])


def test_decision_uncertainty_copying_failure_app_f1():
    """y′ = y is a best response to every leader action, and the leader cannot push the value below ½."""
    P = random_preference_ensemble(5, 4, 6, torch.Generator().manual_seed(4))
    u = decision_uncertainty_utility(P)
    diagonal = u.diagonal(dim1=-2, dim2=-1)
    assert torch.equal(diagonal, torch.full((4, 6), 0.5, dtype=F64))
    assert torch.equal(u.amax(-1), diagonal)  # copying attains the maximum utility ½ for every (x, y)
    # the unregularised game: whatever the leader commits to, the follower's best reply is worth ½ in every context
    assert torch.equal(u.amax(-1).amin(-1), torch.full((4,), 0.5, dtype=F64))
    # regularised, with uniform references: the follower's equilibrium puts its largest mass on the copy, and the
    # game's value stays within τ_F log Y of ½ however the leader plays
    uniform_pi = torch.full((4, 6), 1 / 6, dtype=F64)
    uniform_omega = torch.full((4, 6, 6), 1 / 6, dtype=F64)
    tau = 0.01
    _, omega_star = stackelberg_equilibrium(u, uniform_pi, uniform_omega, tau, tau)
    assert torch.equal(omega_star.argmax(-1), torch.arange(6).expand(4, 6))
    assert float(equilibrium_value(u, uniform_pi, uniform_omega, tau, tau)) >= 0.5 - tau * math.log(6)
    # by contrast, under 4·Var the copy is never the follower's favourite
    _, omega_var = stackelberg_equilibrium(tabular_ensemble_variance(P), uniform_pi, uniform_omega, tau, tau)
    assert not (omega_var.argmax(-1) == torch.arange(6)).any()


# --------------------------------------------------------------------------------------------------------------------
# The Lightning run through the CLI: logs, result file, exact resume
# --------------------------------------------------------------------------------------------------------------------


def _fit(directory, *args):
    cwd = os.getcwd()
    os.chdir(directory)
    try:
        cli = train.main(["fit", "--config", CONFIG, "--trainer.enable_progress_bar=false", *args])
    finally:
        os.chdir(cwd)
    return cli, os.path.join(directory, cli.trainer.log_dir)


def _scalars(log_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    n = 15
    first, first_dir = _fit(tmp_path_factory.mktemp("first"), f"--trainer.max_steps={n}")
    ckpt = os.path.join(first_dir, "checkpoints", "last.ckpt")
    resumed, resumed_dir = _fit(
        tmp_path_factory.mktemp("resumed"), f"--trainer.max_steps={2 * n}", f"--ckpt_path={ckpt}"
    )
    straight, straight_dir = _fit(tmp_path_factory.mktemp("straight"), f"--trainer.max_steps={2 * n}")
    return n, (first, first_dir), (resumed, resumed_dir), (straight, straight_dir)


def test_config_run_logs_decreasing_kl_under_the_bound(runs):
    n, _, _, (cli, log_dir) = runs
    assert cli.trainer.global_step == 2 * n and int(cli.model.iteration) == 2 * n
    for player in ("leader", "follower"):
        kl_t = _scalars(log_dir, f"{player}/kl")
        reverse = _scalars(log_dir, f"{player}/kl_reverse")
        worst = _scalars(log_dir, f"{player}/kl_max")
        bound = _scalars(log_dir, f"{player}/kl_bound")
        assert sorted(kl_t) == list(range(2 * n))  # one point per iteration, step axis = t
        values = [kl_t[t] for t in range(2 * n)]
        if player == "leader":
            assert all(b < a for a, b in zip(values, values[1:]))  # strictly decreasing, last iterate
            assert values[-1] < 0.2 * values[0]
        else:
            assert values[10] < 1e-4 * values[0]  # the fast player: factor 1/2 per step
        assert all(reverse[t] >= 0 for t in kl_t)
        assert all(worst[t] <= bound[t] * (1 + 1e-6) + FLOOR for t in kl_t if bound[t] > 1e-30)
    for tag in ("leader/kl_bound_simple", "follower/utility", "game/value", "game/value_gap"):
        assert len(_scalars(log_dir, tag)) == 2 * n


def test_result_file_holds_the_final_iterate_and_equilibrium(runs):
    n, _, _, (cli, log_dir) = runs
    result = torch.load(os.path.join(log_dir, "smida_result.pt"), weights_only=True)
    hp = cli.model.hparams
    assert result["iteration"] == 2 * n
    pi, omega = smida(
        result["u"],
        result["pi_ref"],
        result["omega_ref"],
        hp.tau_leader,
        hp.tau_follower,
        hp.eta_leader,
        hp.eta_follower,
        2 * n,
    )
    torch.testing.assert_close(result["pi"], pi, rtol=0, atol=1e-15)
    torch.testing.assert_close(result["omega"], omega, rtol=0, atol=1e-15)
    star = stackelberg_equilibrium(result["u"], result["pi_ref"], result["omega_ref"], hp.tau_leader, hp.tau_follower)
    torch.testing.assert_close(result["pi_star"], star[0], rtol=0, atol=1e-15)
    assert result["metrics"]["leader/kl"] < result["metrics"]["leader/kl_bound"]


def test_resume_from_checkpoint_equals_the_uninterrupted_run_bit_for_bit(runs):
    n, (first, _), (resumed, resumed_dir), (straight, straight_dir) = runs
    assert first.trainer.global_step == n and int(first.model.iteration) == n
    assert resumed.trainer.global_step == straight.trainer.global_step == 2 * n
    for name in ("log_pi", "log_omega", "iteration", "u", "log_pi_ref", "log_omega_ref"):
        assert torch.equal(getattr(resumed.model, name), getattr(straight.model, name)), name
    assert not torch.equal(first.model.log_pi, straight.model.log_pi)
    # the resumed run logs the second half only, the same values as the uninterrupted one
    logged = _scalars(resumed_dir, "leader/kl")
    assert sorted(logged) == list(range(n, 2 * n))
    assert all(logged[t] == _scalars(straight_dir, "leader/kl")[t] for t in logged)


def test_log_normalise_paths_agree():
    z = torch.randn(40, 32, 32, dtype=F64, generator=torch.Generator().manual_seed(0))  # large: log_softmax path
    small = z[:2]  # small: logsumexp path
    torch.testing.assert_close(log_normalise(z)[:2], log_normalise(small), rtol=0, atol=1e-14)
    torch.testing.assert_close(log_normalise(small).logsumexp(-1), torch.zeros(2, 32, dtype=F64), rtol=0, atol=1e-14)
