"""Sampling from the token-level geometric mixture of a player and the frozen reference (Nash-MD-PG's opponent)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from alignment_games.modules.algorithms.baselines import geometric_mixture_logprobs
from alignment_games.modules.algorithms.checks import require_at_least, require_in_range
from alignment_games.modules.lm.decoders import sample_loop
from alignment_games.modules.lm.decoding import cache_arg
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.rollout import Rollout
from alignment_games.modules.lm.sampling import Sampling


def _forward(bank: PolicyBank, who: str | None, cache, **inputs: Tensor) -> tuple[object, Tensor]:
    """One forward of ``who`` (``None``: the reference) in eval mode; its cache and last-position logits (fp32)."""
    with bank.using(who) as model:
        was_training, name = model.training, cache_arg(model)
        extra = {name: cache} if cache is not None else {}
        out = model.eval()(use_cache=True, logits_to_keep=1, **inputs, **extra)
        model.train(was_training)
    return getattr(out, name), out.logits[:, -1, :].float()


@torch.no_grad()
def generate_mixture(
    bank: PolicyBank, player: str, prompts: Sequence[str], num_samples: int, beta: float, sampling: Sampling
) -> Rollout:
    """Sample ``num_samples`` completions per prompt from ``π^β ∝ π_player^{1−β} π_ref^β``, token by token.

    Raises:
        ValueError: for ``beta`` outside [0, 1] or ``num_samples`` < 1.
    """
    require_in_range("beta", beta, 0, 1)
    require_at_least(num_samples=(num_samples, 1))
    device = next(bank.parameters()).device
    once = {k: v.to(device) for k, v in bank.encode_prompts(prompts).items()}
    ids, mask = (v.repeat_interleave(num_samples, dim=0) for v in once.values())
    position = (mask.cumsum(dim=1) - 1).clamp_min(0)
    caches, logits = {}, {}
    for who in (player, None):  # prefill each model on the whole prompt: the first step's logits
        caches[who], logits[who] = _forward(bank, who, None, input_ids=ids, attention_mask=mask, position_ids=position)
    attention, temperature = [mask], sampling.temperature

    def step_logits(token: Tensor, position: Tensor, step: int) -> Tensor:
        if step > 0:
            attention.append(torch.ones_like(mask[:, :1]))
            inputs = {"input_ids": token, "attention_mask": torch.cat(attention, dim=1), "position_ids": position}
            for who in (player, None):
                caches[who], logits[who] = _forward(bank, who, caches[who], **inputs)
        player_lp, reference_lp = (torch.log_softmax(logits[who] / temperature, dim=-1) for who in (player, None))
        return geometric_mixture_logprobs(player_lp, reference_lp, beta)

    tempered = dataclasses.replace(sampling, temperature=1.0)  # the mixture is formed of tempered logits
    eos, pad = bank.tokenizer.eos_token_id, bank.tokenizer.pad_token_id
    out = sample_loop(step_logits, once["input_ids"], once["attention_mask"], num_samples, tempered, False, eos, pad)
    return Rollout.from_decode(out, mask, num_samples, bank.tokenizer)
