"""Tokenising (prompt, response) sequences for scoring models: datamodules and frozen scorers share one encoding."""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from alignment_games.modules.algorithms.checks import require_at_least


@dataclass
class EncodedSequences:
    """Token ids (and token type ids, or ``None``) of (prompt, response) sequences, and the truncated rows."""

    input_ids: list[list[int]]
    token_type_ids: list[list[int]] | None
    truncated: list[int]


def encode_prompt_responses(
    tokenizer, prompts: Sequence[str], responses: Sequence[str], max_length: int, warn: bool = True
) -> EncodedSequences:
    """Tokenise each (prompt, response) pair; one too long is cut from the prompt's left first, counted and warned of.

    Raises:
        ValueError: when lengths differ or ``max_length`` is too small to hold anything.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"prompts and responses differ in length: {len(prompts)} != {len(responses)}")
    require_at_least(max_length=(max_length, 8))
    if not prompts:
        return EncodedSequences([], None, [])
    full = tokenizer(list(prompts), list(responses), truncation=False, add_special_tokens=True)
    input_ids = list(full["input_ids"])
    long_rows = [i for i, ids in enumerate(input_ids) if len(ids) > max_length]
    type_ids = list(full["token_type_ids"]) if "token_type_ids" in full else None
    if long_rows:
        side, tokenizer.truncation_side = tokenizer.truncation_side, "left"
        try:
            pairs = [prompts[i] for i in long_rows], [responses[i] for i in long_rows]
            cut = tokenizer(*pairs, truncation="longest_first", max_length=max_length)
        finally:
            tokenizer.truncation_side = side
        for j, i in enumerate(long_rows):
            input_ids[i] = cut["input_ids"][j]
            if type_ids is not None:
                type_ids[i] = cut["token_type_ids"][j]
        if warn:
            warnings.warn(
                f"{len(long_rows)} of {len(prompts)} sequences exceeded max_length={max_length} and were truncated "
                f"(prompt cut from the left first); first such row: {long_rows[0]}",
                stacklevel=2,
            )
    return EncodedSequences(input_ids, type_ids, long_rows)


def sequence_key(ids: Sequence[int]) -> int:
    """A 63-bit content key of a token sequence: Python's tuple hash, which is stable across processes for ints."""
    return hash(tuple(ids)) & 0x7FFFFFFFFFFFFFFF


def pad_sequences(
    seqs: Sequence[Sequence[int]], pad_id: int, type_ids: Sequence[Sequence[int]] | None = None, left: bool = False
) -> dict[str, Tensor]:
    """Right-pad (``left``: left-pad) a batch; ``input_ids``, ``attention_mask`` and, when given, ``token_type_ids``."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    out = {"input_ids": ids, "attention_mask": torch.zeros_like(ids)}
    out |= {} if type_ids is None else {"token_type_ids": torch.zeros_like(ids)}
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols], out["attention_mask"][i, cols] = torch.as_tensor(s, dtype=torch.long), 1
        if type_ids is not None:
            out["token_type_ids"][i, cols] = torch.as_tensor(type_ids[i], dtype=torch.long)
    return out


_FIELD = re.compile(r"\{(prompt|leader_response)\}")


def fill_template(template: str, **values: str) -> str:
    """Replace ``{prompt}`` / ``{leader_response}`` in one pass over the template; data text is never re-read."""
    return _FIELD.sub(lambda m: values.get(m.group(1), m.group(0)), template)


def plain_chat(messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False) -> str:
    """One ``role: content`` line per message, for tokenizers without a chat template (then ``"assistant: "``).

    Example:
        >>> plain_chat([{"role": "user", "content": "Hi?"}], add_generation_prompt=True)
        'user: Hi?\\nassistant: '
    """
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant: " if add_generation_prompt else "")


def render_chat(tokenizer: Any, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False) -> str:
    """``messages`` as text: the tokenizer's chat template, or :func:`plain_chat` when it has none (or is ``None``)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return plain_chat(messages, add_generation_prompt)
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
