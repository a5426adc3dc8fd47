"""Sequence-classifier scores with the last decoder layer's query, MLP and output run only at the pooled position."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from alignment_games.modules.lm.decoding import rotary

#: model types whose decoder layer is ``x + attn(norm(x))`` then ``x + mlp(norm(x))`` with rotary q/k (Llama's)
POOLED_MODEL_TYPES = ("llama", "qwen2")


def supports_pooled_last_layer(model: nn.Module) -> bool:
    """Whether :func:`pooled_scores` can replace ``model``'s last decoder layer (else it runs the full forward)."""
    config = getattr(model, "config", None)
    layers = getattr(getattr(model, "base_model", None), "layers", None)
    if getattr(config, "model_type", None) not in POOLED_MODEL_TYPES or not layers:
        return False
    if model.training or getattr(config, "pretraining_tp", 1) != 1:
        return False
    last, needed = layers[-1], ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim", "layer_idx")
    attn = getattr(last, "self_attn", None)
    if attn is None or not all(hasattr(attn, a) for a in needed) or getattr(attn, "sliding_window", None) is not None:
        return False
    return all(hasattr(last, a) for a in ("input_layernorm", "post_attention_layernorm", "mlp"))


def pooled_positions(input_ids: Tensor, pad_token_id: int | None) -> Tensor:
    """Each row's pooled position: the rightmost token that is not ``pad_token_id`` (the last without one)."""
    n, width = input_ids.shape
    if pad_token_id is None:
        return torch.full((n,), width - 1, dtype=torch.long, device=input_ids.device)
    keep = (input_ids != pad_token_id).long()
    return (torch.arange(width, device=input_ids.device) * keep).argmax(dim=-1)


class _PooledLastLayer(nn.Module):
    """Stands in for a decoder layer: keys and values everywhere, the rest at ``positions`` (``None``: none)."""

    def __init__(self, layer: nn.Module, positions: Tensor | None, key_mask: Tensor) -> None:
        super().__init__()
        self.layer, self.positions, self.key_mask = layer, positions, key_mask
        self.attention_type = getattr(layer, "attention_type", "full_attention")

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Any = None,
        position_embeddings: tuple[Tensor, Tensor] | None = None,
        cache: Any = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> Tensor:
        layer, attn = self.layer, self.layer.self_attn
        cache = cache if cache is not None else past_key_values
        n, t, _ = hidden_states.shape
        d = attn.head_dim
        x = layer.input_layernorm(hidden_states)
        k, v = (proj(x).view(n, t, -1, d).transpose(1, 2) for proj in (attn.k_proj, attn.v_proj))
        cos, sin = position_embeddings
        cos, sin = cos.expand(n, -1, -1), sin.expand(n, -1, -1)
        k = rotary(k, cos.unsqueeze(1), sin.unsqueeze(1))
        if cache is not None:
            k, v = cache.update(k, v, attn.layer_idx)
        if self.positions is None:
            return hidden_states
        rows, at = torch.arange(n, device=hidden_states.device), self.positions
        kvh, s = k.shape[1], k.shape[2]
        q = attn.q_proj(x[rows, at]).view(n, kvh, -1, d)  # [N, KV, rep, D]: the rep query heads of each KV head
        q = rotary(q, cos[rows, at][:, None, None], sin[rows, at][:, None, None])
        # the pooled token sees the keys the causal mask gives it: real ones, up to itself
        visible = self.key_mask[:, :s].bool() & (torch.arange(s, device=k.device) <= (s - t + at).unsqueeze(1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None, None, :], scale=attn.scaling)
        h = hidden_states[rows, at] + attn.o_proj(out.reshape(n, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        out_states = hidden_states.clone()
        out_states[rows, at] = h
        return out_states


@contextmanager
def _last_layer_replaced(model: nn.Module, positions: Tensor | None, key_mask: Tensor) -> Iterator[None]:
    layers = model.base_model.layers
    original = layers[-1]
    layers[-1] = _PooledLastLayer(original, positions, key_mask)
    try:
        yield
    finally:
        layers[-1] = original


def pooled_scores(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, **kwargs: Any) -> Tensor:
    """``model(input_ids, attention_mask, **kwargs).logits`` (``[N, num_labels]``), its last layer pooled."""
    pooled = supports_pooled_last_layer(model)
    positions = pooled_positions(input_ids, model.config.pad_token_id) if pooled else None
    with _last_layer_replaced(model, positions, attention_mask) if pooled else nullcontext():
        return model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits


def prefix_cache(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, **kwargs: Any) -> Any:
    """The KV cache of ``model``'s backbone over a prefix that later tokens continue (its last layer runs no query)."""
    with _last_layer_replaced(model, None, attention_mask) if supports_pooled_last_layer(model) else nullcontext():
        out = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, **kwargs)
    return out.past_key_values
