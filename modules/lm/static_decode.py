"""Static-cache grouped decoding: caches allocated once at full length, the fixed shapes ``torch.compile`` needs."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from alignment_games.modules.lm.decoding import cascade_attention

STATIC_ATTENTION = "alignment_games_static_cascade"


@dataclass
class StaticCascade:
    """One layer's caches: prompt keys/values/mask once per prompt (bucket-padded), the rows' own, the step."""

    prefix_keys: Tensor
    prefix_values: Tensor
    prefix_mask: Tensor
    own_keys: Tensor
    own_values: Tensor
    step: Tensor

    def attend(self, query: Tensor, key: Tensor, value: Tensor, scaling: float | None) -> Tensor:
        """Write this step's key and value into slot ``step`` of the own cache, then attend over both parts.

        The model runs with ``use_cache=False``; its ``attention_mask`` is ignored (the masks are in the cache).
        """
        self.own_keys.index_copy_(2, self.step, key.to(self.own_keys.dtype))
        self.own_values.index_copy_(2, self.step, value.to(self.own_values.dtype))
        slots = torch.arange(self.own_keys.shape[2], device=query.device)
        own_mask = torch.zeros(slots.shape, device=query.device).masked_fill(slots > self.step, float("-inf"))
        prefix = (self.prefix_keys, self.prefix_values, self.prefix_mask)
        return cascade_attention(query, *prefix, self.own_keys, self.own_values, scaling, own_mask)


def build_caches(
    prompt_cache: Any,
    prompt_mask: Tensor,
    group: int,
    max_new_tokens: int,
    bucket: int,
    reuse: dict[int, StaticCascade] | None = None,
) -> dict[int, StaticCascade]:
    """Static caches of every layer filled from the prompt cache; ``reuse`` refilled in place when shapes match."""
    b, p = prompt_mask.shape
    pb = -(-p // bucket) * bucket
    layers = prompt_cache.layers
    _, kvh, _, d = layers[0].keys.shape
    dtype, device = layers[0].keys.dtype, prompt_mask.device
    shapes = ((b, kvh, pb, d), (b, 1, pb), (b * group, kvh, max_new_tokens, d))
    key = (shapes, dtype, device)
    if reuse is not None and len(reuse) == len(layers) and all(_layout(c) == key for c in reuse.values()):
        caches = reuse
    else:
        step = torch.zeros(1, dtype=torch.long, device=device)
        mask = torch.empty(shapes[1], device=device)
        empty = functools.partial(torch.empty, dtype=dtype, device=device)
        caches = {
            i: StaticCascade(empty(shapes[0]), empty(shapes[0]), mask, empty(shapes[2]), empty(shapes[2]), step)
            for i in range(len(layers))
        }
    caches[0].step.zero_()
    # -inf on left padding and on the bucket's padding on the right: no weight, whatever those slots hold
    caches[0].prefix_mask.fill_(float("-inf"))
    caches[0].prefix_mask[:, 0, :p].masked_fill_(prompt_mask != 0, 0.0)
    for c, layer in zip(caches.values(), layers, strict=True):
        # zeros, not stale or uninitialised values: a masked slot weighs 0, and 0 times a NaN would still be NaN
        for t in (c.prefix_keys, c.prefix_values, c.own_keys, c.own_values):
            t.zero_()
        c.prefix_keys[:, :, :p].copy_(layer.keys)
        c.prefix_values[:, :, :p].copy_(layer.values)
    return caches


def _layout(c: StaticCascade) -> tuple:
    return (c.prefix_keys.shape, c.prefix_mask.shape, c.own_keys.shape), c.own_keys.dtype, c.own_keys.device


def step_logits(model: nn.Module, token: Tensor, position: Tensor) -> Tensor:
    """One decode step: the last logits ``[N, V]`` in fp32 of ``token`` (``[N, 1]``) at ``position`` (``[N, 1]``)."""
    out = model(input_ids=token, position_ids=position, use_cache=False)
    return out.logits[:, -1, :].float()


def compile_options(device: torch.device) -> dict[str, Any]:
    """``torch.compile`` keywords of the decode step: CUDA graphs on CUDA (``reduce-overhead``), inductor elsewhere."""
    return {"mode": "reduce-overhead" if device.type == "cuda" else "default", "dynamic": False}


def mark_static(caches: dict[int, StaticCascade]) -> None:
    """Tell torch.compile the caches keep their addresses, so CUDA graphs write into them instead of copying them."""
    for c in caches.values():
        for t in (c.prefix_keys, c.prefix_values, c.prefix_mask, c.own_keys, c.own_values):
            torch._dynamo.mark_static_address(t)
