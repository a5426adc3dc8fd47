"""Sampled sequences of a player: :class:`Rollout`, as :meth:`~modules.lm.policy_bank.PolicyBank.generate` returns them.

Rows are a left-padded prompt then the completion; :meth:`Rollout.split` cuts a decode of several players' prompts back
into each player's own, :meth:`Rollout.rows` selects rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["Rollout"]


@dataclass
class Rollout:
    """Sampled sequences of one player.

    Attributes:
        sequences: ``[N, P + C]`` token ids: left-padded prompt (width P) then completion (right-padded).
        attention_mask: ``[N, P + C]``.
        prompt_width: P.
        completion_mask: ``[N, C]``: 1 on completion tokens up to and including the first EOS.
        texts: Decoded completions.
        group_size: Consecutive rows that share one prompt (``num_samples`` of :meth:`PolicyBank.generate`; 1 when
            unknown).
    """

    sequences: Tensor
    attention_mask: Tensor
    prompt_width: int
    completion_mask: Tensor
    texts: list[str]
    group_size: int = 1

    @classmethod
    def from_decode(cls, sequences: Tensor, prompt_mask: Tensor, group_size: int, tokenizer: Any) -> Rollout:
        """The rollout of decoded rows ``[N, P + C]`` after prompts of mask ``prompt_mask`` ``[N, P]``.

        The completion is every token up to and including the first EOS (generating EOS is an action too); pads only
        follow a finished row's EOS, a pad token sampled mid-reply is an action like any other.
        """
        width = prompt_mask.shape[1]
        completion = sequences[:, width:]
        is_eos = completion == tokenizer.eos_token_id
        completion_mask = (~((is_eos.cumsum(dim=1) - is_eos.long()) > 0)).long()
        texts = tokenizer.batch_decode(completion * completion_mask, skip_special_tokens=True)
        attention = torch.cat([prompt_mask, completion_mask], dim=1)
        return cls(sequences, attention, width, completion_mask, texts, group_size)

    @property
    def num_empty(self) -> int:
        """Completions that are empty once special tokens are dropped."""
        return sum(1 for t in self.texts if not t.strip())

    def split(self, counts: Sequence[int]) -> list[Rollout]:
        """Consecutive pieces of ``counts[i]`` prompts each (``group_size`` rows a prompt), each as decoded alone.

        A piece keeps only its own widest prompt and its own longest completion (the columns before and after are
        padding in every row of it), so a piece of a decode of several players' prompts (:meth:`PolicyBank.generate`
        with a player per prompt) has the shapes a decode of its prompts alone gives.

        Raises:
            ValueError: when the counts do not add up to the rollout's prompts.
        """
        g = max(self.group_size, 1)
        if any(c < 1 for c in counts) or sum(counts) * g != self.sequences.shape[0]:
            rows = self.sequences.shape[0]
            raise ValueError(f"Rollout.split: counts {list(counts)} (x group_size {g}) do not tile the {rows} rows")
        pieces, start, p = [], 0, self.prompt_width
        for count in counts:
            rows = slice(start, start + count * g)
            width = int(self.attention_mask[rows, :p].sum(dim=1).max())  # prompts are left-padded
            length = int(self.completion_mask[rows].sum(dim=1).max())
            cols = slice(p - width, p + length)
            pieces.append(
                Rollout(
                    self.sequences[rows, cols],
                    self.attention_mask[rows, cols],
                    width,
                    self.completion_mask[rows, :length],
                    self.texts[rows],
                    self.group_size,
                )
            )
            start += count * g
        return pieces

    def rows(self, index: slice | Sequence[int] | Tensor, group_size: int | None = None) -> Rollout:
        """The rows ``index`` (a slice, or row numbers in order), prompt width kept.

        ``group_size`` of the result: the one given; else, for a slice, this rollout's when the slice cuts no prompt
        group, and 1 otherwise or for row numbers.
        """
        if isinstance(index, slice):
            start, stop, _ = index.indices(self.sequences.shape[0])
            whole = start % self.group_size == 0 and (stop - start) % self.group_size == 0
            group_size, texts = group_size or (self.group_size if whole else 1), self.texts[index]
        else:
            index = torch.as_tensor(index, dtype=torch.long, device=self.sequences.device)
            group_size, texts = group_size or 1, [self.texts[i] for i in index.tolist()]
        seq, att, comp = self.sequences[index], self.attention_mask[index], self.completion_mask[index]
        return Rollout(seq, att, self.prompt_width, comp, texts, group_size)
