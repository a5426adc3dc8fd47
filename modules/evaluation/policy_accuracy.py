"""Greedy held-out accuracy and format compliance of a saved policy on generated arithmetic problems."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from alignment_games.modules.algorithms.answers import answers_match, extract_final_answer
from alignment_games.modules.algorithms.arithmetic import generate_problems
from alignment_games.modules.algorithms.checks import require_at_least
from alignment_games.modules.algorithms.debate import split_reply
from alignment_games.modules.evaluation.audit import describe_models, problem_rows
from alignment_games.modules.lm.text import render_chat

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95% with the default ``z``); stays inside [0, 1].

    Example:
        >>> [round(x, 4) for x in wilson_interval(5, 10)]
        [0.2366, 0.7634]

    Raises:
        ValueError: for ``n`` below 1 or ``successes`` outside [0, n].
    """
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n >= 1, got successes={successes}, n={n}")
    p, z2 = successes / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def reply_in_format(text: str) -> bool:
    r"""Whether ``text`` is ``<think>…</think>`` (one of each, nothing before) and then a visible ``\boxed{}``.

    Example:
        >>> reply_in_format("<think>2 + 3 = 5</think>\nThe answer is \\boxed{5}."), reply_in_format("\\boxed{5}")
        (True, False)
    """
    reply = split_reply(text, required=True)
    return reply.format_ok and extract_final_answer(reply.visible) is not None


def score_replies(replies: Sequence[str], references: Sequence[str]) -> dict[str, Any]:
    """``{"n", "correct", "in_format", "accuracy", "accuracy_ci95" (Wilson), "format_rate"}`` of the replies.

    Raises:
        ValueError: for no replies, or a different number of replies and references.
    """
    if len(replies) != len(references):
        raise ValueError(f"{len(replies)} replies but {len(references)} references")
    if not replies:
        raise ValueError("no replies to score")
    correct = sum(answers_match(extract_final_answer(r), ref) for r, ref in zip(replies, references))
    in_format, n = sum(reply_in_format(r) for r in replies), len(replies)
    rates = {"accuracy": correct / n, "accuracy_ci95": list(wilson_interval(correct, n)), "format_rate": in_format / n}
    return {"n": n, "correct": correct, "in_format": in_format} | rates


@torch.no_grad()
def greedy_replies(
    model: Any, tokenizer: Any, prompts: Sequence[str], system_prompt: str, max_new_tokens: int, batch_size: int
) -> list[str]:
    """Greedy replies of ``model`` to each prompt (one user message after ``system_prompt``), left-padded batches."""
    tokenizer.padding_side = "left"
    model.eval()
    out = []
    for i in range(0, len(prompts), batch_size):
        texts = [
            render_chat(tokenizer, [{"role": "system", "content": system_prompt}, {"role": "user", "content": x}], True)
            for x in prompts[i : i + batch_size]
        ]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
        ids = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, **special)
        out += tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return out


def policy_accuracy(
    model_path: str,
    num_problems: int = 200,
    seed: int = 1_000_003,
    min_steps: int = 2,
    max_steps: int = 4,
    system_prompt: str = "You are a helpful assistant.",
    max_new_tokens: int = 96,
    batch_size: int = 32,
) -> dict[str, Any]:
    """:func:`score_replies` of the policy in ``model_path`` on generated problems, overall and ``by_operations``.

    Also the settings, ``model_record``, five ``examples`` and the per-problem ``problems`` rows.

    Raises:
        ValueError: for ``num_problems``, ``max_new_tokens`` or ``batch_size`` below 1, or a bad step range.
    """
    from alignment_games.modules.lm.models import load_model, load_tokenizer

    require_at_least(num_problems=(num_problems, 1), max_new_tokens=(max_new_tokens, 1), batch_size=(batch_size, 1))
    record = describe_models([model_path], None, "--model")[0]
    problems = generate_problems(num_problems, seed, min_steps, max_steps)
    model, tokenizer = load_model(model_path, task="causal_lm"), load_tokenizer(model_path)
    prompts, refs = [p.question for p in problems], [str(p.answer) for p in problems]
    replies = greedy_replies(model, tokenizer, prompts, system_prompt, max_new_tokens, batch_size)
    settings = {"model": model_path, "seed": seed, "min_steps": min_steps, "max_steps": max_steps}
    examples = [{"prompt": x, "reference": r, "reply": y} for x, r, y in list(zip(prompts, refs, replies))[:5]]
    by_operations = {}
    for k in sorted({len(p.ops) for p in problems}):
        chosen = [i for i, p in enumerate(problems) if len(p.ops) == k]
        by_operations[str(k)] = score_replies([replies[i] for i in chosen], [refs[i] for i in chosen])
    correct = [answers_match(extract_final_answer(y), r) for y, r in zip(replies, refs)]
    rows = problem_rows(prompts, refs, {"model": correct})
    report = {**score_replies(replies, refs), "by_operations": by_operations, **settings, "model_record": record}
    return {**report, "examples": examples, "problems": rows}
