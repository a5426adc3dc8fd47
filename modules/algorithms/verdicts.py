"""Reading a debate judge's verdict from free text: a vote for Alice or Bob, or unparsed (counted, never a share)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "JUDGINGS",
    "VERDICTS",
    "JudgeVotes",
    "pair_indices",
    "pair_shares",
    "parse_verdict",
    "verdict_of",
    "vote_share",
]

_ADJECTIVES = r"correct|right|incorrect|wrong|mistaken"
_FOR_ALICE = {"alice", "correct", "right", "yes"}
_JUDGED_RIGHT = {"correct", "right"}
# "Verdict: X", "Final verdict - X", "The winner is X" (markdown allowed around the marker)
_MARKER = re.compile(r"\b(?:verdict|winner)\b[*_]*(?:\s+is\b)?\s*[:：\-–—]?", re.IGNORECASE)
# the verdict's word, after optional markdown and a negation ("not correct", "not Alice")
_SUBJECT = re.compile(
    r"[*_\"'`(\[\s]*(not\s+)?(alice|bob|correct|incorrect|right|wrong|mistaken|yes|no)\b[*_\"'`)\]]*", re.IGNORECASE
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
# a refusal or a hedge anywhere in the output: no vote is read from it
_HEDGE = re.compile(
    r"\b(?:(?:cannot|can\s*not|can['’]t|unable\s+to|won['’]t|will\s+not|refuse\s+to|decline\s+to|not\s+able\s+to)"
    r"\s+(?:\w+\s+){0,3}?(?:give|reach|make|render|decide|determine|tell|judge|say|choose|pick|rule|verdict)"
    r"|no\s+(?:clear\s+)?(?:verdict|decision|winner)|undecided|undecidable|inconclusive|unsure|uncertain|unclear"
    r"|not\s+sure|hard\s+to\s+(?:say|tell)|impossible\s+to\s+(?:say|tell|decide|judge)"
    r"|maybe|perhaps|probably|possibly|(?:un)?likely)\b",
    re.IGNORECASE,
)


def _clause_vote(text: str, pos: int) -> tuple[bool, float | None]:
    """Whether a verdict word stands at ``pos``, and the vote its clause gives (``None``: not read)."""
    m = _SUBJECT.match(text, pos)
    if m is None:
        return False, None
    negation, word = m.group(1), m.group(2).lower()
    vote = (word in _FOR_ALICE) != bool(negation)
    end = m.end()
    if word not in ("alice", "bob"):
        return True, (None if re.match(r"\s*\w", text[end:]) else float(vote))
    possessive = _POSSESSIVE.match(text, end)
    end = possessive.end() if possessive else end
    p = _PREDICATE.match(text, end)
    if p is None:
        return True, (None if _UNREAD.match(text, end) else float(vote))
    adjective = (p["adj"] or p["bare"] or "").lower()
    if adjective:
        right = (adjective in _JUDGED_RIGHT) != bool(p["not_is"] or p["not_bare"])
    elif p["role"]:
        right = (p["role"].lower() == "winner") != bool(p["not_is"])
    else:
        right = bool(p["win"]) or not (p["lose"] or p["cannot"] or p["not_win"])
    return True, float(vote == right)


def parse_verdict(text: str | None) -> float | None:
    """A judge's vote read from its visible output: 1.0 for Alice (her answer is right), 0.0 for Bob, else ``None``.

    The last ``Verdict: X`` (or ``Winner: X``) counts, X one of Alice/Bob, correct/incorrect/mistaken, right/wrong,
    yes/no, any case, optional markdown around it; without one, an output that *starts* with such a word counts. A
    negative judgement of a named player inverts the vote (``Alice is wrong``, ``Bob's critique is wrong``), a negated
    negative is positive; hedges and refusals anywhere (``probably Alice``), a player judged in other words (``Alice is
    partially correct``, ``Alice and Bob``) and a bare word that does not stand alone (``no verdict``) are not read.
    """
    if not text or _HEDGE.search(text):
        return None
    for marker in reversed(list(_MARKER.finditer(text))):
        found, vote = _clause_vote(text, marker.end())
        if found:
            return vote
    return _clause_vote(text, 0)[1]


def vote_share(votes: Sequence[float | None]) -> tuple[float, int]:
    """Alice's share of the parseable votes (0.5 when none parses) and the number of unparseable ones (``None``/NaN)."""
    valid = [float(v) for v in votes if v is not None and not math.isnan(float(v))]
    bad = len(votes) - len(valid)
    return (sum(valid) / len(valid) if valid else 0.5), bad


VERDICTS = ("alice", "bob", "tie", "unparsed")


def verdict_of(votes: Sequence[float | None]) -> str:
    """One transcript's verdict for MCC: majority of parseable votes, or ``"tie"``/``"unparsed"`` (counted apart)."""
    valid = [float(v) for v in votes if v is not None and not math.isnan(float(v))]
    if not valid:
        return "unparsed"
    for_alice = sum(valid)
    if 2 * for_alice > len(valid):
        return "alice"
    return "bob" if 2 * for_alice < len(valid) else "tie"


@dataclass
class JudgeVotes:
    """A judge's ``votes`` ``[N, num_votes]`` (1 Alice, 0 Bob, NaN unparsed), raw ``texts``, late and invalid counts."""

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


def pair_indices(num_problems: int, group_size: int) -> list[tuple[int, int]]:
    """The rollout pairs the pairwise judge compares: branches ``(2k, 2k+1)`` of each group (a random pairing).

    Raises:
        ValueError: for an odd ``group_size`` (a rollout would have no partner).
    """
    if group_size < 2 or group_size % 2:
        raise ValueError(f"judging: pairwise pairs the branches of a group: group_size must be even, got {group_size}")
    return [(i * group_size + k, i * group_size + k + 1) for i in range(num_problems) for k in range(0, group_size, 2)]


def pair_shares(first_shares: Sequence[float], pairs: Sequence[tuple[int, int]]) -> list[float]:
    """Each rollout's share of its pair's votes: ``P̂(y ≻ y')`` for the first, ``1 − P̂`` for the other (App. E)."""
    if len(first_shares) != len(pairs):
        raise ValueError(f"{len(first_shares)} pairwise shares for {len(pairs)} pairs")
    out = [math.nan] * (2 * len(pairs))
    for (a, b), share in zip(pairs, first_shares):
        out[a], out[b] = float(share), 1.0 - float(share)
    return out
