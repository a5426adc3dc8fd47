"""Sampling log-probabilities as an engine would report them: the trainer's own minus a known offset per token.

With ``offset`` a function of each completion token's id, the gap and the truncated importance weights of any row a
loss sees follow from that row's own tokens, so a row or column that does not line up with its sampled log-probs
changes the numbers.
"""

import torch


def content_offsets(sequences, width, mask, step=0.1, period=4):
    """``step · (token id mod period)`` on each completion token (zero on some of them), zero outside ``mask``."""
    return step * (sequences[:, width:] % period).to(torch.float32) * mask


def engine_like(bank, offsets=content_offsets):
    """Make ``bank.generate`` attach ``sample_logprobs``: the bank's log-probs of the sampled tokens minus ``offsets``.

    Returns nothing; the bank's rollouts then carry them through ``rows`` and ``split`` as an engine's do.
    """
    original = bank.generate

    def generate(player, prompts, num_samples, sampling, greedy=False):
        out = original(player, prompts, num_samples, sampling, greedy=greedy)
        with torch.no_grad():
            lp = bank.token_logprobs(player, out, sampling.temperature)
        mask = out.completion_mask.to(lp.dtype)
        out.sample_logprobs = (lp - offsets(out.sequences, out.prompt_width, mask)) * mask
        return out

    bank.generate = generate


def token_weights(rollout, cap=None, offsets=content_offsets):
    """``[N, C]`` each completion token's ``min(exp(offset), cap)`` (1 without a cap) over its row's length.

    An on-policy row's GRPO loss is ``−A`` times its row sum, and its gradient that of ``−A ·`` the weighted sum of the
    row's token log-probs.
    """
    mask = rollout.completion_mask.to(torch.float32)
    o = offsets(rollout.sequences, rollout.prompt_width, mask)
    w = torch.ones_like(o) if cap is None else o.exp().clamp(max=cap)
    return w * mask / mask.sum(1, keepdim=True).clamp_min(1)


def offset_gap(rollout, offsets=content_offsets):
    """The token-mean ``|offset|`` over the rollout's completion tokens: its ``logprob_gap``."""
    mask = rollout.completion_mask.to(torch.float32)
    return float(offsets(rollout.sequences, rollout.prompt_width, mask).abs().sum() / mask.sum().clamp_min(1))


def reference_grads(bank, player, pieces, temperature):
    """Gradients of ``player``'s parameters of ``Σ coef ⊙ token log-probs`` over ``(rollout, coef [N, C])`` pieces."""
    bank.zero_grad(set_to_none=True)
    total = sum((coef * bank.token_logprobs(player, r, temperature)).sum() for r, coef in pieces)
    total.backward()
    grads = [p.grad.clone() for p in bank.player_parameters(player)]
    bank.zero_grad(set_to_none=True)
    return grads
