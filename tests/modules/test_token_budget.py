"""Micro-batches by token budget (``policy_gradient.max_tokens_per_micro_batch``): the chunks, their padding dropped,
and the GRPO update they give, equal to the unchunked one."""

import random
from dataclasses import replace

import pytest
import torch
from helpers.logprob_grads import logprobs_and_grads

from alignment_games.modules.algorithms.rl_losses import PolicyGradient
from alignment_games.modules.grpo import GRPO, _groups_by_length
from alignment_games.modules.lm.micro_batches import micro_batches, row_lengths
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.rollout import Rollout
from alignment_games.modules.lm.sampling import Sampling


def _cost(spans, lengths, a, b):
    return (b - a) * (max(spans[a:b]) + max(max(lengths[a:b]), 1))


@pytest.mark.parametrize(
    ("spans", "lengths", "kw", "want"),
    [
        # rows: 6, then 2 x 6 = 12 <= 12; a third row makes 3 x 8; then 2 x 8 > 12
        ([2, 2, 3, 1], [4, 1, 5, 2], {"max_tokens": 12}, [(0, 2), (2, 3), (3, 4)]),
        ([2, 2, 3, 1], [4, 1, 5, 2], {"max_rows": 1}, [(0, 1), (1, 2), (2, 3), (3, 4)]),
        ([2, 2, 3, 1], [4, 1, 5, 2], {}, [(0, 4)]),
        # both limits hold: 12 tokens would take rows 0-1, 1 row a chunk cuts them
        ([2, 2, 3, 1], [4, 1, 5, 2], {"max_tokens": 12, "max_rows": 1}, [(0, 1), (1, 2), (2, 3), (3, 4)]),
        # groups of 2: 2 x 6 and 2 x 8 each fit 16, together 4 x 8 do not
        ([2, 2, 3, 3], [4, 1, 5, 0], {"max_tokens": 16, "group_size": 2}, [(0, 2), (2, 4)]),
        ([2, 2, 3, 3], [4, 1, 5, 0], {"max_tokens": 32, "group_size": 2}, [(0, 4)]),
        # 3 rows rounded up to 2 whole groups
        ([1] * 6, [1] * 6, {"max_rows": 3, "group_size": 2}, [(0, 4), (4, 6)]),
        # group 1 alone is 2 x 8 > 10: cut into its rows; no chunk mixes its rows with another group's
        ([1, 1, 3, 3, 1, 1], [1, 1, 5, 4, 1, 1], {"max_tokens": 10, "group_size": 2}, [(0, 2), (2, 3), (3, 4), (4, 6)]),
        # a group size that does not divide the rows: plain rows
        ([1, 1, 1], [1, 1, 1], {"max_tokens": 4, "group_size": 2}, [(0, 2), (2, 3)]),
        ([], [], {"max_tokens": 4}, []),
    ],
)
def test_chunks_on_hand_values(spans, lengths, kw, want):
    assert micro_batches(spans, lengths, **kw) == want


def test_every_chunk_is_within_the_budget_and_as_full_as_it_can_be():
    rnd = random.Random(0)
    for trial in range(200):
        g = rnd.choice([1, 2, 4])
        n = g * rnd.randint(1, 12)
        spans = [s for s in (rnd.randint(1, 20) for _ in range(n // g)) for _ in range(g)]  # a group shares a prompt
        lengths = [rnd.randint(0, 40) for _ in range(n)]
        budget = max(s + max(c, 1) for s, c in zip(spans, lengths)) + rnd.randint(0, 200)
        chunks = micro_batches(spans, lengths, budget, group_size=g)
        assert [a for a, _ in chunks] == [0] + [b for _, b in chunks[:-1]] and chunks[-1][1] == n, trial
        for k, (a, b) in enumerate(chunks):
            assert _cost(spans, lengths, a, b) <= budget, trial
            whole = a % g == 0 and b % g == 0
            assert whole or _cost(spans, lengths, a // g * g, a // g * g + g) > budget, trial  # only big groups cut
            if k + 1 < len(chunks) and whole and _cost(spans, lengths, b, b + g) <= budget:
                assert _cost(spans, lengths, a, b + g) > budget, trial  # greedy: the next group did not fit


def test_a_row_over_the_budget_alone_is_refused_by_name():
    with pytest.raises(
        ValueError,
        match=r"max_tokens_per_micro_batch=6 is below row 2's own length, 7 tokens \(prompt 3 \+ completion 4\); "
        r"raise it to at least 7",
    ):
        micro_batches([1, 1, 3, 1], [1, 1, 4, 1], 6)
    with pytest.raises(ValueError, match=r"row 0's own length, 3 tokens \(prompt 2 \+ completion 1\)"):
        micro_batches([2], [0], 2)  # an empty completion still runs one column
    with pytest.raises(ValueError, match=r"2 prompt lengths for 1 completion lengths"):
        micro_batches([1, 1], [1], 4)
    with pytest.raises(ValueError, match="policy_gradient.max_tokens_per_micro_batch must be at least 0, got -1"):
        PolicyGradient(max_tokens_per_micro_batch=-1)


def test_row_lengths_count_the_left_padded_prompt_and_the_completion():
    att = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 0, 0]])
    comp = torch.tensor([[1, 0], [1, 1], [0, 0]])
    assert row_lengths(att, 4, comp) == ([2, 4, 1], [1, 2, 0])


def _cut(bank, roll: Rollout, keep: list[int]) -> Rollout:
    """``roll`` with row ``i``'s completion cut to ``keep[i]`` tokens (the rest padding, as an early EOS leaves it)."""
    cmask, att, seq = roll.completion_mask.clone(), roll.attention_mask.clone(), roll.sequences.clone()
    for i, k in enumerate(keep):
        cmask[i, k:] = 0
        att[i, roll.prompt_width + k :] = 0
        seq[i, roll.prompt_width + k :] = bank.tokenizer.pad_token_id
    return replace(roll, sequences=seq, attention_mask=att, completion_mask=cmask)


def _bank(path, share_prompts=True):
    torch.manual_seed(0)
    bank = PolicyBank(ModelConfig(path, lora_r=4, lora_alpha=8), players=["policy"])
    bank.share_prompts = share_prompts
    with torch.no_grad():
        for p in bank.player_parameters("policy"):
            p.add_(0.1 * torch.randn_like(p))
    return bank


@pytest.mark.parametrize("share_prompts", [True, False])
@pytest.mark.parametrize("split_group", [False, True])
def test_budget_chunks_drop_their_padding_with_the_full_width_logprobs(tiny_decoder_dir, share_prompts, split_group):
    """A short prompt's group with short replies runs without the long prompt's left padding and the long replies'
    right padding; log-probabilities and adapter gradients equal the batch's in one full-width forward (positions
    come from the full rows). With a budget of one long row the long group is cut into rows."""
    bank = _bank(tiny_decoder_dir, share_prompts)
    roll = bank.generate("policy", ["3+4=", "a longer prompt: twelve minus five is "], 2, Sampling(0.6, 1.0, 8, 8))
    roll = _cut(bank, roll, [2, 5, 8, 8])
    spans, _ = row_lengths(roll.attention_mask, roll.prompt_width, roll.completion_mask)
    short, long_ = spans[0], spans[2]
    assert long_ == roll.prompt_width and short < long_ - 10
    budget = (1 if split_group else 2) * (long_ + 8)
    shapes = []
    embed = bank.model.get_base_model().get_input_embeddings()
    hook = embed.register_forward_hook(lambda m, a, o: shapes.append(tuple(a[0].shape)))

    whole, whole_grads = logprobs_and_grads(bank, "policy", roll)
    assert shapes[0][1] == roll.prompt_width + (0 if share_prompts else 8)  # one forward: the longest prompt, all
    shapes.clear()
    chunked, chunked_grads = logprobs_and_grads(bank, "policy", roll, max_tokens=budget)
    hook.remove()
    # the short group's micro-batch: its prompt once then its rows' 5 completion columns (shared prompts), or
    # prompt and completion together; the long group whole, or (over the budget) one row at a time, each its prompt
    want = [(1, short), (2, 5)] if share_prompts else [(2, short + 5)]
    if split_group:
        want += [(1, long_ + 8)] * 2
    else:
        want += [(1, long_), (2, 8)] if share_prompts else [(2, long_ + 8)]
    assert shapes == want
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
    assert whole_grads.keys() == chunked_grads.keys() and whole_grads
    for name, grad in whole_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-5, atol=1e-6)


def test_the_grpo_update_with_a_token_budget_equals_the_unchunked_one(tiny_lm_dir):
    """GRPO's loss and every trainable parameter's gradient (clip, k3 KL to the reference, an off-policy ratio) with a
    budget that cuts the batch into micro-batches of whole groups, reordered by length, equal the whole batch's in one
    forward and backward: each micro-batch's sequence-mean loss is weighted by its share of the rows."""
    torch.manual_seed(0)
    model = GRPO(
        lm=ModelConfig(tiny_lm_dir, lora_r=4, lora_alpha=8),
        policy_gradient=PolicyGradient(group_size=2, kl_coef=0.1, clip=0.1),
        sampling=Sampling(temperature=1.0, max_new_tokens=8),
        chat_template=False,
    )
    model.manual_backward = lambda loss: loss.backward()  # no trainer: the plain backward Lightning runs on CPU
    bank = model.players
    with torch.no_grad():
        for p in bank.player_parameters("policy"):
            p.add_(0.1 * torch.randn_like(p))
    prompts = ["1+1=", "a much longer prompt: 12*3=", "7-2=", "twelve minus five is "]
    roll = _cut(bank, bank.generate("policy", prompts, 2, Sampling(0.6, 1.0, 8, 8)), [2, 5, 8, 8, 1, 3, 6, 4])
    spans, lengths = row_lengths(roll.attention_mask, roll.prompt_width, roll.completion_mask)
    budget = max(_cost(spans, lengths, a, a + 2) for a in range(0, 8, 2))  # the largest group's padded tokens
    with torch.no_grad():
        ref = bank.token_logprobs(None, roll, 1.0)
        old = (bank.token_logprobs("policy", roll, 1.0) + 0.2 * torch.randn(8, 8)) * roll.completion_mask
    adv = torch.randn(8)
    rows, run = [], bank.token_logprobs

    def spy(*a, **k):
        rows[-1].append((a[1].sequences.shape[0], a[1].attention_mask.sum().item()))
        return run(*a, **k)

    bank.token_logprobs = spy
    results = []
    for max_tokens in (0, budget):
        model.policy_gradient = replace(model.policy_gradient, max_tokens_per_micro_batch=max_tokens)
        rows.append([])
        bank.zero_grad(set_to_none=True)
        out = model._policy_loss(roll, adv, ref, old)
        results.append((out, {n: p.grad.clone() for n, p in bank.named_parameters() if p.requires_grad}))
    (whole, whole_grads), (cut, cut_grads) = results
    # groups by longest reply: 3 (group 2), 5 (group 0), 6 (group 3), 8 (group 1); the budget takes two short ones
    assert _groups_by_length(roll.completion_mask, 2).tolist() == [4, 5, 0, 1, 6, 7, 2, 3]
    assert [n for n, _ in rows[0]] == [8] and [n for n, _ in rows[1]] == [4, 2, 2]
    assert sum(t for _, t in rows[1]) == sum(t for _, t in rows[0])  # every row once
    torch.testing.assert_close(cut["loss"], whole["loss"], rtol=0, atol=1e-6)
    assert whole["kl"] > 0 and whole["clip_fraction"] > 0  # the KL and the clip act in the gradient
    assert whole_grads.keys() == cut_grads.keys() and whole_grads
    for name, grad in whole_grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(cut_grads[name], grad, rtol=0, atol=1e-6)
