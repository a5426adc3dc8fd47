"""How a :class:`PolicyBank` samples: decoders behind one protocol (:func:`make_decoder` picks from ``lm.decode``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor, nn

from alignment_games.modules.lm import static_decode
from alignment_games.modules.lm.decode_step import LeanDecoder, lean_decode_unsupported
from alignment_games.modules.lm.decoding import (
    GROUPED_ATTENTION,
    _register_grouped_attention,
    base_model,
    cache_arg,
    cascade_state,
    next_tokens,
    preallocated_cache,
    prompt_cache,
    shared_prompt_cache,
)
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.lm.vllm_engine import VLLMEngine

#: ``step_logits(token [N, 1], position [N, 1], step)``: every row's next-token logits ``[N, V]``
StepLogits = Callable[[Tensor, Tensor, int], Tensor]


def sample_loop(
    step_logits: StepLogits,
    ids: Tensor,
    mask: Tensor,
    g: int,
    sampling: Sampling,
    greedy: bool,
    eos: int | None,
    pad: int,
) -> Tensor:
    """``[prompt | completion]`` rows, ``g`` per left-padded prompt, sampled as ``generate`` does, then padded."""
    rows = ids.repeat_interleave(g, dim=0)
    position = mask.repeat_interleave(g, dim=0).sum(dim=1, keepdim=True) - 1
    token = rows[:, -1:].contiguous()  # the strides of every later step's token (no recompile when compiled)
    unfinished = torch.ones(rows.shape[0], dtype=torch.bool, device=ids.device)
    new: list[Tensor] = []
    s = sampling
    for step in range(s.max_new_tokens):
        logits = step_logits(token, position, step)
        nxt = next_tokens(logits, step, s.min_new_tokens, eos, not greedy, s.temperature, s.top_p)
        new.append(nxt := torch.where(unfinished, nxt, torch.full_like(nxt, pad)))
        if eos is not None:
            unfinished &= nxt != eos
        if not bool(unfinished.any()):
            break
        token, position = nxt[:, None], position + 1
    return torch.cat([rows, torch.stack(new, dim=1)], dim=1)


class Decoder(Protocol):
    """Samples ``g`` continuations of each left-padded prompt."""

    def decode(self, model: nn.Module, ids: Tensor, mask: Tensor, g: int, sampling: Sampling, greedy: bool) -> Tensor:
        """``[B·G, W + T]`` rows: prompt ``b``'s ids ``[W]`` then a completion, rows ``b*G … b*G + G - 1``."""
        ...


class GenerateDecoder:
    """transformers' ``generate``; a group's prompt (but its last token) prefilled once, its cache copied per row."""

    def __init__(self, eos: int | None, pad: int, share_prompts: bool = True) -> None:
        self.eos, self.pad, self.share_prompts = eos, pad, share_prompts

    def decode(self, model: nn.Module, ids: Tensor, mask: Tensor, g: int, sampling: Sampling, greedy: bool) -> Tensor:
        """See :meth:`Decoder.decode`."""
        shared = g > 1 and self.share_prompts and ids.shape[1] > 1
        extra = shared_prompt_cache(model, ids, mask, g) if shared else {}
        return model.generate(
            input_ids=ids.repeat_interleave(g, dim=0),
            attention_mask=mask.repeat_interleave(g, dim=0),
            **extra,
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            top_k=None if greedy else 0,
            max_new_tokens=sampling.max_new_tokens,
            min_new_tokens=sampling.min_new_tokens or None,
            pad_token_id=self.pad,
            eos_token_id=self.eos,
        )


def _cascade_ok(model: nn.Module) -> bool:
    """Whether ``model`` can run a cascade attention: transformers' attention interface on sdpa or eager."""
    base = base_model(model)
    backend = getattr(base, "_supports_attention_backend", False)
    if not backend or getattr(base.config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    return _register_grouped_attention() and _register_grouped_attention(static_decode.STATIC_ATTENTION)


class GroupedDecoder:
    """Each prompt's cache held once for its G rows, stepped by ``LeanDecoder`` if ``lean`` and it serves the model."""

    def __init__(self, fallback: GenerateDecoder, lean: bool = True) -> None:
        self.fallback, self.lean = fallback, lean

    def serves(self, model: nn.Module, group: int, width: int) -> bool:
        """Whether this decoder (not its fallback) decodes ``group`` rows per prompt of ``width`` tokens."""
        if not self.fallback.share_prompts or width < 2:
            return False
        return (group >= 2 or self.lean and lean_decode_unsupported(model) is None) and _cascade_ok(model)

    def decode(self, model: nn.Module, ids: Tensor, mask: Tensor, g: int, sampling: Sampling, greedy: bool) -> Tensor:
        """See :meth:`Decoder.decode`."""
        if not self.serves(model, g, ids.shape[1]):
            return self.fallback.decode(model, ids, mask, g, sampling, greedy)
        cache, prompt_mask = prompt_cache(model, ids, mask)
        loop = (ids, mask, g, sampling, greedy, self.fallback.eos, self.fallback.pad)
        if self.lean and lean_decode_unsupported(model) is None:
            decoder = LeanDecoder(model, cache, prompt_mask, g, sampling.max_new_tokens)
            del cache
            return sample_loop(lambda token, position, step: decoder.step(token, position), *loop)
        pad_mask = torch.zeros(mask.shape[0], 1, ids.shape[1] - 1, device=ids.device)  # fp32, added to fp32 scores
        pad_mask = pad_mask.masked_fill(prompt_mask[:, None] == 0, float("-inf"))
        prefix = {i: (layer.keys, layer.values, pad_mask) for i, layer in enumerate(cache.layers)}
        own = preallocated_cache(sampling.max_new_tokens)  # the prompt's last token, then all written but the last
        kw = {cache_arg(model): own}

        def step_logits(token: Tensor, position: Tensor, step: int) -> Tensor:
            return model(input_ids=token, position_ids=position, use_cache=True, **kw).logits[:, -1, :]

        with cascade_state(model, GROUPED_ATTENTION, prefix):
            return sample_loop(step_logits, *loop)


class StaticDecoder(GroupedDecoder):
    """The grouped cascade over full-length caches (:mod:`alignment_games.modules.lm.static_decode`), compiled."""

    bucket = 64  #: prompt widths are padded to a multiple of this in a compiled decode (one graph per bucket)

    def __init__(self, fallback: GenerateDecoder, compile: bool = False) -> None:
        super().__init__(fallback, lean=False)
        self.compile = compile
        self.caches: dict[int, static_decode.StaticCascade] | None = None  # kept when compiled
        self.compiled: Callable | None = None  # the compiled step, built on first use

    def serves(self, model: nn.Module, group: int, width: int) -> bool:
        """Whether this decoder (not its fallback) decodes ``group`` rows per prompt (G = 1 too) of ``width`` tokens."""
        return super().serves(model, max(group, 2), width)

    def decode(self, model: nn.Module, ids: Tensor, mask: Tensor, g: int, sampling: Sampling, greedy: bool) -> Tensor:
        """See :meth:`Decoder.decode`."""
        if not self.serves(model, g, ids.shape[1]):
            return self.fallback.decode(model, ids, mask, g, sampling, greedy)
        prompt, prompt_mask = prompt_cache(model, ids, mask)
        bucket, reuse = (self.bucket, self.caches) if self.compile else (1, None)
        caches = static_decode.build_caches(prompt, prompt_mask, g, sampling.max_new_tokens, bucket, reuse)
        del prompt
        step_fn = static_decode.step_logits
        if self.compile:
            if caches is not self.caches:
                static_decode.mark_static(caches)
                self.caches = caches
            if self.compiled is None:
                self.compiled = torch.compile(static_decode.step_logits, **static_decode.compile_options(ids.device))
            step_fn = self.compiled
        slot = caches[0].step

        def step_logits(token: Tensor, position: Tensor, step: int) -> Tensor:
            slot.fill_(step)
            return step_fn(model, token, position)

        with cascade_state(model, static_decode.STATIC_ATTENTION, caches):
            return sample_loop(step_logits, ids, mask, g, sampling, greedy, self.fallback.eos, self.fallback.pad)


class DeviceDecoder:
    """``lm.decode: auto``: ``cpu`` on CPU (grouped), ``other`` elsewhere (static)."""

    def __init__(self, cpu: Decoder, other: Decoder) -> None:
        self.cpu, self.other = cpu, other

    def decode(self, model: nn.Module, ids: Tensor, mask: Tensor, g: int, sampling: Sampling, greedy: bool) -> Tensor:
        """See :meth:`Decoder.decode`."""
        decoder = self.cpu if ids.device.type == "cpu" else self.other
        return decoder.decode(model, ids, mask, g, sampling, greedy)


def make_decoder(lm: ModelConfig, eos: int | None, pad: int) -> Decoder | VLLMEngine:
    """The decoder ``lm.decode`` names (``lm.compile_decode`` compiles the static one; ``vllm``: a VLLMEngine)."""
    if lm.decode == "vllm":
        return VLLMEngine(lm, eos, pad)
    fallback = GenerateDecoder(eos, pad, share_prompts=not lm.gradient_checkpointing)
    if lm.decode == "generate":
        return fallback
    if lm.decode in ("grouped", "grouped_forward"):
        return GroupedDecoder(fallback, lean=lm.decode == "grouped")
    static = StaticDecoder(fallback, lm.compile_decode)
    return static if lm.decode == "static" else DeviceDecoder(GroupedDecoder(fallback), static)
