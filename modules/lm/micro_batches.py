"""Row chunks (micro-batches) of a rollout's forward passes: at most a number of rows, and of padded tokens, a chunk."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor


def row_lengths(attention_mask: Tensor, prompt_width: int, completion_mask: Tensor) -> tuple[list[int], list[int]]:
    """Each row's prompt span (left-padded: its token count) and completion tokens (the mask's sum)."""
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
    """``(start, stop)`` row ranges in order, each within ``max_tokens`` padded tokens and ``max_rows`` rows (0: none).

    Groups (one shared prompt) stay whole unless one alone exceeds ``max_tokens``; never sorts.

    Raises:
        ValueError: a negative limit, lengths that differ in number, or a row whose own cost exceeds ``max_tokens``.
    """
    if len(completion_lengths) != (n := len(prompt_lengths)):
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
