"""The pairwise losses (alignment_games.modules.algorithms.rl_losses.PairwiseLoss): each against hand values of its
paper's formula and against TRL.

TRL is a test-only dependency: when it is installed, :func:`test_pairwise_losses_equal_trl` runs TRL's own loss code
(``DPOTrainer._compute_loss`` with loss types ``sigmoid``, ``ipo`` and ``sigmoid`` + ``sft``, and the CPO trainer's
``simpo``) on the same sequence log-probabilities, without building a trainer; without TRL that test is skipped and the
hand-value tests still check the formulas TRL documents, e.g. DPO's ``−log σ(β[(log π_c − log π_ref,c) − (log π_r −
log π_ref,r)])``.
"""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from alignment_games.modules.algorithms.rl_losses import PairwiseLoss, dpo_loss, per_token

POLICY_CHOSEN = torch.tensor([-12.0, -30.5, -4.25, -50.0])
POLICY_REJECTED = torch.tensor([-15.0, -29.0, -4.0, -80.0])
REF_CHOSEN = torch.tensor([-13.0, -31.0, -4.5, -55.0])
REF_REJECTED = torch.tensor([-14.0, -28.0, -4.0, -70.0])
LENGTHS = (torch.tensor([4, 2, 1, 10]), torch.tensor([2, 4, 1, 20]))
REF = (REF_CHOSEN, REF_REJECTED)


def test_dpo_loss_matches_the_documented_formula():
    loss, chosen_reward, rejected_reward = dpo_loss(POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.1)
    # pair 0: chosen ratio 1, rejected ratio −1 → −log σ(0.2) = 0.5981389
    assert float(loss[0]) == pytest.approx(-math.log(1 / (1 + math.exp(-0.2))), rel=1e-6)
    assert float(loss[0]) == pytest.approx(0.5981389, rel=1e-6)
    for i in range(4):
        margin = (POLICY_CHOSEN[i] - REF_CHOSEN[i]) - (POLICY_REJECTED[i] - REF_REJECTED[i])
        assert float(loss[i]) == pytest.approx(math.log1p(math.exp(-0.1 * float(margin))), rel=1e-6)
    assert chosen_reward.tolist() == pytest.approx((0.1 * (POLICY_CHOSEN - REF_CHOSEN)).tolist())
    assert rejected_reward.tolist() == pytest.approx((0.1 * (POLICY_REJECTED - REF_REJECTED)).tolist())


class _FakeLM(torch.nn.Module):
    """Returns TRL's fused-LM-head outputs whose per-token log-probs sum to the given sequence log-probs."""

    def __init__(self, logps: torch.Tensor, seq_len: int) -> None:
        super().__init__()
        self.logps, self.seq_len = logps, seq_len

    def forward(self, **kwargs):
        n = self.logps.numel()
        per_token = torch.zeros(n, self.seq_len)
        per_token[:, 0] = self.logps  # the whole sequence log-prob on the first completion token
        zeros = torch.zeros(n, self.seq_len)
        return SimpleNamespace(
            log_probs=per_token,
            entropy=zeros,
            mean_logits=zeros,
            is_top1=torch.zeros(n, self.seq_len, dtype=torch.bool),
        )


@pytest.mark.parametrize(
    ("loss_type", "trl_types", "trl_weights"),
    [("dpo", ["sigmoid"], [1.0]), ("ipo", ["ipo"], [1.0]), ("rpo", ["sigmoid", "sft"], [1.0, 0.5])],
)
def test_pairwise_losses_equal_trl(loss_type, trl_types, trl_weights):
    """TRL's RPO is ``sigmoid`` plus ``sft`` weighted α, its NLL a mean over the chosen tokens: Pang et al.'s per-reply
    mean when the chosen replies have one length (3 here)."""
    trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")
    beta, seq_len = 0.1, 3
    # TRL stacks the batch as [chosen; rejected]; reference log-probs come precomputed in the inputs.
    model = _FakeLM(torch.cat([POLICY_CHOSEN, POLICY_REJECTED]), seq_len)
    identity = SimpleNamespace(gather_for_metrics=lambda x: x, gather=lambda x: x, device=torch.device("cpu"))
    fake_trainer = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=identity,
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=trl_types,
        loss_weights=trl_weights,
        beta=beta,
        label_smoothing=0.0,
        use_weighting=False,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": torch.ones(8, seq_len + 1, dtype=torch.long),
        "attention_mask": torch.ones(8, seq_len + 1, dtype=torch.long),
        "completion_mask": torch.cat([torch.zeros(8, 1), torch.ones(8, seq_len)], dim=1).long(),
        "ref_chosen_logps": REF_CHOSEN,
        "ref_rejected_logps": REF_REJECTED,
    }
    trl_loss = trl_dpo.DPOTrainer._compute_loss(fake_trainer, model, inputs, return_outputs=False)
    lengths = (torch.full((4,), seq_len), torch.full((4,), seq_len))
    ours, chosen_reward, rejected_reward = PairwiseLoss(loss_type, beta, alpha=trl_weights[-1])(
        POLICY_CHOSEN, POLICY_REJECTED, REF, lengths
    )
    assert float(ours.mean()) == pytest.approx(float(trl_loss), rel=1e-6)
    if loss_type != "ipo":  # TRL logs β·(summed log-ratio); IPO's rewards here are the per-token log-ratios it uses
        metrics = fake_trainer._metrics["train"]
        assert metrics["rewards/chosen"][0] == pytest.approx(float(chosen_reward.mean()), rel=1e-6)
        assert metrics["rewards/rejected"][0] == pytest.approx(float(rejected_reward.mean()), rel=1e-6)


def test_simpo_equals_trls_cpo_trainer():
    cpo = pytest.importorskip("trl.experimental.cpo.cpo_trainer")
    beta, gamma = 2.0, 0.5
    fake_trainer = SimpleNamespace(
        alpha=0.0,
        loss_type="simpo",
        simpo_gamma=gamma,
        beta=beta,
        label_smoothing=0.0,
        accelerator=SimpleNamespace(device=torch.device("cpu")),
    )
    # the CPO trainer averages each reply's log-probabilities over its tokens before the loss (SimPO's |y|)
    averaged = (POLICY_CHOSEN / LENGTHS[0], POLICY_REJECTED / LENGTHS[1])
    trl_loss, trl_chosen, trl_rejected = cpo.CPOTrainer.cpo_loss(fake_trainer, *averaged)
    ours, chosen_reward, rejected_reward = PairwiseLoss("simpo", beta, gamma)(
        POLICY_CHOSEN, POLICY_REJECTED, None, LENGTHS
    )
    torch.testing.assert_close(ours, trl_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(chosen_reward, trl_chosen)
    torch.testing.assert_close(rejected_reward, trl_rejected)


def test_ipo_by_hand():
    # per-token log-ratios (chosen − rejected): 1/4 + 1/2, 0.5/2 + 1/4, 0.25/1 − 0, 5/10 + 10/20; target 1/(2·0.1) = 5
    loss, chosen, rejected = PairwiseLoss("ipo", beta=0.1)(POLICY_CHOSEN, POLICY_REJECTED, REF, LENGTHS)
    assert loss.tolist() == pytest.approx([4.25**2, 4.5**2, 4.75**2, 4.0**2])
    assert chosen.tolist() == pytest.approx([0.25, 0.25, 0.25, 0.5])
    assert rejected.tolist() == pytest.approx([-0.5, -0.25, 0.0, -0.5])


def test_simpo_by_hand_ignores_the_reference():
    # β·mean log-probs: chosen −6, −30.5, −8.5, −10; rejected −15, −14.5, −8, −8; minus γ = 0.5
    loss, chosen, rejected = PairwiseLoss("simpo", beta=2.0, gamma=0.5)(POLICY_CHOSEN, POLICY_REJECTED, None, LENGTHS)
    assert loss.tolist() == pytest.approx([math.log1p(math.exp(-z)) for z in (8.5, -16.5, -1.0, -2.5)], rel=1e-6)
    assert chosen.tolist() == pytest.approx([-6.0, -30.5, -8.5, -10.0])
    assert rejected.tolist() == pytest.approx([-15.0, -14.5, -8.0, -8.0])


def test_rpo_by_hand_is_dpo_plus_the_weighted_nll():
    # pair 0: DPO's −log σ(0.2) = 0.5981389 plus α · 12/4
    loss, chosen, _ = PairwiseLoss("rpo", beta=0.1, alpha=0.5)(POLICY_CHOSEN, POLICY_REJECTED, REF, LENGTHS)
    assert float(loss[0]) == pytest.approx(0.5981389 + 0.5 * 3.0, rel=1e-6)
    dpo, _, _ = PairwiseLoss("dpo", beta=0.1)(POLICY_CHOSEN, POLICY_REJECTED, REF, LENGTHS)
    assert (loss - dpo).tolist() == pytest.approx([0.5 * 3.0, 0.5 * 15.25, 0.5 * 4.25, 0.5 * 5.0])
    assert chosen.tolist() == pytest.approx([0.1, 0.05, 0.025, 0.5])


@pytest.mark.parametrize(
    ("field", "bad", "name"),
    [
        ("loss_type", "kto", "pairwise.loss_type"),
        ("beta", 0.0, "pairwise.beta"),
        ("gamma", -0.1, "pairwise.gamma"),
        ("alpha", float("nan"), "pairwise.alpha"),
    ],
)
def test_bad_pairwise_settings_are_refused_by_name(field, bad, name):
    with pytest.raises(ValueError, match=name):
        PairwiseLoss(**{field: bad})


def test_per_token_log_probabilities_by_hand():
    # RPO's NLL term is −log π(chosen) / |chosen|; IPO's and SimPO's margins divide the same way
    out = per_token(POLICY_CHOSEN, torch.tensor([4, 61, 1, 10]))
    assert out.tolist() == pytest.approx([-3.0, -0.5, -4.25, -5.0])
    with pytest.raises(ValueError, match="at least 1 token"):
        per_token(POLICY_CHOSEN, torch.tensor([4, 0, 1, 10]))
    with pytest.raises(ValueError, match="lengths"):
        per_token(POLICY_CHOSEN, torch.tensor([4, 1]))
