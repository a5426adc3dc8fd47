"""NLHF (Nash-MD-PG) and SLHF estimators against hand values and exact enumeration on tabular softmax policies."""

import itertools
import math

import pytest
import torch

from alignment_games.modules.algorithms.baselines import (
    geometric_mixture_logprobs,
    nash_md_pg_surrogate_loss,
    slhf_surrogate_losses,
)

Y = 3


def test_geometric_mixture_hand_value():
    # pi = (1/2, 1/2), mu = (9/10, 1/10), beta = 1/2: weights sqrt(.45) : sqrt(.05) = 3 : 1
    p = torch.tensor([0.5, 0.5]).log()
    mu = torch.tensor([0.9, 0.1]).log()
    mix = geometric_mixture_logprobs(p, mu, 0.5).exp()
    assert torch.allclose(mix, torch.tensor([0.75, 0.25]), atol=1e-6)
    assert torch.allclose(geometric_mixture_logprobs(p, mu, 0.0).exp(), torch.tensor([0.5, 0.5]))
    assert torch.allclose(geometric_mixture_logprobs(p, mu, 1.0).exp(), torch.tensor([0.9, 0.1]))


def test_geometric_mixture_keeps_excluded_tokens_excluded_and_refuses_bad_beta():
    p = torch.tensor([0.0, -math.inf, math.log(0.5)])
    p = torch.log_softmax(p, -1)
    mu = torch.log_softmax(torch.tensor([0.0, 0.0, -math.inf]), -1)
    mix = geometric_mixture_logprobs(p, mu, 0.3).exp()
    assert torch.allclose(mix, torch.tensor([1.0, 0.0, 0.0]))
    assert torch.allclose(geometric_mixture_logprobs(p, mu, 0.0).exp(), p.exp())  # 0·(−inf) is not NaN
    with pytest.raises(ValueError, match="beta"):
        geometric_mixture_logprobs(p, mu, 1.5)
    with pytest.raises(ValueError, match="shape"):
        geometric_mixture_logprobs(p, mu[:2], 0.5)


def _tabular(seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(Y, Y, generator=g, dtype=torch.float64)
    pref = torch.sigmoid(4 * (a - a.T))  # P(i ≻ j), antisymmetric: P(j ≻ i) = 1 − P(i ≻ j)
    ref = torch.randn(Y, generator=g, dtype=torch.float64).log_softmax(-1)
    theta = (ref + 0.7 * torch.randn(Y, generator=g, dtype=torch.float64)).requires_grad_()
    return pref, ref, theta


def test_nash_md_pg_expectation_is_the_exact_gradient():
    """Σ_y Σ_y′ π(y) π^β(y′) ∇(−loss(y, y′)) = ∇_θ [P(π_θ ≻ π^β) − τ KL(π_θ ‖ μ)] with π^β held fixed."""
    pref, ref, theta = _tabular()
    tau, beta = 0.3, 0.25
    logpi = theta.log_softmax(-1)
    mix = geometric_mixture_logprobs(logpi.detach(), ref, beta).exp()
    pi = logpi.exp()
    objective = (pi[:, None] * mix[None, :] * pref).sum() - tau * (pi * (logpi - ref)).sum()
    (exact,) = torch.autograd.grad(objective, theta, retain_graph=True)
    expected = torch.zeros_like(theta)
    for y, y2 in itertools.product(range(Y), range(Y)):
        out = nash_md_pg_surrogate_loss(pref[y, y2].reshape(1), logpi[y].reshape(1), ref[y].reshape(1), tau)
        (g,) = torch.autograd.grad(-out["loss"], theta, retain_graph=True)
        expected += pi[y].detach() * mix[y2] * g
    assert torch.allclose(expected, exact, atol=1e-12)
    assert exact.abs().max() > 1e-2


def test_nash_md_pg_hand_value_and_diagnostics():
    pref = torch.tensor([0.9, 0.2])
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0])
    out = nash_md_pg_surrogate_loss(pref, lp, ref, tau=0.5)
    # advantages: 0.9 − 0.5 − 0.5·0.5 = 0.15;  0.2 − 0.5 − 0.5·(−1) = 0.2
    assert torch.allclose(out["advantage"], torch.tensor([0.15, 0.2]))
    out["loss"].backward()
    assert torch.allclose(lp.grad, -torch.tensor([0.15, 0.2]) / 2)
    assert out["win_rate"].item() == pytest.approx(0.55)
    assert out["kl"].item() == pytest.approx((0.5 - 1.0) / 2)


def test_nash_md_pg_refuses_bad_input():
    lp = torch.zeros(2)
    with pytest.raises(ValueError, match="preference must be probabilities.*entry 1"):
        nash_md_pg_surrogate_loss(torch.tensor([0.5, 1.2]), lp, lp, 0.1)
    with pytest.raises(ValueError, match="entry 0 is nan"):
        nash_md_pg_surrogate_loss(torch.tensor([math.nan, 0.5]), lp, lp, 0.1)
    with pytest.raises(ValueError, match="tau"):
        nash_md_pg_surrogate_loss(torch.tensor([0.5, 0.5]), lp, lp, 0.0)
    with pytest.raises(ValueError, match="shape"):
        nash_md_pg_surrogate_loss(torch.tensor([0.5]), lp, lp, 0.1)


@pytest.mark.parametrize("d, m", [(2, 2), (1, 1), (1, 2), (2, 1)])
def test_slhf_expectation_is_the_exact_stackelberg_gradient(d, m):
    """Exact expectation over every leader and follower draw (Y = 2) of SLHF's estimates equals the gradients of the
    regularised SLHF objective: the leader ascends P0(y ≻ y′) − τ_L KL, the follower P0(y′ ≻ y). D = M = 2: the
    leave-one-out baselines; D or M = 1 (Table 3's budget is D = M = 1): that player's constant baseline ½."""
    y_n, tau_l, tau_f = 2, 0.3, 0.2
    g = torch.Generator().manual_seed(1)
    a = torch.rand(y_n, y_n, generator=g, dtype=torch.float64)
    pref = torch.sigmoid(3 * (a - a.T))
    ref_l = torch.randn(y_n, generator=g, dtype=torch.float64).log_softmax(-1)
    ref_f = torch.randn(y_n, y_n, generator=g, dtype=torch.float64).log_softmax(-1)
    theta = (ref_l + 0.5 * torch.randn(y_n, generator=g, dtype=torch.float64)).requires_grad_()
    phi = (ref_f + 0.5 * torch.randn(y_n, y_n, generator=g, dtype=torch.float64)).requires_grad_()
    logpi, logom = theta.log_softmax(-1), phi.log_softmax(-1)
    pi, om = logpi.exp(), logom.exp()
    # follower value per leader answer: E_ω P0(y′ ≻ y) − τ_F KL(ω(·|y) ‖ ω_ref(·|y)); P0(y′ ≻ y) = pref[y′, y]
    v = (om * pref.T).sum(-1) - tau_f * (om * (logom - ref_f)).sum(-1)
    (g_phi,) = torch.autograd.grad((pi.detach() * v).sum(), phi, retain_graph=True)
    leader_obj = (pi * (1 - v.detach())).sum() - tau_l * (pi * (logpi - ref_l)).sum()  # the leader maximises
    (g_theta,) = torch.autograd.grad(leader_obj, theta, retain_graph=True)
    e_theta, e_phi = torch.zeros_like(theta), torch.zeros_like(phi)
    for ys in itertools.product(range(y_n), repeat=d):
        for y2s in itertools.product(range(y_n), repeat=d * m):
            y = torch.tensor(ys)
            y2 = torch.tensor(y2s).view(1, d, m)
            yy = y.view(1, d, 1).expand(1, d, m)
            prob = pi[y].prod().detach() * om[yy, y2].prod().detach()
            out = slhf_surrogate_losses(
                pref[yy, y2], logpi[y].view(1, d), ref_l[y].view(1, d), logom[yy, y2], ref_f[yy, y2], tau_l, tau_f
            )
            gt = torch.autograd.grad(-out["leader_loss"], theta, retain_graph=True)[0]
            gp = torch.autograd.grad(-out["follower_loss"], phi, retain_graph=True)[0]
            e_theta += prob * gt
            e_phi += prob * gp
    # unbiased: the leave-one-out and constant baselines add nothing in expectation
    assert torch.allclose(e_theta, g_theta, atol=1e-12)
    assert torch.allclose(e_phi, g_phi, atol=1e-12)
    assert g_theta.abs().max() > 1e-3 and g_phi.abs().max() > 1e-3  # not a trivially zero comparison


def test_slhf_reads_preferences_leader_first_and_refuses_non_probabilities():
    p = torch.tensor([[[0.8, 0.6], [0.3, 0.1]]])
    z2, z3 = torch.zeros(1, 2), torch.zeros(1, 2, 2)
    out = slhf_surrogate_losses(p, z2, z2, z3, z3, 0.1, 0.1)
    assert out["leader_win_rate"].item() == pytest.approx(0.45)
    assert out["utility_mean"].item() == pytest.approx(0.55)  # the follower's mean P0(y′ ≻ y)
    assert torch.allclose(out["a_bar"], torch.tensor([[0.3, 0.8]], dtype=p.dtype))
    with pytest.raises(ValueError, match="entry 3 is -0.1"):
        slhf_surrogate_losses(torch.tensor([[[0.8, 0.6], [0.3, -0.1]]]), z2, z2, z3, z3, 0.1, 0.1)
