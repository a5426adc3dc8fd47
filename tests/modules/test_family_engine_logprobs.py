"""The pool's GRPO followers and the debate family feed a rollout's sampling log-probs (an engine's) to the loss.

Their rows carry hand-set log-probs (the trainer's minus a known offset per token, tests/helpers/engine_logprobs.py):
the logged ``rollout/logprob_gap``, the loss and the gradients then follow by hand from each row's own tokens, as in
the GRPO loss's own test (tests/modules/algorithms/test_rl_losses.py), with and without ``tis_cap``.
"""

import dataclasses
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from helpers.debate import tiny_debate_module
from helpers.engine_logprobs import engine_like, offset_gap, reference_grads, token_weights
from helpers.threads import one_torch_thread
from torchmetrics.aggregation import MeanMetric

from alignment_games.datamodules.prompts import collate_prompts, index_rows
from alignment_games.modules.algorithms.rl_losses import PolicyGradient
from alignment_games.modules.base import LanguageModelGame
from alignment_games.modules.debate import PLAYER
from alignment_games.modules.games.pool_followers import FollowerTraining, FollowerUpdates
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.sampling import Sampling

SAMPLING = Sampling(temperature=0.7, top_p=0.9, max_new_tokens=6)
PROBLEMS = ["What is 4 + 4?", "1 + 1?", "2 + 5?"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with one_torch_thread():
        yield


def _followers(bank, pg, steps):
    """The pool's follower updates over ``bank`` with the base's step, no trainer: a step records the gradients."""
    host = LanguageModelGame()
    host.board = SimpleNamespace(add_values=lambda *a: None)
    host.manual_backward = lambda loss: loss.backward()  # no trainer: the plain backward Lightning runs on CPU
    host.optimizer_step = lambda opt, params: steps.append([p.grad.clone() for p in params])
    settings = FollowerTraining("grpo", lr=1e-2, batch_size=4, policy_gradient=pg)
    return FollowerUpdates(settings, lambda p: bank, host, MeanMetric(), "", SAMPLING.temperature)


@pytest.mark.parametrize("cap", [None, 2.0])
def test_pool_grpo_followers_log_the_gap_and_weight_each_token_by_the_capped_ratio(tiny_lm_dir, cap):
    torch.manual_seed(0)
    bank = PolicyBank(ModelConfig(tiny_lm_dir, lora_r=4, lora_alpha=8), players=["m0"])
    engine_like(bank)
    out = bank.generate("m0", PROBLEMS[:2], 2, SAMPLING)
    assert offset_gap(out) > 0
    pg = PolicyGradient(group_size=2, scale_advantages=False, tis_cap=cap)
    slots, duels = [(0, 0), (1, 0)], [(0, 1), (0, 1)]  # "m0" on side 0 of two duels: its 2 x G = 4 rollouts
    scores = {(0, 0): [1.0, 3.0], (1, 0): [2.0, 0.0]}
    adv = torch.tensor([-1.0, 1.0, 1.0, -1.0])  # each group's scores less their mean
    opt = torch.optim.SGD(bank.player_parameters("m0"), lr=0.0)
    steps = []
    stats = _followers(bank, pg, steps).grpo(None, {"m0": opt}, {"m0": (out, slots)}, scores, duels)
    weights = token_weights(out, cap)
    assert stats["rollout/logprob_gap"] == pytest.approx(offset_gap(out), abs=1e-5)
    assert stats["follower/grpo_loss/m0"] == pytest.approx(float(-(adv * weights.sum(1)).mean()), abs=1e-6)
    want = reference_grads(bank, "m0", [(out, -adv[:, None] * weights / 4)], SAMPLING.temperature)
    assert len(steps) == 1 and any(g.abs().sum() > 0 for g in want)
    for got, ref in zip(steps[0], want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-7)
    if cap is None:  # no cap: the gap alone, the gradients those of a rollout without sampling log-probs
        plain = dataclasses.replace(out, sample_logprobs=None)
        stats = _followers(bank, pg, steps).grpo(None, {"m0": opt}, {"m0": (plain, slots)}, scores, duels)
        assert "rollout/logprob_gap" not in stats
        for got, ref in zip(steps[1], steps[0], strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("cap", [None, 2.0])
def test_debate_forked_rows_carry_their_sampling_logprobs_into_the_loss(tiny_lm_dir, cap):
    """Forks at every ply of ABA: each ply's forked rows are a selection of its decode's rows."""
    torch.manual_seed(0)
    m = tiny_debate_module(tiny_lm_dir, policy_gradient=PolicyGradient(group_size=2, tis_cap=cap))
    engine_like(m.bank)
    roll = m.play(PROBLEMS, ["8", "2", "7"], group_size=2, fork_plies=[0, 1, 2])
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    loss, stats, _ = m.policy_loss(roll, adv)
    n, pieces, want_loss, want_gap = 6, [], 0.0, 0.0
    for chunk, idx in roll.chunks.values():
        weights, a = token_weights(chunk, cap), adv[idx]
        want_loss += float(-(a * weights.sum(1)).sum()) / n
        want_gap += len(idx) / n * offset_gap(chunk)
        pieces.append((chunk, -a[:, None] * weights / n))
    assert len(pieces) == 3 and want_gap > 0
    decoded = [r.sequences.shape[0] for r in roll.rollouts]
    assert all(len(idx) < d for (_, idx), d in zip(roll.chunks.values(), decoded, strict=True))  # a selection each
    assert float(stats["logprob_gap"]) == pytest.approx(want_gap, abs=1e-5)
    assert float(loss.detach()) == pytest.approx(want_loss, abs=1e-6)
    want = reference_grads(m.bank, PLAYER, pieces, m.sampling.temperature)
    loss.backward()
    assert any(g.abs().sum() > 0 for g in want)
    for p, ref in zip(m.bank.player_parameters(PLAYER), want, strict=True):
        torch.testing.assert_close(p.grad, ref, rtol=1e-4, atol=1e-7)


def test_a_debate_step_logs_the_rollout_logprob_gap(tiny_lm_dir, tmp_path):
    L.seed_everything(0)
    m = tiny_debate_module(tiny_lm_dir)
    engine_like(m.bank)
    played, play = [], m.play
    m.play = lambda *a, **k: played.append(play(*a, **k)) or played[-1]
    trainer = L.Trainer(
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path
    )
    rows = index_rows([{"prompt": x, "reference": r} for x, r in zip(PROBLEMS[:2], ["8", "2"])])
    trainer.fit(m, torch.utils.data.DataLoader(rows, batch_size=2, collate_fn=collate_prompts))
    (roll,) = played
    n = sum(len(idx) for _, idx in roll.chunks.values())
    want = sum(len(idx) / n * offset_gap(chunk) for chunk, idx in roll.chunks.values())
    assert float(trainer.callback_metrics["rollout/logprob_gap"]) == pytest.approx(want, abs=1e-5)
