"""Text inside a judge's prompt: quoted so it cannot forge the template, and cut (never the template) to fit."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence

QUOTE = "> "  #: Prefix of every line of judged text.
# U+2060 WORD JOINER: invisible, no special token contains it, so a special-token string broken by it is plain text.
_JOINER = "\u2060"


def break_special_tokens(text: str, special_tokens: Iterable[str] = ()) -> str:
    """``text`` with every special-token string (longer than one character) broken after its first character."""
    tokens = sorted({t for t in special_tokens if t and len(t) > 1}, key=len, reverse=True)
    # a broken string may still hold a shorter token: repeat (each pass only adds joiners, so passes ≤ tokens + 1)
    for _ in range(len(tokens) + 1):
        if not (found := [t for t in tokens if t in text]):
            return text
        for t in found:
            text = text.replace(t, t[0] + _JOINER + t[1:])
    return text


def quote_judged(text: str, special_tokens: Iterable[str] = ()) -> str:
    """Judged text as a quoted block: special tokens broken, every line (any line break) prefixed with :data:`QUOTE`."""
    if not (text := break_special_tokens(text, special_tokens)):
        return ""
    return "\n".join(QUOTE + line if line.strip() else QUOTE.rstrip() for line in text.splitlines())


def count_tokens(tokenizer, text: str) -> int:
    """Tokens of ``text`` as the judges encode their prompts (no special tokens added)."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def share_budget(lengths: Sequence[int], budget: int) -> list[int]:
    """Tokens kept per span so that they sum to at most ``budget``, cutting the longest spans first (water-filling).

    Raises:
        ValueError: for a negative budget or length.
    """
    if budget < 0 or any(n < 0 for n in lengths):
        raise ValueError(f"share_budget: budget and lengths must be non-negative, got {budget} and {list(lengths)}")
    if sum(lengths) <= budget:
        return list(lengths)
    lo, hi = 0, max(lengths)  # the largest c with sum(min(n, c)) <= budget, by bisection
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(min(n, mid) for n in lengths) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return [min(n, lo) for n in lengths]


def cut_middle(tokenizer, text: str, keep: int) -> str:
    """``text`` with its middle cut so that about ``keep`` of its tokens remain, the cut marked with its size."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= keep:
        return text
    keep = max(0, keep)
    head, tail = keep - keep // 2, keep // 2
    marker = f"[… {len(ids) - keep} tokens cut …]"
    start = tokenizer.decode(ids[:head]).rstrip() if head else ""
    end = tokenizer.decode(ids[len(ids) - tail :]).lstrip() if tail else ""
    return " ".join(x for x in (start, marker, end) if x)


def fit_judged(
    tokenizer,
    render: Callable[[Sequence[str]], str],
    spans: Sequence[str],
    max_tokens: int,
    field: str = "max_prompt_tokens",
    strict: bool = True,
) -> tuple[str, bool]:
    """``render(spans)`` with the spans' middles cut until the prompt holds ``max_tokens``; returns it and whether cut.

    Only the judged spans are cut, never what ``render`` adds around them. ``field`` is the setting named in errors;
    ``strict=False`` warns and returns the prompt uncut when the template alone does not fit (for a budget shared with
    other prompts, whose encoder then cuts from the left).

    Raises:
        ValueError: when ``strict`` and the prompt with every span emptied is still longer than ``max_tokens``.
    """
    prompt = render(spans)
    if (n := count_tokens(tokenizer, prompt)) <= max_tokens:
        return prompt, False
    fixed = count_tokens(tokenizer, render([""] * len(spans)))
    if fixed > max_tokens:
        msg = (
            f"{field}={max_tokens} cannot hold the judge's instructions and problem ({fixed} tokens before any "
            f"judged text); raise {field} or shorten the problem"
        )
        if strict:
            raise ValueError(msg)
        # one message per setting (not per prompt), so Python's warning filter shows it once
        warnings.warn(
            f"{field}={max_tokens} cannot hold the judge's instructions; prompts are left whole", stacklevel=2
        )
        return prompt, False
    lengths = [count_tokens(tokenizer, s) for s in spans]
    budget = max(0, sum(lengths) - (n - max_tokens))
    for _ in range(32):  # quoting and the cut markers cost tokens too: shrink by the measured excess until it fits
        prompt = render([cut_middle(tokenizer, s, c) for s, c in zip(spans, share_budget(lengths, budget))])
        if (n := count_tokens(tokenizer, prompt)) <= max_tokens:
            return prompt, True
        if budget == 0:
            break
        budget = max(0, budget - (n - max_tokens))
    raise ValueError(
        f"{field}={max_tokens} cannot hold the judge's prompt even with the judged text cut to its markers "
        f"({n} tokens); raise {field}"
    )
