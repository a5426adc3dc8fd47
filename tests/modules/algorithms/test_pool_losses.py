"""The follower losses the pool uses (modules/algorithms/rl_losses.py): sigmoid DPO against its formula and against TRL.

TRL is a test-only dependency: when it is installed, :func:`test_dpo_loss_equals_trl` runs TRL's own loss code
(``DPOTrainer._compute_loss``, loss type ``sigmoid``) on the same sequence log-probabilities, without building a
trainer; without TRL that test is skipped and :func:`test_dpo_loss_matches_the_documented_formula` still checks the
formula TRL documents, ``−log σ(β[(log π_c − log π_ref,c) − (log π_r − log π_ref,r)])``.
"""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from alignment_games.modules.algorithms.rl_losses import dpo_loss, length_normalized_nll

POLICY_CHOSEN = torch.tensor([-12.0, -30.5, -4.25, -50.0])
POLICY_REJECTED = torch.tensor([-15.0, -29.0, -4.0, -80.0])
REF_CHOSEN = torch.tensor([-13.0, -31.0, -4.5, -55.0])
REF_REJECTED = torch.tensor([-14.0, -28.0, -4.0, -70.0])


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


def test_dpo_loss_equals_trl():
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
        loss_types=["sigmoid"],
        loss_weights=[1.0],
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
    ours, chosen_reward, rejected_reward = dpo_loss(POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, beta)
    assert float(ours.mean()) == pytest.approx(float(trl_loss), rel=1e-6)
    metrics = fake_trainer._metrics["train"]
    assert metrics["rewards/chosen"][0] == pytest.approx(float(chosen_reward.mean()), rel=1e-6)
    assert metrics["rewards/rejected"][0] == pytest.approx(float(rejected_reward.mean()), rel=1e-6)


def test_length_normalized_nll_hand_computed():
    # RPO's term: -log pi(chosen) / |chosen|
    out = length_normalized_nll(POLICY_CHOSEN, torch.tensor([4, 61, 1, 10]))
    assert out.tolist() == pytest.approx([3.0, 0.5, 4.25, 5.0])
    with pytest.raises(ValueError, match="at least 1 token"):
        length_normalized_nll(POLICY_CHOSEN, torch.tensor([4, 0, 1, 10]))
    with pytest.raises(ValueError, match="lengths"):
        length_normalized_nll(POLICY_CHOSEN, torch.tensor([4, 1]))
