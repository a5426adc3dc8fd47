"""Grouped decoding: G samples per prompt that read each prompt's KV cache once (cascade attention).

:func:`grouped_prefix_attention` is registered with transformers' attention interface; :class:`PolicyBank` switches a
decode to it for sampled groups (see ``PolicyBank.grouped_decode``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["GROUPED_ATTENTION", "GROUPED_DECODE_ENV", "grouped_decode_setting", "grouped_prefix_attention"]

GROUPED_ATTENTION = "alignment_games_grouped_prefix"
# layer index -> (prompt keys [B, KV, P, D], prompt values, additive prompt-padding mask [B, 1, P]) of the one decode
# running with grouped_prefix_attention (set and cleared by PolicyBank._grouped_prefix)
_PREFIX: dict[int, tuple[Tensor, Tensor, Tensor]] = {}


def grouped_prefix_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Attention of G samples per prompt that reads each prompt's keys and values once (cascade attention).

    The rows ``b*G … b*G + G - 1`` continue prompt ``b``. Their prompt part lives once per prompt in ``_PREFIX``
    (``[B, KV, P, D]``), their own tokens in the cache (``key``/``value``: ``[B·G, KV, t, D]``). The scores against
    both parts share one softmax (a common maximum, one denominator), so the result equals attention over the
    prompt's cache copied to every row, as :meth:`PolicyBank.generate` did before, up to float rounding, while the
    prompt's keys are read once per group instead of G times, and grouped-query heads are never copied. Queries
    after the first (``q > 1``) are causal within the row's own tokens. Registered with transformers'
    ``AttentionInterface``; ``attention_mask`` is ignored (the prompt's padding is in ``_PREFIX``, the own tokens
    are never padding while decoding).
    """
    keys, values, pad = _PREFIX[module.layer_idx]
    n, h, q, d = query.shape
    b, kvh, p, _ = keys.shape
    g, rep = n // b, h // kvh
    scale = scaling if scaling is not None else d**-0.5
    # prompt part: the G rows of a prompt become G·rep query rows of one [B, KV] head, against one copy of its keys
    qp = query.reshape(b, g, kvh, rep * q, d).transpose(1, 2).reshape(b, kvh, g * rep * q, d)
    # scores, softmax and sums in float32 (as SDPA does for half precision); the matmuls in the model's dtype
    sp = (qp @ keys.transpose(-1, -2)).float() * scale + pad.float().unsqueeze(1)
    sp = sp.reshape(b, kvh, g, rep * q, p).transpose(1, 2).reshape(n, kvh, rep * q, p)
    # own part, per row
    ss = (query.reshape(n, kvh, rep * q, d) @ key.transpose(-1, -2)).float() * scale
    if q > 1:
        t = key.shape[2]
        causal = torch.ones(q, t, dtype=torch.bool, device=query.device).tril(t - q)
        ss = ss.reshape(n, kvh, rep, q, t).masked_fill(~causal, float("-inf")).reshape(n, kvh, rep * q, t)
    top = torch.maximum(sp.amax(-1, keepdim=True), ss.amax(-1, keepdim=True))
    ep, es = (sp - top).exp(), (ss - top).exp()
    denom = ep.sum(-1, keepdim=True) + es.sum(-1, keepdim=True)
    ep = ep.reshape(b, g, kvh, rep * q, p).transpose(1, 2).reshape(b, kvh, g * rep * q, p)
    op = (ep.to(values.dtype) @ values).reshape(b, kvh, g, rep * q, d).transpose(1, 2).reshape(n, kvh, rep * q, d)
    out = ((op.float() + (es.to(value.dtype) @ value).float()) / denom).to(query.dtype)
    return out.reshape(n, h, q, d).transpose(1, 2).contiguous(), None


GROUPED_DECODE_ENV = "ALIGNMENT_GAMES_GROUPED_DECODE"


def grouped_decode_setting() -> bool | None:
    """``PolicyBank.grouped_decode`` from the environment variable ``ALIGNMENT_GAMES_GROUPED_DECODE``.

    Unset or ``auto`` → None (CPU only), ``1``/``true``/``on`` → True, ``0``/``false``/``off`` → False.

    Raises:
        ValueError: naming the variable, for any other value.
    """
    raw = os.environ.get(GROUPED_DECODE_ENV, "auto").strip().lower()
    values = {"auto": None, "": None, "1": True, "true": True, "on": True, "0": False, "false": False, "off": False}
    if raw not in values:
        raise ValueError(f"{GROUPED_DECODE_ENV} must be one of 1, 0, true, false, on, off or auto, got {raw!r}")
    return values[raw]


def _register_grouped_attention() -> bool:
    """Register :func:`grouped_prefix_attention` (and a no-op mask) with transformers; False where unsupported."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        return False
    AttentionInterface.register(GROUPED_ATTENTION, grouped_prefix_attention)
    AttentionMaskInterface.register(GROUPED_ATTENTION, lambda *args, **kwargs: None)
    return True
