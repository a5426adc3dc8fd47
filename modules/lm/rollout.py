"""Sampled sequences of a player: :class:`Rollout`, as :meth:`PolicyBank.generate` gives them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class Rollout:
    """Sampled sequences of one player: ``[N, P + C]`` left-padded prompts then completions (``completion_mask``).

    ``sample_logprobs`` ``[N, C]``: each completion token's sampling log-probability where the decoder reports it.
    """

    sequences: Tensor
    attention_mask: Tensor
    prompt_width: int
    completion_mask: Tensor
    texts: list[str]
    group_size: int = 1
    sample_logprobs: Tensor | None = None

    @classmethod
    def from_decode(
        cls,
        sequences: Tensor,
        prompt_mask: Tensor,
        group_size: int,
        tokenizer: Any,
        sample_logprobs: Tensor | None = None,
    ) -> Rollout:
        """Rows ``[N, P + C]`` decoded after prompts of mask ``[N, P]``; each completion ends at its first EOS."""
        width = prompt_mask.shape[1]
        completion = sequences[:, width:]
        is_eos = completion == tokenizer.eos_token_id
        completion_mask = (~((is_eos.cumsum(dim=1) - is_eos.long()) > 0)).long()
        texts = tokenizer.batch_decode(completion * completion_mask, skip_special_tokens=True)
        attention = torch.cat([prompt_mask, completion_mask], dim=1)
        if sample_logprobs is not None:
            sample_logprobs = sample_logprobs * completion_mask
        return cls(sequences, attention, width, completion_mask, texts, group_size, sample_logprobs)

    @property
    def num_empty(self) -> int:
        """Completions that are empty once special tokens are dropped."""
        return sum(1 for t in self.texts if not t.strip())

    def split(self, counts: Sequence[int]) -> list[Rollout]:
        """Consecutive pieces of ``counts[i]`` prompts each, each with the shapes a decode of its prompts alone gives.

        Raises:
            ValueError: when the counts do not add up to the rollout's prompts.
        """
        g, n = max(self.group_size, 1), self.sequences.shape[0]
        if any(c < 1 for c in counts) or sum(counts) * g != n:
            raise ValueError(f"Rollout.split: counts {list(counts)} (x group_size {g}) do not tile the {n} rows")
        pieces, start, p = [], 0, self.prompt_width
        for count in counts:
            rows = slice(start, start + count * g)
            width = int(self.attention_mask[rows, :p].sum(dim=1).max())  # prompts are left-padded
            length = int(self.completion_mask[rows].sum(dim=1).max())
            cols = slice(p - width, p + length)
            lps = None if self.sample_logprobs is None else self.sample_logprobs[rows, :length]
            seq, att, comp = self.sequences[rows, cols], self.attention_mask[rows, cols], self.completion_mask[rows]
            pieces.append(Rollout(seq, att, width, comp[:, :length], self.texts[rows], self.group_size, lps))
            start += count * g
        return pieces

    def rows(self, index: slice | Sequence[int] | Tensor, group_size: int | None = None) -> Rollout:
        """The rows ``index`` (a slice, or row numbers), prompt width kept; ``group_size`` given, kept or 1."""
        if isinstance(index, slice):
            start, stop, _ = index.indices(self.sequences.shape[0])
            whole = start % self.group_size == 0 and (stop - start) % self.group_size == 0
            group_size, texts = group_size or (self.group_size if whole else 1), self.texts[index]
        else:
            index = torch.as_tensor(index, dtype=torch.long, device=self.sequences.device)
            group_size, texts = group_size or 1, [self.texts[i] for i in index.tolist()]
        seq, att, comp = self.sequences[index], self.attention_mask[index], self.completion_mask[index]
        lps = None if self.sample_logprobs is None else self.sample_logprobs[index]
        return Rollout(seq, att, self.prompt_width, comp, texts, group_size, lps)
