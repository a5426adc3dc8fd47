"""Decoding that reads each prompt once for its samples: grouped cascade attention, and a prefilled prompt cache."""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

GROUPED_ATTENTION = "alignment_games_grouped_prefix"


def base_model(model: nn.Module) -> nn.Module:
    """The model under a peft wrapper (or ``model`` itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def cache_arg(model: nn.Module) -> str:
    """Name of the KV-cache argument and output: ``cache`` in recent transformers, else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(type(base_model(model)).forward).parameters else "past_key_values"


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Llama's rotary embedding of ``x`` (``cos``, ``sin`` broadcast over its heads)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@contextmanager
def cascade_state(model: nn.Module, attention: str, layers: Mapping[int, Any]) -> Iterator[None]:
    """Run ``model`` on ``attention``, each attention module holding its ``layers[layer_idx]`` (restored after)."""
    base = base_model(model)
    modules = [m for m in base.modules() if isinstance(getattr(m, "layer_idx", None), int) and m.layer_idx in layers]
    previous = base.config._attn_implementation
    try:
        for m in modules:
            m.cascade = layers[m.layer_idx]
        base.config._attn_implementation = attention
        yield
    finally:
        base.config._attn_implementation = previous
        for m in modules:
            m.__dict__.pop("cascade", None)


def grouped_prefix_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, *args: Any, scaling: float | None = None, **kw: Any
) -> tuple[Tensor, None]:
    """Cascade attention of G rows per prompt over ``module.cascade`` (each prompt's keys once) and the rows' own.

    ``module.cascade`` is ``(keys, values, pad)``, or a cache that attends itself (``attend``, as the static one).
    """
    if hasattr(module.cascade, "attend"):
        return module.cascade.attend(query, key, value, scaling), None
    keys, values, pad = module.cascade
    return cascade_attention(query, keys, values, pad, key, value, scaling), None


def cascade_attention(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    pad: Tensor,
    key: Tensor,
    value: Tensor,
    scaling: float | None = None,
    own_mask: Tensor | None = None,
) -> Tensor:
    """``[B·G, q, H, D]``: queries over a prompt part ``[B, KV, P, D]`` held once and each row's own, one softmax."""
    n, h, q, d = query.shape
    b, kvh, p, _ = keys.shape
    g, rep = n // b, h // kvh
    scale = scaling if scaling is not None else d**-0.5
    # prompt part: the G rows of a prompt become G·rep query rows of one [B, KV] head, against one copy of its keys
    qp = query.reshape(b, g, kvh, rep * q, d).transpose(1, 2).reshape(b, kvh, g * rep * q, d)
    # scores, softmax and sums in float32 (as SDPA does for half precision); the matmuls in the model's dtype
    sp = (qp @ keys.transpose(-1, -2)).float() * scale + pad.float().unsqueeze(1)
    sp = sp.reshape(b, kvh, g, rep * q, p).transpose(1, 2).reshape(n, kvh, rep * q, p)
    ss = (query.reshape(n, kvh, rep * q, d) @ key.transpose(-1, -2)).float() * scale  # own part, per row
    if own_mask is not None:
        ss = ss + own_mask
    elif q > 1:
        t = key.shape[2]
        causal = torch.ones(q, t, dtype=torch.bool, device=query.device).tril(t - q)
        ss = ss.reshape(n, kvh, rep, q, t).masked_fill(~causal, float("-inf")).reshape(n, kvh, rep * q, t)
    top = torch.maximum(sp.amax(-1, keepdim=True), ss.amax(-1, keepdim=True))
    ep, es = (sp - top).exp(), (ss - top).exp()
    denom = ep.sum(-1, keepdim=True) + es.sum(-1, keepdim=True)
    ep = ep.reshape(b, g, kvh, rep * q, p).transpose(1, 2).reshape(b, kvh, g * rep * q, p)
    op = (ep.to(values.dtype) @ values).reshape(b, kvh, g, rep * q, d).transpose(1, 2).reshape(n, kvh, rep * q, d)
    out = ((op.float() + (es.to(value.dtype) @ value).float()) / denom).to(query.dtype)
    return out.reshape(n, h, q, d).transpose(1, 2).contiguous()


def next_tokens(
    logits: Tensor, step: int, min_new_tokens: int, eos: int | None, do_sample: bool, temperature: float, top_p: float
) -> Tensor:
    """The next token of every row from its last logits ``[N, V]``, drawn as ``generate`` draws it."""
    logits = logits.to(dtype=torch.float32)
    if step < min_new_tokens and eos is not None:
        logits[:, eos] = float("-inf")
    if not do_sample:
        return logits.argmax(dim=-1)
    if temperature != 1.0:
        logits = logits / temperature
    if top_p < 1.0:
        ordered, order = torch.sort(logits, descending=False)
        drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
        drop[..., -1:] = False
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), num_samples=1).squeeze(1)


def preallocated_cache(capacity: int) -> Any:
    """A ``DynamicCache`` whose layers write into buffers of ``capacity`` tokens in place (no copy per token).

    Raises:
        ValueError: when more than ``capacity`` tokens are written to a layer.
    """
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class _PreallocatedLayer(DynamicLayer):
        def __init__(self) -> None:
            super().__init__()
            self.length = 0

        def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
            if not self.is_initialized:
                self.device, self.is_initialized = key_states.device, True
                new = (s.new_empty(*s.shape[:2], capacity, s.shape[-1]) for s in (key_states, value_states))
                self._keys, self._values = new
            end = self.length + key_states.shape[-2]
            if end > capacity:
                raise ValueError(f"preallocated_cache: {end} tokens written to a cache of {capacity}")
            self._keys[:, :, self.length : end] = key_states
            self._values[:, :, self.length : end] = value_states
            self.length = end
            self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
            return self.keys, self.values

    cache = DynamicCache()
    cache.layer_class_to_replicate = _PreallocatedLayer
    return cache


def _register_grouped_attention(name: str = GROUPED_ATTENTION) -> bool:
    """Register :func:`grouped_prefix_attention` as ``name`` with a no-op mask; False where unsupported."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        return False
    AttentionInterface.register(name, grouped_prefix_attention)
    AttentionMaskInterface.register(name, lambda *args, **kwargs: None)  # the masks travel with the caches
    return True


def prompt_forward(model: Any, ids: Tensor, mask: Tensor, end: int) -> tuple[Any, Tensor]:
    """KV cache of ``ids[:, :end]`` and the last position's logits ``[rows, 1, V]`` (positions from the mask)."""
    ids, mask, pos = ids[:, :end], mask[:, :end], (mask.cumsum(dim=1) - 1).clamp_min(0)[:, :end]
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
    return getattr(out, cache_arg(model)), out.logits


def shared_prompt_cache(model: Any, ids: Tensor, mask: Tensor, copies: int) -> dict[str, Any]:
    """``generate``'s cache argument: each prompt but its last token prefilled once, repeated ``copies`` times."""
    cache, _ = prompt_forward(model, ids, mask, ids.shape[1] - 1)
    cache.batch_repeat_interleave(copies)
    return {cache_arg(model): cache}


def prompt_cache(model: Any, ids: Tensor, mask: Tensor) -> tuple[Any, Tensor]:
    """KV cache of each left-padded prompt but its last token (a shared prefix once per player), and its mask."""
    end = ids.shape[1] - 1
    players = getattr(model, "_row_players", None)
    lengths = mask.sum(dim=1)
    share = 0
    if players is not None and len(set(players)) < len(players):
        rows = [ids[i, ids.shape[1] - n :].tolist() for i, n in enumerate(lengths.tolist())]
        limit = min(len(r) for r in rows) - 1  # each row keeps its last token for the first decode step
        while share < limit and all(r[share] == rows[0][share] for r in rows):
            share += 1
    if share == 0:
        return prompt_forward(model, ids, mask, end)[0], mask[:, :end]
    firsts, once = list(dict.fromkeys(players)), {"use_cache": True, "logits_to_keep": 1}
    head, n = ids[:1, ids.shape[1] - int(lengths[0]) :][:, :share], len(firsts)
    positions, ones = torch.arange(share, device=ids.device).expand(n, -1), torch.ones_like(head)
    out = model(input_ids=head.expand(n, -1), attention_mask=ones.expand(n, -1), position_ids=positions, **once)
    cache = getattr(out, cache_arg(model))
    cache.batch_select_indices(torch.tensor([firsts.index(p) for p in players], device=ids.device))
    # row i's rest (its last n_i - share tokens) right-aligned in columns share … W - 1, padding between
    rest_mask = torch.arange(ids.shape[1] - share, device=ids.device) >= (ids.shape[1] - lengths)[:, None]
    layout = torch.cat([torch.ones_like(mask[:, :share]), rest_mask.to(mask.dtype)], dim=1)
    if share < end:
        pos, kw = (layout.cumsum(dim=1) - 1).clamp_min(0), {cache_arg(model): cache}
        model(input_ids=ids[:, share:end], attention_mask=layout[:, :end], position_ids=pos[:, share:end], **once, **kw)
    return cache, layout[:, :end]
