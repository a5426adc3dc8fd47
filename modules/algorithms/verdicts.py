"""Reading a debate judge's verdict from free text: a vote for Alice or Bob, a tie where allowed, or unparsed."""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

_ADJECTIVES = r"correct|right|incorrect|wrong|mistaken"
_FOR_ALICE = {"alice", "correct", "right", "yes"}
_JUDGED_RIGHT = {"correct", "right"}
# "Verdict: X", "Final verdict - X", "The winner is X" (markdown allowed around the marker)
_MARKER = re.compile(r"\b(?:verdict|winner)\b[*_]*(?:\s+is\b)?\s*[:：\-–—]?", re.IGNORECASE)
# the verdict's word, after optional markdown and a negation ("not correct", "not Alice")
_SUBJECT = re.compile(
    r"[*_\"'`(\[\s]*(not\s+)?(alice|bob|correct|incorrect|right|wrong|mistaken|yes|no|tie)\b[*_\"'`)\]]*", re.IGNORECASE
)
# what of a player is judged: "Alice's final answer", "Bob's critique" (the quote may be taken as markdown above)
_POSSESSIVE = re.compile(
    r"['’]?s\s+(?:final\s+)?(?:answer|solution|critique|rebuttal|argument|reasoning|claim|case)\b[*_\"'`)\]]*",
    re.IGNORECASE,
)
# a judgement of the named player: "is (not) wrong", "isn't right", "(wrong)", "is the winner", "wins", "does not win"
_PREDICATE = re.compile(
    r"\s*(?:(?:is|was|are|were)(?P<not_is>\s+not|n['’]t)?\s+(?:(?P<adj>"
    + _ADJECTIVES
    + r")|the\s+(?P<role>winner|loser))"
    r"|(?:does|did|do|should|would|will|must|could|shall)(?P<not_win>\s+not|n['’]t)?\s+win"
    r"|(?P<cannot>cannot|can\s+not|can['’]t|won['’]t)\s+win"
    r"|(?P<win>wins|won)|(?P<lose>loses|lost)"
    r"|[(:\-–—]?\s*(?P<not_bare>not\s+)?(?P<bare>" + _ADJECTIVES + r"))\b",
    re.IGNORECASE,
)
# a continuation that judges the player in words not read above ("is partially correct", "might win", "and Bob …")
_UNREAD = re.compile(
    r"\s*(?:\(|(?:is|was|are|were|does|did|do|should|would|will|must|could|shall|might|may|can|cannot|won['’]t|"
    r"seems?|appears?|has|have|had|not|and|or|nor|vs|versus)\b|&)",
    re.IGNORECASE,
)
# the end of a verdict's line: any line break, or the end
_LINE_END = re.compile(r"[\n\r\v\f\x1c-\x1e\x85\u2028\u2029]|$")
# a player named after the verdict's clause, with an optional negation ("not Bob")
_NAME = re.compile(r"(?<![\w'’])(?:not\s+)?(?:alice|bob)\b", re.IGNORECASE)
# a word taking a judgement back or against
_NEGATIVE = re.compile(
    r"(?:\b(?:not|never|nor|neither|wrong|incorrect|mistaken|false|invalid|flawed|loses?|lost|loser|fail(?:s|ed)?)\b"
    r"|n['’]t\b)",
    re.IGNORECASE,
)
# a refusal or a hedge anywhere in the output: no vote is read from it
_HEDGE = re.compile(
    r"\b(?:(?:cannot|can\s*not|can['’]t|unable\s+to|won['’]t|will\s+not|refuse\s+to|decline\s+to|not\s+able\s+to)"
    r"\s+(?:\w+\s+){0,3}?(?:give|reach|make|render|decide|determine|tell|judge|say|choose|pick|rule|verdict)"
    r"|no\s+(?:clear\s+)?(?:verdict|decision|winner)|undecided|undecidable|inconclusive|unsure|uncertain|unclear"
    r"|not\s+sure|hard\s+to\s+(?:say|tell)|impossible\s+to\s+(?:say|tell|decide|judge)"
    r"|maybe|perhaps|probably|possibly|(?:un)?likely)\b",
    re.IGNORECASE,
)


class _Clause(NamedTuple):
    """A verdict word's clause: its vote (``None``: not read), where it ends, whom it names, whether it was judged."""

    vote: float | None
    end: int
    subject: str
    judged: bool


def _clause(text: str, pos: int, ties: bool = False) -> _Clause | None:
    """The clause of the verdict word standing at ``pos`` (``None``: none there).

    ``subject`` is the player named, ``"alice"`` for a bare word (it judges Alice's answer), ``"tie"`` for a tie (vote
    0.5 if ``ties``, else none); ``judged`` is whether a judgement was read (a predicate after a name, a bare word).
    """
    m = _SUBJECT.match(text, pos)
    if m is None:
        return None
    negation, word = m.group(1), m.group(2).lower()
    vote = 0.5 if word == "tie" else float((word in _FOR_ALICE) != bool(negation))
    end = m.end()
    if word not in ("alice", "bob"):
        unread = re.match(r"\s*\w", text[end:]) or (word == "tie" and (negation or not ties))
        return _Clause(None if unread else vote, end, "tie" if word == "tie" else "alice", True)
    possessive = _POSSESSIVE.match(text, end)
    end = possessive.end() if possessive else end
    p = _PREDICATE.match(text, end)
    if p is None:
        return _Clause(None if _UNREAD.match(text, end) else float(vote), end, word, False)
    adjective = (p["adj"] or p["bare"] or "").lower()
    if adjective:
        right = (adjective in _JUDGED_RIGHT) != bool(p["not_is"] or p["not_bare"])
    elif p["role"]:
        right = (p["role"].lower() == "winner") != bool(p["not_is"])
    else:
        right = bool(p["win"]) or not (p["lose"] or p["cannot"] or p["not_win"])
    return _Clause(float(vote == right), p.end(), word, True)


def _rest_agrees(text: str, clause: _Clause) -> bool:
    """Whether the rest of the verdict's line leaves its vote standing (:func:`parse_verdict`).

    Text there not introduced by a player's name is about the verdict's player and may hold no :data:`_NEGATIVE` word;
    a player named there must agree with the vote where a judgement of them is read or the name stands alone.
    """
    stop = _LINE_END.search(text, clause.end).start()
    names = list(_NAME.finditer(text, clause.end, stop))
    if _NEGATIVE.search(text[clause.end : names[0].start() if names else stop]):
        return False  # "Alice, who is wrong", "Alice, but she is not right": read as about the verdict's player
    for i, name in enumerate(names):
        segment_end = names[i + 1].start() if i + 1 < len(names) else stop
        mention = _clause(text[:segment_end], name.start())
        bare = mention.judged or not re.search(r"\w", text[mention.end : segment_end])
        if bare and mention.vote is not None:
            if mention.vote != clause.vote:
                return False  # "Alice, or Bob", "Alice, unless Bob is right", "Alice, Alice is wrong"
        elif mention.subject == clause.subject and _NEGATIVE.search(text[name.end() : segment_end]):
            # the verdict's player judged against in words not read: "Alice, though Alice is not fully right"
            return False
    return True


def parse_verdict(text: str | None, ties: bool = False) -> float | None:
    """A judge's vote read from its visible output: 1.0 for Alice, 0.0 for Bob, 0.5 for a tie (``ties``), else ``None``.

    The last ``Verdict: X`` (or ``Winner: X``) counts, X one of Alice/Bob, correct/incorrect/mistaken, right/wrong,
    yes/no, tie (read only when ``ties``), any case, optional markdown around it; without one, an output that *starts*
    with such a word counts. A negative judgement of a named player inverts the vote (``Alice is wrong``, ``Bob's
    critique is wrong``), a negated negative is positive; hedges and refusals anywhere (``probably Alice``), a player
    judged in other words (``Alice is partially correct``, ``Alice and Bob``) and a bare word that does not stand alone
    (``no verdict``) are not read. The rest of the verdict's line must not take the vote back (:func:`_rest_agrees`):
    ``Verdict: Alice, because Bob is wrong`` counts, ``Verdict: Alice, who is wrong`` and ``Verdict: Alice, or Bob`` are
    unparsed. An ambiguous pronoun thus costs a vote (unparsed), never flips one.
    """
    if not text or _HEDGE.search(text):
        return None
    # the last marker with a verdict word after it, else the output's start
    starts = [m.end() for m in reversed(list(_MARKER.finditer(text)))] + [0]
    clause = next((c for c in (_clause(text, i, ties) for i in starts) if c is not None), None)
    return clause.vote if clause is not None and clause.vote is not None and _rest_agrees(text, clause) else None


def vote_share(votes: Sequence[float | None]) -> tuple[float, int]:
    """Alice's share of the parseable votes (0.5 when none parses) and the number of unparseable ones (``None``/NaN)."""
    valid = [float(v) for v in votes if v is not None and not math.isnan(float(v))]
    bad = len(votes) - len(valid)
    return (sum(valid) / len(valid) if valid else 0.5), bad


def verdict_of(votes: Sequence[float | None]) -> str:
    """One transcript's verdict for MCC: majority of parseable votes, or ``"tie"``/``"unparsed"`` (counted apart)."""
    valid = [float(v) for v in votes if v is not None and not math.isnan(float(v))]
    if not valid:
        return "unparsed"
    twice = 2 * sum(valid)
    return "alice" if twice > len(valid) else "bob" if twice < len(valid) else "tie"


@dataclass
class JudgeVotes:
    """A judge's ``votes`` ``[N, num_votes]`` (1 Alice, 0 Bob, 0.5 tie, NaN unparsed), ``texts``, late and invalid."""

    votes: Tensor
    texts: list[list[str]]
    timed_out: int = 0
    invalid: int = 0

    @property
    def shares(self) -> list[float]:
        """Alice's share of the parseable votes per transcript (0.5 when none parses)."""
        return [vote_share(row.tolist())[0] for row in self.votes]

    @property
    def verdicts(self) -> list[str]:
        """The verdict of each transcript under the tie rule of :func:`verdict_of`."""
        return [verdict_of(row.tolist()) for row in self.votes]

    @property
    def unparseable(self) -> int:
        """Votes that could not be parsed, over the batch."""
        return int(torch.isnan(self.votes).sum())


# How the judge's votes reach the reward: "verdict" rules on one transcript (is Alice's final answer correct?);
# "pairwise" is "pairwise-preference judging": the judge picks the better of two rollouts, "the chosen one gets 1" (zh).
JUDGINGS = ("verdict", "pairwise")


def pair_indices(num_problems: int, group_size: int, rng: random.Random | None = None) -> list[tuple[int, int]]:
    """The rollout pairs the pairwise judge compares: branches ``(2k, 2k+1)`` of each group (a random pairing).

    With ``rng`` a fair coin orders each pair, so that a judge's bias for the answer shown first averages out.

    Raises:
        ValueError: for an odd ``group_size`` (a rollout would have no partner).
    """
    if group_size < 2 or group_size % 2:
        raise ValueError(f"judging: pairwise pairs the branches of a group: group_size must be even, got {group_size}")
    pairs = [(i * group_size + k, i * group_size + k + 1) for i in range(num_problems) for k in range(0, group_size, 2)]
    return pairs if rng is None else [(b, a) if rng.random() < 0.5 else (a, b) for a, b in pairs]


def pair_shares(first_shares: Sequence[float], pairs: Sequence[tuple[int, int]]) -> list[float]:
    """Each rollout's share of its pair's votes: ``P̂(y ≻ y')`` for the first, ``1 − P̂`` for the other (App. E)."""
    if len(first_shares) != len(pairs):
        raise ValueError(f"{len(first_shares)} pairwise shares for {len(pairs)} pairs")
    out = [math.nan] * (2 * len(pairs))
    for (a, b), share in zip(pairs, first_shares):
        out[a], out[b] = float(share), 1.0 - float(share)
    return out
