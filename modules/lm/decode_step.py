"""One decoded token of a Llama-family decoder as plain tensor operations, without module calls (the CPU step)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from alignment_games.modules.distributed.sharding import fsdp_wrapped
from alignment_games.modules.lm.decoding import base_model, cascade_attention, rotary
from alignment_games.modules.lm.row_adapters import add_row_adapters

LEAN_MODEL_TYPES = ("llama", "qwen2")  #: model types with Llama's pre-RMS-norm rotary attention and gated MLP layer


def _linear(module: nn.Module) -> nn.Module:
    """The plain linear layer a (possibly peft-wrapped) projection computes with."""
    # looked up on the class: a miss on the instance costs an exception in nn.Module.__getattr__, per token
    return module.get_base_layer() if hasattr(type(module), "get_base_layer") else module


def lean_decode_unsupported(model: nn.Module) -> str | None:
    """Why :class:`LeanDecoder` cannot decode ``model`` exactly, or ``None`` when it can."""
    base = base_model(model)
    config = getattr(base, "config", None)
    if config is None or getattr(config, "model_type", None) not in LEAN_MODEL_TYPES:
        return f"model type {getattr(config, 'model_type', None)!r} is not one of {LEAN_MODEL_TYPES}"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    inner = getattr(base, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, a) for a in needed) or getattr(base, "lm_head", None) is None:
        return "not a decoder with embed_tokens, layers, norm, rotary_emb and lm_head"
    for m in base.modules():
        # an active LoRA layer adds its update in its own forward, which the base weights read here leave out
        active = hasattr(m, "lora_A") and not m.disable_adapters and not m.merged
        if active and any(a in m.lora_A for a in m.active_adapters):
            return "a LoRA layer is active (its update is not in the base weights)"
    for layer in inner.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or getattr(attn, "sliding_window", None) is not None:
            return "a layer has a sliding window or no self_attn/mlp"
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return "query/key norms"
        if not all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim")):
            return "attention without q/k/v/o projections"
        if not all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return "an MLP that is not gate/up/down"
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            if type(_linear(proj)) is not nn.Linear:
                return f"{type(_linear(proj)).__name__} projections (quantised or sharded)"
    if (wrapped := fsdp_wrapped(base)) is not None:  # its weights are gathered by hooks that this read would skip
        return f"FSDP-wrapped module {wrapped}"
    for p in base.parameters():
        if type(p.data) is not Tensor or hasattr(p, "ds_id") or p.is_meta:
            return "sharded or offloaded parameters"
    return None


def _rms_norm(norm: nn.Module, x: Tensor) -> Tensor:
    """Llama's RMSNorm as transformers computes it (in fp32, the weight applied in the input's dtype)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(dtype)


class LeanDecoder:
    """Decodes ``B·G`` rows continuing ``B`` prompts, one token per :meth:`step`.

    Raises:
        ValueError: naming the reason :func:`lean_decode_unsupported` gives, or for a step past ``max_new_tokens``.
    """

    def __init__(
        self, model: nn.Module, prompt_cache: Any, prompt_mask: Tensor, group_size: int, max_new_tokens: int
    ) -> None:
        if (reason := lean_decode_unsupported(model)) is not None:
            raise ValueError(f"LeanDecoder: {reason}")
        base = base_model(model)
        self.inner, self.head = base.model, base.lm_head
        self.layers = list(self.inner.layers)
        b, p = prompt_mask.shape
        self.rows, self.capacity, self.filled = b * group_size, max_new_tokens, 0
        # each prompt's keys and values once (its G rows read them in one cascade), the rows' own in buffers
        self.prefix = [(layer.keys, layer.values) for layer in prompt_cache.layers[: len(self.layers)]]
        pad = torch.zeros(b, 1, p, dtype=torch.float32, device=prompt_mask.device)
        self.pad = pad.masked_fill(prompt_mask[:, None, :] == 0, float("-inf"))
        # one row per prompt (G = 1): nothing to share, so a row's prompt and own keys sit in one buffer read by one
        # fused attention call a layer (the cascade's two parts and merged softmax cost ~20 more small ops)
        self.start = p if group_size == 1 else 0  # where a row's own keys begin in its buffer
        size = self.start + max_new_tokens
        self.keys = [k.new_empty(self.rows, k.shape[1], size, k.shape[-1]) for k, _ in self.prefix]
        self.values = [v.new_empty(self.rows, v.shape[1], size, v.shape[-1]) for _, v in self.prefix]
        if self.start:
            for i, (k, v) in enumerate(self.prefix):
                self.keys[i][:, :, :p], self.values[i][:, :, :p] = k, v
            self.prefix = []
            # the padding's additive mask over the whole buffer; None (no mask: the fastest kernel) without padding
            mask = torch.cat([self.pad, self.pad.new_zeros(b, 1, max_new_tokens)], dim=-1)[:, None]
            self.mask = mask if bool(prompt_mask.eq(0).any()) else None

    @torch.no_grad()
    def step(self, token: Tensor, position: Tensor) -> Tensor:
        """Logits ``[rows, V]`` of the next token after ``token`` ``[rows, 1]`` at ``position`` ``[rows, 1]``."""
        if self.filled >= self.capacity:
            raise ValueError(f"LeanDecoder: more than {self.capacity} tokens decoded")
        s, n = self.filled, self.rows
        h = self.inner.embed_tokens(token)
        cos, sin = (c.unsqueeze(1) for c in self.inner.rotary_emb(h, position))
        for i, layer in enumerate(self.layers):
            attn, mlp, d = layer.self_attn, layer.mlp, layer.self_attn.head_dim
            x, qkv = _rms_norm(layer.input_layernorm, h), (attn.q_proj, attn.k_proj, attn.v_proj)
            q, k, v = (_project(w, x).view(n, 1, -1, d).transpose(1, 2) for w in qkv)
            q, k = rotary(q, cos, sin), rotary(k, cos, sin)
            end = self.start + s + 1
            self.keys[i][:, :, end - 1 : end] = k
            self.values[i][:, :, end - 1 : end] = v
            own_k, own_v = self.keys[i][:, :, :end], self.values[i][:, :, :end]
            if self.start:
                mask = None if self.mask is None else self.mask[..., :end]
                out = F.scaled_dot_product_attention(
                    q, own_k, own_v, attn_mask=mask, scale=attn.scaling, enable_gqa=q.shape[1] != k.shape[1]
                ).transpose(1, 2)
            else:
                keys, values = self.prefix[i]
                out = cascade_attention(q, keys, values, self.pad, own_k, own_v, attn.scaling)
            h = h + _project(attn.o_proj, out.reshape(n, 1, -1))
            x = _rms_norm(layer.post_attention_layernorm, h)
            h = h + _project(mlp.down_proj, mlp.act_fn(_project(mlp.gate_proj, x)) * _project(mlp.up_proj, x))
        self.filled = s + 1
        h = _rms_norm(self.inner.norm, h)
        return _project(self.head, h[:, -1])


def _project(module: nn.Module, x: Tensor) -> Tensor:
    """The projection's base weights on ``x``, plus each row's own LoRA update in a decode of several players."""
    linear = _linear(module)
    out = F.linear(x, linear.weight, linear.bias)
    if "_row_adapter" in module.__dict__:  # set by row_adapters (not hasattr: see _linear)
        out = add_row_adapters(module, x, out)
    return out
