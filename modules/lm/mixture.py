"""Sampling from the token-level geometric mixture of a player and the frozen reference (Nash-MD-PG's opponent)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from alignment_games.modules.algorithms.baselines import geometric_mixture_logprobs
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.rollout import Rollout

__all__ = ["generate_mixture"]


def _forward(bank: PolicyBank, who: str | None, cache, **inputs: Tensor) -> tuple[object, Tensor]:
    """One forward of ``who`` (``None``: the reference) in eval mode; its cache and last-position logits (fp32)."""
    with bank._use(who) as model:
        was_training = model.training
        model.eval()
        name = bank._cache_arg(model)
        extra = {name: cache} if cache is not None else {}
        out = model(use_cache=True, logits_to_keep=1, **inputs, **extra)
        model.train(was_training)
    return getattr(out, name), out.logits[:, -1, :].float()


@torch.no_grad()
def generate_mixture(
    bank: PolicyBank,
    player: str,
    prompts: Sequence[str],
    num_samples: int,
    beta: float,
    temperature: float = 0.6,
    top_p: float = 1.0,
    max_new_tokens: int = 128,
) -> Rollout:
    """Sample ``num_samples`` completions per prompt from ``π^β ∝ π_player^{1−β} π_ref^β``, token by token.

    Each step runs the player and the reference (the disabled adapter, or the frozen copy) on the same prefix, each
    with its own KV cache, tempers both logits by ``temperature``, mixes the two log-distributions
    (:func:`~modules.algorithms.baselines.geometric_mixture_logprobs`), applies top-p to the mixture and samples.
    Rows, masks and texts are laid out as :meth:`PolicyBank.generate` lays them out.

    Raises:
        ValueError: for ``beta`` outside [0, 1], a non-positive ``temperature`` or ``num_samples`` < 1.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if not temperature > 0 or num_samples < 1:
        raise ValueError(f"temperature must be positive and num_samples at least 1, got {temperature}, {num_samples}")
    device = next(bank.parameters()).device
    enc = {k: v.to(device).repeat_interleave(num_samples, dim=0) for k, v in bank._encode_prompts(prompts).items()}
    ids, mask = enc["input_ids"], enc["attention_mask"]
    eos, pad = bank.tokenizer.eos_token_id, bank.tokenizer.pad_token_id
    position = (mask.cumsum(dim=1) - 1).clamp_min(0)
    caches, logits = {}, {}
    for who in (player, None):  # prefill each model on the prompt
        caches[who], logits[who] = _forward(bank, who, None, input_ids=ids, attention_mask=mask, position_ids=position)
    position = position[:, -1:]
    attention = mask
    unfinished = torch.ones(ids.shape[0], dtype=torch.bool, device=device)
    new: list[Tensor] = []
    for _ in range(max_new_tokens):
        lp = geometric_mixture_logprobs(
            torch.log_softmax(logits[player] / temperature, dim=-1),
            torch.log_softmax(logits[None] / temperature, dim=-1),
            beta,
        )
        if top_p < 1.0:  # smallest set of tokens with mass ≥ top_p, as transformers' TopPLogitsWarper
            ordered, order = torch.sort(lp, descending=False)
            drop = ordered.exp().cumsum(dim=-1) <= (1 - top_p)
            drop[..., -1:] = False
            lp = lp.masked_fill(drop.scatter(1, order, drop), float("-inf"))
        nxt = torch.multinomial(torch.softmax(lp, dim=-1), num_samples=1).squeeze(1)
        nxt = torch.where(unfinished, nxt, torch.full_like(nxt, pad))
        new.append(nxt)
        if eos is not None:
            unfinished &= nxt != eos
        if not bool(unfinished.any()):
            break
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
        position = position + 1
        for who in (player, None):
            caches[who], logits[who] = _forward(
                bank, who, caches[who], input_ids=nxt[:, None], attention_mask=attention, position_ids=position
            )
    width = ids.shape[1]
    completion = torch.stack(new, dim=1)
    is_eos = completion == eos
    # as PolicyBank.generate: tokens up to and including the first EOS are the completion
    completion_mask = (~((is_eos.cumsum(dim=1) - is_eos.long()) > 0)).long()
    texts = bank.tokenizer.batch_decode(completion * completion_mask, skip_special_tokens=True)
    return Rollout(
        torch.cat([ids, completion], dim=1),
        torch.cat([mask, completion_mask], dim=1),
        width,
        completion_mask,
        texts,
        group_size=num_samples,
    )
