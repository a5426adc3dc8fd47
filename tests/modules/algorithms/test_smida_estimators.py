"""Deep-SMIDA estimators (eqs. 22-25) against exact policy gradients on tabular softmax policies."""

import pytest
import torch

from alignment_games.modules import stackelberg_equilibrium
from alignment_games.modules.algorithms.smida_estimators import (
    follower_advantages,
    leader_advantages,
    leave_one_out_baseline,
    smida_surrogate_losses,
)

X, Y = 3, 4
TAU_L, TAU_F = 0.3, 0.5


def _game(seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(X, Y, Y, generator=g, dtype=torch.float64)
    ref_l = torch.randn(X, Y, generator=g, dtype=torch.float64)
    ref_f = torch.randn(X, Y, Y, generator=g, dtype=torch.float64)
    theta = (ref_l + 0.5 * torch.randn(X, Y, generator=g, dtype=torch.float64)).requires_grad_()
    phi = (ref_f + 0.5 * torch.randn(X, Y, Y, generator=g, dtype=torch.float64)).requires_grad_()
    return u, ref_l.log_softmax(-1), ref_f.log_softmax(-1), theta, phi


def _exact_gradients(u, logpi_ref, logom_ref, theta, phi):
    logpi, logom = theta.log_softmax(-1), phi.log_softmax(-1)
    pi, om = logpi.exp(), logom.exp()
    kl_f = (om * (logom - logom_ref)).sum(-1)  # [X, Y]
    r_hat = (om * u).sum(-1) - TAU_F * kl_f  # plug-in cost of each (x, y)
    j_f = (pi.detach() * r_hat).sum(-1).mean()  # J^F, rho uniform; theta held fixed for the follower
    (g_phi,) = torch.autograd.grad(j_f, phi)
    kl_l = (pi * (logpi - logpi_ref)).sum(-1)
    j_l = ((pi * r_hat.detach()).sum(-1) + TAU_L * kl_l).mean()  # J^L with the plug-in cost held fixed
    (g_theta,) = torch.autograd.grad(j_l, theta)
    return g_theta, g_phi


def _estimate(u, logpi_ref, logom_ref, theta, phi, b, d, m, gen):
    x = torch.randint(0, X, (b,), generator=gen)
    logpi, logom = theta.log_softmax(-1), phi.log_softmax(-1)
    y = torch.multinomial(logpi[x].detach().exp(), d, replacement=True, generator=gen)  # [B, D]
    probs_f = logom[x[:, None], y].detach().exp().reshape(b * d, Y)
    y2 = torch.multinomial(probs_f, m, replacement=True, generator=gen).reshape(b, d, m)
    xb, yb = x[:, None, None].expand(b, d, m), y[:, :, None].expand(b, d, m)
    out = smida_surrogate_losses(
        u[xb, yb, y2],
        logpi[x[:, None], y],
        logpi_ref[x[:, None], y],
        logom[xb, yb, y2],
        logom_ref[xb, yb, y2],
        TAU_L,
        TAU_F,
    )
    g_theta = torch.autograd.grad(out["leader_loss"], theta)[0]
    g_phi = -torch.autograd.grad(out["follower_loss"], phi)[0]  # the loss is -J^F estimate
    return g_theta, g_phi


def test_estimators_are_unbiased_for_the_exact_gradients():
    u, logpi_ref, logom_ref, theta, phi = _game()
    exact_theta, exact_phi = _exact_gradients(u, logpi_ref, logom_ref, theta, phi)
    gen = torch.Generator().manual_seed(1)
    runs = [_estimate(u, logpi_ref, logom_ref, theta, phi, b=600, d=3, m=3, gen=gen) for _ in range(300)]
    for idx, exact in ((0, exact_theta), (1, exact_phi)):
        est = torch.stack([r[idx] for r in runs])
        mean, se = est.mean(0), est.std(0) / len(runs) ** 0.5
        z = (mean - exact).abs() / (se + 1e-12)
        assert z.max() < 5.0, (idx, z.max())  # within Monte Carlo error
        assert (exact.abs() > 1e-3).any()


def _enumerated_follower_gradients(u, logits, logits_ref, tau, baseline):
    """Exact mean and covariance trace of eq. (23)'s gradient over all M = 2 draws of a 3-action follower.

    ``baseline``: ``"none"`` (the plain ``A``), ``"module"`` (the advantage ``follower_advantages`` returns, with its
    leave-one-out baseline) or ``"own mean"`` (``A`` less the mean that includes the sample itself).
    """
    mean, second = torch.zeros(3, dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    probs = logits.softmax(-1)
    for y1 in range(3):
        for y2 in range(3):
            phi = logits.clone().requires_grad_()
            y = torch.tensor([y1, y2])
            logp = phi.log_softmax(-1)[y].reshape(1, 1, 2)
            a, _, module_adv = follower_advantages(
                u[y].reshape(1, 1, 2), logp, logits_ref.log_softmax(-1)[y].reshape(1, 1, 2), tau
            )
            adv = {"none": a, "module": module_adv, "own mean": a - a.mean(-1, keepdim=True)}[baseline]
            (g,) = torch.autograd.grad((adv.detach() * logp).mean(), phi)
            weight = probs[y1] * probs[y2]
            mean, second = mean + weight * g, second + weight * (g * g).sum()
    return mean, second - (mean * mean).sum()


def test_the_baselines_are_needed_only_for_variance():
    """Eq. (23) by exact enumeration: the leave-one-out baseline leaves the expected gradient exactly where it is
    without a baseline (the true gradient of E_ω[u] − τ_F KL(ω ‖ ω_ref)) and lowers the variance; a baseline that
    includes the sample's own value (the plain mean) biases it."""
    u = torch.tensor([5.0, 6.0, 5.5], dtype=torch.float64)  # utilities far from 0: a baseline matters for variance
    logits = torch.tensor([0.2, -0.4, 0.1], dtype=torch.float64)
    logits_ref = torch.tensor([0.0, 0.3, -0.2], dtype=torch.float64)
    tau = 0.5
    phi = logits.clone().requires_grad_()
    logw, logw_ref = phi.log_softmax(-1), logits_ref.log_softmax(-1)
    objective = (logw.exp() * u).sum() - tau * (logw.exp() * (logw - logw_ref)).sum()
    (exact,) = torch.autograd.grad(objective, phi)
    plain_mean, plain_var = _enumerated_follower_gradients(u, logits, logits_ref, tau, "none")
    loo_mean, loo_var = _enumerated_follower_gradients(u, logits, logits_ref, tau, "module")
    torch.testing.assert_close(plain_mean, exact, atol=1e-12, rtol=0)
    torch.testing.assert_close(loo_mean, exact, atol=1e-12, rtol=0)  # the baseline changes no expectation
    assert loo_var < 0.1 * plain_var  # and removes most of the variance of utilities near 5
    own_mean, _ = _enumerated_follower_gradients(u, logits, logits_ref, tau, "own mean")
    assert (own_mean - exact).abs().max() > 0.01  # a sample-dependent baseline is biased: the identity matters
    v = torch.tensor([[1.0, 2.0, 6.0]])
    assert leave_one_out_baseline(v).tolist() == [[4.0, 3.5, 1.5]]
    with pytest.raises(ValueError, match="at least 2"):
        leave_one_out_baseline(torch.ones(2, 1))


def test_advantages_by_hand():
    u = torch.tensor([[[1.0, 0.0], [0.5, 0.5]]])  # B=1, D=2, M=2
    lf = torch.tensor([[[-1.0, -2.0], [-1.0, -1.0]]])
    lf_ref = torch.tensor([[[-1.5, -1.0], [-1.0, -2.0]]])
    a, a_bar, adv = follower_advantages(u, lf, lf_ref, tau_follower=0.5)
    # A = u - 0.5 * (lf - lf_ref)
    torch.testing.assert_close(a, torch.tensor([[[0.75, 0.5], [0.5, 0.0]]]))
    torch.testing.assert_close(a_bar, torch.tensor([[0.625, 0.25]]))
    torch.testing.assert_close(adv, torch.tensor([[[0.25, -0.25], [0.5, -0.5]]]))
    ll, ll_ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-2.0, -2.0]])
    adv_l = leader_advantages(a_bar, ll, ll_ref, tau_leader=0.1)
    # L = [0.625 + 0.1, 0.25 + 0] ; L - LOO = [0.725 - 0.25, 0.25 - 0.725]
    torch.testing.assert_close(adv_l, torch.tensor([[0.475, -0.475]]))
    with pytest.raises(ValueError, match=r"\[B, D, M\]"):
        follower_advantages(u[0], lf[0], lf_ref[0], 0.5)


def _closed_form_gradients(u, logpi_ref, logom_ref, theta, phi):
    """``_exact_gradients`` without autograd: the softmax Jacobian applied by hand (about 10x faster per step).

    ∂J^F/∂φ[x, y] = π(y|x)/X · ω ⊙ (a − ⟨ω, a⟩) with a = u − τ_F (log ω − log ω_ref); ∂J^L/∂θ[x] = π/X ⊙ (b − ⟨π, b⟩)
    with b = r̂ + τ_L (log π − log π_ref) (the constant terms of the entropy derivatives cancel in the Jacobian).
    """
    logpi, logom = theta.log_softmax(-1), phi.log_softmax(-1)
    pi, om = logpi.exp(), logom.exp()
    a = u - TAU_F * (logom - logom_ref)
    r_hat = (om * a).sum(-1)
    g_phi = (pi / X)[..., None] * om * (a - r_hat[..., None])
    b = r_hat + TAU_L * (logpi - logpi_ref)
    g_theta = pi / X * (b - (pi * b).sum(-1, keepdim=True))
    return g_theta, g_phi


def test_exact_gradient_play_approaches_the_closed_form_equilibrium():
    u, logpi_ref, logom_ref, theta, phi = _game(3)
    for at in ((theta, phi), (logpi_ref.clone().requires_grad_(), logom_ref.clone().requires_grad_())):
        for by_hand, by_autograd in zip(
            _closed_form_gradients(u, logpi_ref, logom_ref, *at), _exact_gradients(u, logpi_ref, logom_ref, *at)
        ):
            torch.testing.assert_close(by_hand, by_autograd, atol=1e-14, rtol=0)
    theta, phi = logpi_ref.clone(), logom_ref.clone()
    for _ in range(1500):  # as close to the equilibrium (1e-5) as 6000 steps of 2.0 and 8.0
        g_theta, g_phi = _closed_form_gradients(u, logpi_ref, logom_ref, theta, phi)
        theta -= 8.0 * g_theta  # leader descends, slow
        phi += 32.0 * g_phi  # follower ascends, fast
    at_end = (theta.clone().requires_grad_(), phi.clone().requires_grad_())
    for by_hand, by_autograd in zip(
        _closed_form_gradients(u, logpi_ref, logom_ref, theta, phi), _exact_gradients(u, logpi_ref, logom_ref, *at_end)
    ):
        torch.testing.assert_close(by_hand, by_autograd, atol=1e-14, rtol=0)
    pi_star, om_star = stackelberg_equilibrium(u, logpi_ref.exp(), logom_ref.exp(), TAU_L, TAU_F)
    torch.testing.assert_close(theta.softmax(-1), pi_star, atol=1e-4, rtol=0)
    torch.testing.assert_close(phi.softmax(-1), om_star, atol=1e-4, rtol=0)
