"""Offline arithmetic word problems, pure functions of the seed, with worked and corrupted solutions."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

CORRUPTIONS = ("correct", "padded", "wrong_step", "wrong_final", "truncated")

_NAMES = (
    "Ava Ben Chloe Dan Emma Finn Grace Hugo Iris Jack Kara Leo Maya Noah Olive Paul Quinn Rosa Sam Tara Uma Victor "
    "Wendy Xavier Yara Zane"
).split()
_ITEMS = (
    "apples,marbles,stickers,books,coins,pencils,cookies,shells,cards,stamps,beads,toy cars,oranges,balloons,crayons,"
    "buttons"
).split(",")
_ADD = ["buys {n} more", "finds {n} more", "receives {n} more as a gift", "wins {n} more", "collects {n} more"]
_SUB = ["gives away {n}", "loses {n}", "sells {n}", "donates {n}", "uses up {n}"]
_MUL = {2: "doubles the collection", 3: "triples the collection"}
_FILLER = [
    "Let me think about this carefully before answering.",
    "It is important to keep track of every change in order.",
    "Word problems like this one are common in school.",
    "We should read the question again to be sure.",
    "Careful bookkeeping avoids mistakes here.",
    "Each sentence of the question describes one change.",
]


@dataclass
class ArithmeticProblem:
    """A generated word problem: ``start`` changed by ``ops`` (``(op, operand)``, op in ``+ - *``) gives ``answer``."""

    question: str
    answer: int
    start: int
    ops: list[tuple[str, int]] = field(default_factory=list)
    name: str = ""
    item: str = ""
    uid: int = 0

    def values(self) -> list[int]:
        """The running totals after each operation (the last one is the answer)."""
        return list(itertools.accumulate(self.ops, lambda v, op: _apply(v, *op), initial=self.start))[1:]


def _apply(v: int, op: str, n: int) -> int:
    return v + n if op == "+" else v - n if op == "-" else v * n


def generate_problems(n: int, seed: int = 0, min_steps: int = 2, max_steps: int = 4) -> list[ArithmeticProblem]:
    """Generate ``n`` problems deterministically from ``seed``; all running totals stay non-negative.

    Raises:
        ValueError: for ``n < 0`` or an empty/invalid step range.
    """
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    if not 1 <= min_steps <= max_steps:
        raise ValueError(f"need 1 <= min_steps <= max_steps, got {min_steps}, {max_steps}")
    rng = random.Random(seed)
    problems = []
    for uid in range(n):
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        start = rng.randint(5, 60)
        v, ops, phrases = start, [], []
        for _ in range(rng.randint(min_steps, max_steps)):
            kind = rng.random()
            if kind < 0.15 and v <= 60:
                k = rng.choice([2, 3])
                ops.append(("*", k))
                phrases.append(_MUL[k])
            elif kind < 0.55 or v < 4:
                k = rng.randint(2, 40)
                ops.append(("+", k))
                phrases.append(rng.choice(_ADD).format(n=k))
            else:
                k = rng.randint(1, v - 1)
                ops.append(("-", k))
                phrases.append(rng.choice(_SUB).format(n=k))
            v = _apply(v, *ops[-1])
        connectors = ["Then", "After that", "Next", "Later"]
        body = " ".join(f"{connectors[i % 4]}, {name} {p}." for i, p in enumerate(phrases))
        question = f"{name} has {start} {item}. {body} How many {item} does {name} have now?"
        problems.append(ArithmeticProblem(question, v, start, ops, name, item, uid))
    return problems


_VERBS = {"+": "adding", "-": "taking away", "*": "multiplying by"}


def make_response(problem: ArithmeticProblem, kind: str, rng: random.Random) -> str:
    """Write a solution of the given corruption ``kind``.

    ``padded`` adds filler sentences; ``wrong_step`` puts a small error in one equation that later steps carry;
    ``wrong_final`` boxes a wrong answer after right steps; ``truncated`` stops before the answer.

    Raises:
        ValueError: for an unknown kind.
    """
    if kind not in CORRUPTIONS:
        raise ValueError(f"unknown corruption kind {kind!r}; expected one of {CORRUPTIONS}")
    p = problem
    sentences = [f"{p.name} starts with {p.start} {p.item}."]
    v = p.start
    bad = rng.randrange(len(p.ops)) if kind == "wrong_step" else -1
    for i, (op, n) in enumerate(p.ops):
        result = _apply(v, op, n)
        if i == bad:
            result = max(0, result + rng.choice([-3, -2, -1, 1, 2, 3]))
            if result == _apply(v, op, n):
                result += 1
        sentences.append(f"After {_VERBS[op]} {n}, {p.name} has {v} {op} {n} = {result} {p.item}.")
        v = result
    final = v
    if kind == "wrong_final":
        final = v + rng.choice([-4, -3, -2, -1, 1, 2, 3, 4])
        final = final if final >= 0 else v + 1
    if kind == "truncated":
        keep = rng.randint(1, len(sentences) - 1)
        return " ".join(sentences[:keep])
    if kind == "padded":
        for _ in range(rng.randint(2, 3)):
            sentences.insert(rng.randint(1, len(sentences)), rng.choice(_FILLER))
    sentences.append(f"The answer is \\boxed{{{final}}}.")
    return " ".join(sentences)


def make_think_response(problem: ArithmeticProblem, width: int = 0, reverse: bool = False) -> str:
    r"""The correct solution as one equation per operation inside ``<think>…</think>``, then the boxed answer.

    Each line copies the running total and the operand, so a small model only has to compute the result. ``width``
    zero-pads the equations' numbers so digits of equal place sit at fixed distances; ``reverse`` then writes them
    least-significant digit first, so a carry comes before the digit it lands on (Lee et al. 2023, "Teaching
    Arithmetic to Small Transformers"): ``038 + 013 = 051`` becomes ``830 + 310 = 150``. The boxed answer stays plain.

    Raises:
        ValueError: for a negative ``width``, or ``reverse`` without a ``width``.
    """
    if width < 0:
        raise ValueError(f"width must be non-negative, got {width}")
    if reverse and width < 1:
        raise ValueError("reverse needs a width of at least 1 (zero-padded numbers)")

    def num(x: int) -> str:
        s = f"{x:0{width}d}"
        return s[::-1] if reverse else s

    totals = [problem.start, *problem.values()]
    lines = (f"{num(a)} {op} {num(n)} = {num(b)}" for a, (op, n), b in zip(totals, problem.ops, totals[1:]))
    return "<think>" + "\n".join(lines) + "</think>\nThe answer is \\boxed{" + str(totals[-1]) + "}."
