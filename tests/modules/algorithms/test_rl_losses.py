"""GRPO and DPO losses against hand-computed values and exact gradients."""

import math
import os

import pytest
import torch
import yaml
from helpers import ROOT

from alignment_games.modules.algorithms.rl_losses import (
    PolicyGradient,
    dpo_loss,
    group_advantages,
    grpo_loss,
    truncated_is_weights,
)


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 3.0])
    plain = group_advantages(r, 2, scale=False)
    assert torch.allclose(plain, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0]))
    scaled = group_advantages(r, 2, eps=0.0 + 1e-4)
    std = math.sqrt(0.5)  # unbiased std of {0, 1}
    assert scaled[0].item() == pytest.approx(0.5 / (std + 1e-4))
    assert scaled[4].item() == 0.0 and scaled[5].item() == 0.0  # equal rewards: no signal, no 0/0
    g3 = group_advantages(torch.tensor([0.0, 1.0, 2.0]), 3, scale=False)
    assert torch.allclose(g3, torch.tensor([-1.0, 0.0, 1.0]))


def test_group_advantages_of_a_near_tied_pair_are_exact_negatives():
    """float32 rewards a few ulps apart: a float32 mean skews them (0 and 0.0024 for the 3.1 pair), float64 does not."""
    r = torch.tensor([100.0, 100.00003, 3.1, 3.1000001, -7.3, -7.29999])
    adv = group_advantages(r, 2)
    assert adv.dtype == torch.float32
    assert torch.equal(adv[0::2], -adv[1::2])
    d = r.double().view(-1, 2)
    want = (d[:, 1] - d[:, 0]) / 2 / (math.sqrt(2) * (d[:, 1] - d[:, 0]).abs() / 2 + 1e-4)  # by hand: ±(d/2)/(std+eps)
    torch.testing.assert_close(adv[1::2].double(), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize(("rewards", "g"), [(torch.ones(5), 2), (torch.ones(4), 1), (torch.ones(2, 2), 2)])
def test_group_advantages_rejects_bad_shapes(rewards, g):
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(rewards, g)


def test_grpo_on_policy_gradient_is_advantage_weighted_mean_score():
    torch.manual_seed(0)
    lp = torch.randn(3, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    adv = torch.tensor([1.0, -2.0, 0.5])
    loss, stats = grpo_loss(lp, mask, adv)
    loss.backward()
    # d loss / d lp[i, t] = -A_i * mask[i, t] / |o_i| / N (ratio = 1 on-policy)
    expected = -adv[:, None] * mask / mask.sum(1, keepdim=True) / 3
    assert torch.allclose(lp.grad, expected)
    assert loss.item() == pytest.approx(-adv.mean().item())
    assert stats["ratio"].item() == pytest.approx(1.0) and stats["clip_fraction"].item() == 0.0
    assert stats["kl"].item() == 0.0


def test_grpo_clipping_and_k3_kl_by_hand():
    lp = torch.log(torch.tensor([[0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.25, 0.5]]))  # ratios 2.0 and 1.0
    ref = torch.log(torch.tensor([[0.5, 0.25]]))  # r = log(ref/pi): 0 and log 0.5
    mask = torch.ones(1, 2)
    loss, stats = grpo_loss(lp, mask, torch.tensor([1.0]), old, ref, clip=0.2, beta=0.1)
    kl2 = 0.5 - math.log(0.5) - 1.0
    per_token = torch.tensor([1.2 * 1.0, 1.0 * 1.0]) - 0.1 * torch.tensor([0.0, kl2])
    assert loss.item() == pytest.approx(-per_token.mean().item(), rel=1e-6)
    assert stats["clip_fraction"].item() == pytest.approx(0.5)
    assert stats["kl"].item() == pytest.approx(kl2 / 2, rel=1e-6)
    # negative advantage: min picks the unclipped 2.0·(−1) (pessimistic bound)
    loss_neg, _ = grpo_loss(lp, mask, torch.tensor([-1.0]), old, clip=0.2)
    assert loss_neg.item() == pytest.approx(-(-2.0 - 1.0) / 2)


def test_policy_gradient_group_applies_its_settings_by_hand():
    """The one update GRPO, debate and the pool call: its clip, KL coefficient, group size and scaling, by hand."""
    lp = torch.log(torch.tensor([[0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.25, 0.5]]))  # ratios 2.0 and 1.0
    ref = torch.log(torch.tensor([[0.5, 0.25]]))  # k3 KL 0 and 0.5 - log 0.5 - 1
    kl2 = 0.5 - math.log(0.5) - 1.0
    loss, stats = PolicyGradient(clip=0.2, kl_coef=0.1).loss(lp, torch.ones(1, 2), torch.tensor([1.0]), old, ref)
    assert loss.item() == pytest.approx(-(1.2 + 1.0 - 0.1 * kl2) / 2, rel=1e-6)
    assert stats["clip_fraction"].item() == pytest.approx(0.5)
    unclipped, _ = PolicyGradient(clip=None).loss(lp, torch.ones(1, 2), torch.tensor([1.0]), old)
    assert unclipped.item() == pytest.approx(-(2.0 + 1.0) / 2)
    r = torch.tensor([1.0, 0.0, 2.0, 2.0, 5.0, 5.0])
    assert PolicyGradient(group_size=3, scale_advantages=False).advantages(r).tolist() == [
        0.0,
        -1.0,
        1.0,
        -2.0,
        1.0,
        1.0,
    ]
    assert PolicyGradient(group_size=2).advantages(r)[0].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-4))
    # Online RFT: the 0/1 reward is the advantage, so an all-correct group still pushes and a wrong reply is ignored
    rft = PolicyGradient(group_size=2, baseline=False, scale_advantages=False)
    assert rft.advantages(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])).tolist() == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    loss, _ = rft.loss(lp, torch.ones(1, 2), torch.tensor([1.0]))  # exp(lp - lp.detach()) is 1: the loss is -A
    assert loss.item() == pytest.approx(-1.0)


def test_online_rft_as_published_is_the_hand_gradient_without_kl_or_clip():
    """configs/rft_smollm2.yaml's update is DeepSeekMath §5.2.1's Online RFT: gradient coefficient 1 for a correct
    reply and 0 otherwise, averaged over each reply's tokens and over the replies; no KL term even when the reference
    differs from the policy, and no clip."""
    with open(os.path.join(ROOT, "configs", "rft_smollm2.yaml"), encoding="utf-8") as f:
        pg = PolicyGradient(**yaml.safe_load(f)["model"]["init_args"]["policy_gradient"])
    assert (pg.baseline, pg.scale_advantages, pg.kl_coef, pg.clip) == (False, False, 0.0, None)
    correct = torch.tensor([1.0, 0.0, 1.0, 1.0])
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1], [-2.0, -0.1, -0.4], [-0.9, -0.2, -0.6]])
    lp.requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    ref = lp.detach() + torch.tensor([0.7, -0.4, 0.2])  # a reference that is not the policy
    loss, stats = pg.loss(lp, mask, pg.advantages(correct), ref=ref)
    loss.backward()
    # ∂loss/∂log π(o_i,t) = −GC_i / (N |o_i|), N = 4: rows of 2, 3, 1 and 3 tokens, the second reply wrong
    hand = torch.tensor([[-1 / 8, -1 / 8, 0.0], [0.0, 0.0, 0.0], [-1 / 4, 0.0, 0.0], [-1 / 12, -1 / 12, -1 / 12]])
    torch.testing.assert_close(lp.grad, hand, rtol=0, atol=1e-7)
    assert loss.item() == pytest.approx(-3 / 4)  # on-policy, ratio 1: −mean GC
    # k3 per column e^r − r − 1 at r = 0.7, −0.4, 0.2: 0.3137527, 0.0703200, 0.0214028; per-reply means 0.1920364,
    # 0.1351585, 0.3137527, 0.1351585, mean 0.1940265; measured per token (4, 3, 2 tokens a column), weighing nothing
    assert stats["kl"].item() == pytest.approx((4 * 0.3137527 + 3 * 0.07032 + 2 * 0.0214028) / 9, rel=1e-5)
    with_kl, _ = PolicyGradient(**{**pg.__dict__, "kl_coef": 0.04}).loss(lp, mask, pg.advantages(correct), ref=ref)
    assert with_kl.item() == pytest.approx(-0.75 + 0.04 * 0.1940265, rel=1e-6)  # GRPO's KL 0.04 does weigh


@pytest.mark.parametrize(
    ("field", "bad", "message"),
    [
        ("group_size", 1, "policy_gradient.group_size must be at least 2, got 1"),
        ("updates_per_batch", 0, "policy_gradient.updates_per_batch must be at least 1, got 0"),
        ("micro_batch", -1, "policy_gradient.micro_batch must be at least 0, got -1"),
        ("logprob_micro_batch", -1, r"policy_gradient.kl_coef \(0.0\) and logprob_micro_batch \(-1\)"),
        ("kl_coef", -0.1, r"policy_gradient.kl_coef \(-0.1\) and logprob_micro_batch \(0\) must be at least 0"),
        ("kl_coef", float("nan"), r"policy_gradient.kl_coef \(nan\)"),
        ("clip", 0.0, "policy_gradient.clip must be positive or null, got 0.0"),
        ("baseline", False, "policy_gradient.scale_advantages must be false when policy_gradient.baseline is false"),
    ],
)
def test_policy_gradient_refuses_values_naming_the_field(field, bad, message):
    with pytest.raises(ValueError, match=message):
        PolicyGradient(**{field: bad})


def test_grpo_errors():
    with pytest.raises(ValueError, match="ref_token_logprobs"):
        grpo_loss(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2), beta=0.1)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(3))


def test_dpo_loss_by_hand():
    pc, pr = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0])
    rc, rr = torch.tensor([-1.5, -2.0]), torch.tensor([-2.5, -2.0])
    loss, cr, rj = dpo_loss(pc, pr, rc, rr, beta=0.1)
    # margins: (0.5 - (-0.5)) = 1.0 and (0 - 1) = -1.0
    assert loss[0].item() == pytest.approx(-math.log(1 / (1 + math.exp(-0.1))))
    assert loss[1].item() == pytest.approx(-math.log(1 / (1 + math.exp(0.1))))
    assert torch.allclose(cr, torch.tensor([0.05, 0.0])) and torch.allclose(rj, torch.tensor([-0.05, 0.1]))
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(pc, pr, rc, rr, beta=0.0)


def test_truncated_importance_weights_on_hand_values():
    trainer = torch.tensor([[-1.0, -2.0, -0.5]])
    engine = torch.tensor([[-1.0, -2.5, -3.0]])
    w = truncated_is_weights(trainer, engine, cap=2.0)
    assert torch.allclose(w, torch.tensor([[1.0, math.exp(0.5), 2.0]]))  # exp(2.5) = 12.2 is capped at 2


def test_the_engine_logprob_gap_is_logged_and_the_capped_weights_scale_each_tokens_gradient():
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    engine = torch.tensor([[-1.0, -2.5, -3.0]])
    mask, adv = torch.ones(1, 3), torch.tensor([2.0])
    loss, stats = grpo_loss(lp, mask, adv, clip=None, sampled=engine, tis_cap=2.0)
    weights = [1.0, math.exp(0.5), 2.0]
    assert loss.item() == pytest.approx(-2.0 * sum(weights) / 3, rel=1e-6)  # on-policy ratio 1: −mean(w·A)
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[-2.0 * w / 3 for w in weights]]))
    assert stats["logprob_gap"].item() == pytest.approx((0.0 + 0.5 + 2.5) / 3)
    plain, plain_stats = grpo_loss(lp, mask, adv, clip=None, sampled=engine)  # no cap: the gap alone, loss as before
    assert plain.item() == pytest.approx(-2.0) and plain_stats["logprob_gap"].item() == pytest.approx(1.0)
    assert "logprob_gap" not in grpo_loss(lp, mask, adv)[1]
    with pytest.raises(ValueError, match="policy_gradient.tis_cap"):
        PolicyGradient(tis_cap=0.5)
