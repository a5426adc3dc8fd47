"""Row chunks (micro-batches) of a rollout's forward passes: at most a number of rows, and of padded tokens, a chunk.

Pure: row lengths in, ``(start, stop)`` row ranges out. :meth:`modules.lm.policy_bank.PolicyBank.token_logprobs`, the
GRPO update (``modules.grpo``) and the pool's GRPO followers chunk with :func:`micro_batches`, so a
``policy_gradient.max_tokens_per_micro_batch`` budget bounds every forward the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

__all__ = ["micro_batches", "row_lengths"]


def row_lengths(attention_mask: Tensor, prompt_width: int, completion_mask: Tensor) -> tuple[list[int], list[int]]:
    """Each row's prompt span and completion tokens: the columns a forward of the row alone needs.

    The prompt span runs from the row's first real prompt token to the prompt's end (prompts are left-padded, so it
    is the prompt's token count); the completion count is the mask's sum (completions are right-padded).

    Args:
        attention_mask: ``[N, P + C]``.
        prompt_width: ``P``.
        completion_mask: ``[N, C]``.
    """
    prompt = attention_mask[:, :prompt_width].bool()
    first = prompt.int().argmax(dim=1)  # the first real prompt column (0 when the row has none: see below)
    span = (prompt_width - first) * prompt.any(dim=1)
    return span.tolist(), completion_mask.sum(dim=1).tolist()


def micro_batches(
    prompt_lengths: Sequence[int],
    completion_lengths: Sequence[int],
    max_tokens: int = 0,
    max_rows: int = 0,
    group_size: int = 1,
) -> list[tuple[int, int]]:
    """Consecutive row ranges, in the given order, each within ``max_tokens`` padded tokens and ``max_rows`` rows.

    A chunk's padded cost is its rows × (its longest prompt span + its longest completion, at least 1): the width of
    the chunk's forward once the columns that are padding in all its rows are dropped (left-padded prompts, right-padded
    completions; an all-empty chunk still runs one completion column). Chunks are filled greedily. Both limits apply
    when both are set (0: no limit; neither: one chunk of every row).

    Groups (``group_size`` > 1 dividing the row count: consecutive rows sharing one prompt, which ``token_logprobs``
    then runs once per group) stay whole: ``max_rows`` is rounded up to whole groups, and a chunk ends on a group
    boundary. A group whose rows alone exceed ``max_tokens`` is cut into chunks of its own rows (its prompt then runs
    once per row), so only a single row over the budget is refused.

    The order is the caller's: this function never sorts. A caller may sort rows by length first (fewer padded tokens
    in each chunk, fewer chunks) when each row's part of its result does not depend on the others': a per-row
    ``token_logprobs``, or GRPO's loss, a mean over rows of per-row sequence means, where each chunk's mean weighted by
    its share of the rows (``accumulate`` of :mod:`modules.base`) sums to the whole batch's mean in any order. Every
    per-row tensor (advantages, old and reference log-probabilities) must then be permuted with the rows. A loss
    normalised over all tokens of the batch (a token mean) would need token weights instead of row weights.

    Args:
        prompt_lengths: Each row's prompt span (:func:`row_lengths`).
        completion_lengths: Each row's completion tokens.
        max_tokens: Padded tokens per chunk at most (``policy_gradient.max_tokens_per_micro_batch``; 0: no limit).
        max_rows: Rows per chunk at most (0: no limit).
        group_size: Rows per prompt group.

    Returns:
        ``[(start, stop), ...]`` covering ``0 … N`` in order.

    Raises:
        ValueError: a negative limit, lengths that differ in number, or a row whose own cost exceeds ``max_tokens``
            (naming ``max_tokens_per_micro_batch``, the row and its length).
    """
    n = len(prompt_lengths)
    if len(completion_lengths) != n:
        raise ValueError(f"{n} prompt lengths for {len(completion_lengths)} completion lengths")
    if max_tokens < 0 or max_rows < 0:
        raise ValueError(
            f"max_tokens_per_micro_batch ({max_tokens}) and the micro-batch rows ({max_rows}) must be >= 0"
        )
    g = group_size if group_size > 1 and n % group_size == 0 else 1

    def cost(start: int, stop: int) -> int:
        return (stop - start) * (max(prompt_lengths[start:stop]) + max(max(completion_lengths[start:stop]), 1))

    def pack(units: list[tuple[int, int]], cap: int) -> list[tuple[int, int]]:
        """Greedy: each unit (a whole group, or one row) joins the open chunk while both limits hold."""
        out: list[tuple[int, int]] = []
        for a, b in units:
            if out and (not cap or b - out[-1][0] <= cap) and (not max_tokens or cost(out[-1][0], b) <= max_tokens):
                out[-1] = (out[-1][0], b)
                continue
            if max_tokens and cost(a, b) > max_tokens:  # a single row: groups over the budget were cut into rows
                p, c = prompt_lengths[a], max(completion_lengths[a], 1)
                raise ValueError(
                    f"max_tokens_per_micro_batch={max_tokens} is below row {a}'s own length, {p + c} tokens "
                    f"(prompt {p} + completion {c}); raise it to at least {p + c}"
                )
            out.append((a, b))
        return out

    chunks: list[tuple[int, int]] = []
    groups: list[tuple[int, int]] = []  # whole groups between groups cut into rows
    group_cap = -(-max_rows // g) * g
    for a in range(0, n, g):
        if g > 1 and max_tokens and cost(a, a + g) > max_tokens:
            chunks += pack(groups, group_cap) + pack([(r, r + 1) for r in range(a, a + g)], max_rows)
            groups = []
        else:
            groups.append((a, a + g))
    return chunks + pack(groups, group_cap)
