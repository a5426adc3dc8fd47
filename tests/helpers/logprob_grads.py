"""Log-probabilities of a rollout with the gradients they give: the two things a chunked forward must keep equal."""

import torch


def logprobs_and_grads(bank, player, rollout, temperature=0.8, **kwargs):
    """``bank.token_logprobs`` (``kwargs``: its micro-batch limits) and every parameter's gradient of a fixed weighted
    sum of them (weights from -1 to 1 over the columns, so every column counts differently)."""
    bank.zero_grad(set_to_none=True)
    lp = bank.token_logprobs(player, rollout, temperature, **kwargs)
    (lp * torch.linspace(-1, 1, lp.shape[1])).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in bank.named_parameters() if p.grad is not None}
