"""Log-probabilities of chosen tokens under a causal LM's head, in memory bounded by a chunk of tokens.

The head runs on a checkpointed chunk at a time, so peak memory is O(chunk × V), not O(N × T × V) fp32 logits.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from alignment_games.modules.lm.decoding import base_model

LOGIT_CHUNK_BYTES = 128 * 2**20
"""Default size of one chunk's fp32 logits (about 220 tokens at a vocabulary of 151,936)."""

# logit scales a bare head call would miss (final_logit_softcapping is reproduced instead)
_UNSUPPORTED_SCALES = ("logit_scale", "logits_scaling")


def chunk_tokens_for(vocab_size: int, chunk_bytes: int = LOGIT_CHUNK_BYTES) -> int:
    """Tokens per chunk so that one chunk's fp32 logits take at most ``chunk_bytes`` (at least one token)."""
    return max(1, chunk_bytes // (4 * vocab_size))


def output_layer(model: nn.Module) -> nn.Module:
    """The module that maps final hidden states to logits (peft's wrapper of it when the head is adapted)."""
    head = base_model(model).get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(base_model(model)).__name__} has no output embeddings: it is not a causal LM")
    return head


def _softcap(model: nn.Module) -> float | None:
    """``final_logit_softcapping`` of the model's config, after refusing logit scales the chunked path lacks."""
    config = getattr(base_model(model), "config", None)
    for name in _UNSUPPORTED_SCALES:
        if (value := getattr(config, name, None)) not in (None, 1):
            raise ValueError(
                f"{type(base_model(model)).__name__} scales its logits by config.{name}={value}; the chunked "
                "log-probabilities apply the output layer alone and would leave that scale out"
            )
    return getattr(config, "final_logit_softcapping", None)


@contextmanager
def head_inputs(model: nn.Module) -> Iterator[list[Tensor]]:
    """Within the block, ``model``'s output layer gets no positions (empty logits); its inputs are collected."""
    seen: list[Tensor] = []

    def keep_none(module: nn.Module, args: tuple) -> tuple:
        # transformers' causal LMs call their output layer with the hidden states as the one positional argument
        seen.append(args[0])
        return (args[0][..., :0, :], *args[1:])

    handle = output_layer(model).register_forward_pre_hook(keep_none)
    try:
        yield seen
    finally:
        handle.remove()


def _adapter_state(head: nn.Module) -> list[tuple[nn.Module, Any, Any]]:
    """Which adapter each peft layer inside ``head`` applies now (empty for a plain layer)."""
    return [
        (m, copy.copy(m._active_adapter), m._disable_adapters)  # a copy: a list of names could change in place
        for m in head.modules()
        if hasattr(m, "_active_adapter") and hasattr(m, "_disable_adapters")
    ]


@contextmanager
def _applying(state: list[tuple[nn.Module, Any, Any]]) -> Iterator[None]:
    """Put ``state`` (from :func:`_adapter_state`) on its layers for the block, then what they had before."""
    before = [(m, m._active_adapter, m._disable_adapters) for m, _, _ in state]
    try:
        for m, active, disabled in state:
            m._active_adapter, m._disable_adapters = active, disabled
        yield
    finally:
        for m, active, disabled in before:
            m._active_adapter, m._disable_adapters = active, disabled


def _chunk_logprobs(
    head: nn.Module, hidden: Tensor, targets: Tensor, temperature: float, softcap: float | None
) -> Tensor:
    logits = head(hidden)
    if softcap is not None:  # as the architectures that have it apply it: on the model-dtype logits
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.float() / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def head_token_logprobs(
    model: nn.Module, hidden: Tensor, targets: Tensor, temperature: float = 1.0, chunk_tokens: int | None = None
) -> Tensor:
    """``log softmax(head(hidden) / T)[target]`` per token, fp32, a checkpointed chunk at a time.

    Raises:
        ValueError: for a model without output embeddings, or whose config scales its logits (``logit_scale``,
            ``logits_scaling``).
    """
    head = output_layer(model)
    softcap = _softcap(model)
    flat_h, flat_t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    vocab = base_model(model).config.vocab_size if hasattr(base_model(model), "config") else head.weight.shape[0]
    step = chunk_tokens or chunk_tokens_for(vocab)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    state = _adapter_state(head) if grad else []

    def contexts() -> tuple[AbstractContextManager, AbstractContextManager]:
        return nullcontext(), _applying(state)

    # no metadata check: ZeRO-3 swaps the head weight's data out after the recompute (values are the same)
    options = {"use_reentrant": False, "context_fn": contexts, "determinism_check": "none"}
    out = []
    for start in range(0, flat_h.shape[0], step):
        args = (head, flat_h[start : start + step], flat_t[start : start + step], temperature, softcap)
        out.append(checkpoint(_chunk_logprobs, *args, **options) if grad else _chunk_logprobs(*args))
    if not out:
        return torch.zeros(targets.shape, dtype=torch.float32, device=hidden.device)
    return torch.cat(out).view(targets.shape)
