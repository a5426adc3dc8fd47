"""Pure functions of the multi-LLM pool game (§2.2–2.4, App. C, G): matching, judging, aggregation, pairs."""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from alignment_games.modules.algorithms.answers import answers_match, extract_final_answer
from alignment_games.modules.algorithms.checks import require_in_range, require_positive
from alignment_games.modules.algorithms.exp3 import linear_schedule

DEFAULT_SCORE = 5.0
SCORE_RANGE = (1.0, 10.0)
# App. G: the judge sees the question and one response and answers a 1-10 score as JSON. The closing line (ours)
# marks where the response ends, which the judges quote line by line (modules/scorers/quoting.py).
DEFAULT_JUDGE_TEMPLATE = (
    "Please act as an impartial judge and evaluate the quality of the response provided by an AI assistant to the "
    "question below. Consider correctness, helpfulness and clarity. Rate the response on a scale of 1 to 10 and "
    'answer only with a JSON object of the form {"score": <integer from 1 to 10>}.\n\n'
    "[Question]\n{prompt}\n\n[Response]\n{response}\n\n[End of Response]"
)


def normalized_reputations(ratings: Sequence[float]) -> list[float]:
    """Min–max normalised ratings in [0, 1]; all zeros when every rating is equal.

    Raises:
        ValueError: for an empty or non-finite list.
    """
    r = [float(x) for x in ratings]
    if not r or not all(math.isfinite(x) for x in r):
        raise ValueError(f"ratings must be a non-empty list of finite numbers, got {r}")
    lo, hi = min(r), max(r)
    return [0.0] * len(r) if hi == lo else [(x - lo) / (hi - lo) for x in r]


@dataclass(frozen=True)
class Matchmaking:
    r"""Reputation-based soft matching (§2.2): who meets whom, with the target gap annealed over training.

    A match draws ``min(num_candidates, m − 1)`` candidates and picks one by a Gaussian kernel
    :math:`\exp(-(|\hat R_a - \hat R_j| - g)^2 / (2 h^2))` on min–max normalised reputations around the target gap ``g``
    (``h`` is our choice: the paper says "soft matching"), or picks uniformly with probability ``uniform_share``.

    Attributes:
        num_candidates: Candidates drawn per match (the paper's 3).
        uniform_share: Probability of a uniform opponent instead of the soft match (the paper's 0.2).
        bandwidth: Width ``h`` of the Gaussian kernel on normalised reputations.
        gap_start: Target normalised reputation gap at the start of training.
        gap_end: Target gap at the end.

    Raises:
        ValueError: for a non-positive ``num_candidates`` or ``bandwidth``, or ``uniform_share`` outside [0, 1].
    """

    num_candidates: int = 3
    uniform_share: float = 0.2
    bandwidth: float = 0.25
    gap_start: float = 1.0
    gap_end: float = 0.0

    def __post_init__(self) -> None:
        require_positive(num_candidates=self.num_candidates)
        require_in_range("uniform_share", self.uniform_share, 0, 1)
        require_positive(bandwidth=self.bandwidth)

    def target_gap(self, progress: float) -> float:
        """The target gap at training ``progress`` in [0, 1], linear from ``gap_start`` to ``gap_end``."""
        return linear_schedule(self.gap_start, self.gap_end, progress)

    def affinities(self, ratings: Sequence[float], player: int, target_gap: float) -> list[float]:
        """Affinity of ``player`` for every member (0 for itself): a Gaussian kernel of the gap around the target."""
        norm = normalized_reputations(ratings)
        if not 0 <= player < len(norm):
            raise ValueError(f"player index {player} outside a pool of {len(norm)}")
        h = self.bandwidth
        return [
            0.0 if j == player else math.exp(-((abs(norm[player] - x) - target_gap) ** 2) / (2.0 * h**2))
            for j, x in enumerate(norm)
        ]

    def _candidates(self, m: int) -> int:
        if m < 2:
            raise ValueError(f"opponent matching needs at least two pool members, got {m}")
        return min(self.num_candidates, m - 1)

    def distribution(self, ratings: Sequence[float], player: int, target_gap: float) -> list[float]:
        """Exact probability of each opponent of ``player`` under :meth:`sample` (Fig. 4), over all candidate sets."""
        m, u = len(ratings), self.uniform_share
        c = self._candidates(m)
        aff = self.affinities(ratings, player, target_gap)
        others = [j for j in range(m) if j != player]
        sets = list(itertools.combinations(others, c))
        out = [0.0 if j == player else u / (m - 1) for j in range(m)]
        for s in sets:
            total = sum(aff[k] for k in s)
            for k in s:
                # every affinity is exp(-finite²) > 0 unless it underflows; then the set is uniform
                share = aff[k] / total if total > 0 else 1.0 / len(s)
                out[k] += (1.0 - u) * share / len(sets)
        return out

    def sample(self, ratings: Sequence[float], player: int, target_gap: float, generator: torch.Generator) -> int:
        """Draw an opponent for ``player``: uniform with probability ``uniform_share``, else the soft match."""
        m = len(ratings)
        c = self._candidates(m)
        others = torch.tensor([j for j in range(m) if j != player])
        if float(torch.rand((), generator=generator, dtype=torch.float64)) < self.uniform_share:
            return int(others[torch.randint(len(others), (), generator=generator)])
        cand = others[torch.randperm(len(others), generator=generator)[:c]]
        aff = self.affinities(ratings, player, target_gap)
        w = torch.tensor([aff[int(k)] for k in cand], dtype=torch.float64)
        w = w if float(w.sum()) > 0 else torch.ones_like(w)
        return int(cand[torch.multinomial(w, 1, generator=generator)])

    def selection_weights(self, ratings: Sequence[float], target_gap: float) -> list[float]:
        """How often each member is picked as an opponent of a uniform combatant (sums to 1; uniform: ``1/m``)."""
        m = len(ratings)
        rows = [self.distribution(ratings, a, target_gap) for a in range(m)]
        return [sum(row[j] for row in rows) / m for j in range(m)]

    def duels(
        self, ratings: Sequence[float], num_duels: int, target_gap: float, generator: torch.Generator
    ) -> list[tuple[int, int]]:
        """``num_duels`` pairs ``(a, b)``: a uniform combatant and its :meth:`sample`; a pool of one plays itself."""
        m = len(ratings)
        if m == 1:
            return [(0, 0)] * num_duels
        combatants = (int(torch.randint(m, (), generator=generator)) for _ in range(num_duels))  # lazily: a, sample
        return [(a, self.sample(ratings, a, target_gap, generator)) for a in combatants]


def duel_judges(duels: Sequence[tuple[int, int]], m: int) -> list[list[int]]:
    """Each duel's judges: every pool member outside it (the one model itself in a pool of one)."""
    return [[j for j in range(m) if j not in duel] if m > 1 else [0] for duel in duels]


def fill_judge_template(template: str, prompt: str, response: str) -> str:
    """``template`` with ``{prompt}`` and ``{response}`` filled in one pass, so text in the prompt is never a field."""
    return re.sub(r"\{(prompt|response)\}", lambda m: {"prompt": prompt, "response": response}[m.group(1)], template)


@dataclass(frozen=True)
class JudgeParse:
    """A parsed judgement: ``score`` in [1, 10] (``DEFAULT_SCORE`` on failure), ``method`` json/regex/failed."""

    score: float
    method: str

    @property
    def ok(self) -> bool:
        """Whether a score was read from the text."""
        return self.method != "failed"


_JSON_OBJECT = re.compile(r"\{[^{}]*\}")
_KEYED = re.compile(r"(?i)\b(?:score|rating)\b\W{0,4}?(?:is\s+)?(-?\d+(?:\.\d+)?)(?![\d.]*[eE][+-]?\d)")
_OUT_OF_TEN = re.compile(r"(?<![\d.])(-?\d+(?:\.\d+)?)\s*(?:/|out\s+of)\s*10(?!\d|\.\d)", re.IGNORECASE)


def _in_range(x: float) -> bool:
    return math.isfinite(x) and SCORE_RANGE[0] <= x <= SCORE_RANGE[1]


def _json_score(text: str) -> float | None:
    # a flat ``{...}`` that parses is always a JSON object (a dict)
    for match in _JSON_OBJECT.finditer(text):
        try:
            obj = json.loads(match.group(0))
        except ValueError:
            continue
        for key, value in obj.items():
            if str(key).lower() not in ("score", "rating") or isinstance(value, bool):  # True is an int, not a score
                continue
            try:
                x = float(value)
            except (TypeError, ValueError):
                continue
            if _in_range(x):
                return x
    return None


def parse_judgement(text: str | None) -> JudgeParse:
    """Read a 1–10 score from a judge's answer: JSON first, then a regex, else 5.0 flagged ``"failed"``.

    JSON: the first flat ``{...}`` with a numeric ``score``/``rating`` in [1, 10]. Regex: ``score``/``rating`` followed
    by a number (``Score: 7``, ``rating is 8.5``), else ``n/10`` or ``n out of 10``. Out-of-range numbers are no score.
    """
    if not text:
        return JudgeParse(DEFAULT_SCORE, "failed")
    x = _json_score(text)
    if x is not None:
        return JudgeParse(x, "json")
    for pattern in (_KEYED, _OUT_OF_TEN):
        for match in pattern.finditer(text):
            x = float(match.group(1))
            if _in_range(x):
                return JudgeParse(x, "regex")
    return JudgeParse(DEFAULT_SCORE, "failed")


REPUTATION_RULES = ("raw", "elo_odds")


@dataclass(frozen=True)
class ReputationWeighting:
    r"""How the judges' reputations (Elo ratings) become the weights of their scores (§2.3, App. G).

    ``"raw"``: the paper's literal rule, the rating floored at 0 (near 1000, nearly the plain mean). ``"elo_odds"``:
    :math:`w_j \propto 10^{(R_j - \bar R)/s}`, Elo's odds (``s`` points higher weighs 10 times as much), summing to 1.

    Attributes:
        rule: ``"raw"`` or ``"elo_odds"``.
        scale: ``s`` of ``"elo_odds"``, rating points per factor of 10 (unused by ``"raw"``).

    Raises:
        ValueError: for an unknown rule or a non-positive scale.
    """

    rule: str = "raw"
    scale: float = 400.0

    def __post_init__(self) -> None:
        if self.rule not in REPUTATION_RULES:
            raise ValueError(f"reputation.rule must be one of {REPUTATION_RULES}, got {self.rule!r}")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"reputation.scale must be a positive number, got {self.scale}")

    def weights(self, ratings: Sequence[float]) -> list[float]:
        """The judges' weights from their current ratings.

        Raises:
            ValueError: for no rating or a non-finite one.
        """
        r = [float(x) for x in ratings]
        if not r or not all(math.isfinite(x) for x in r):
            raise ValueError(f"judge ratings must be a non-empty list of finite numbers, got {r}")
        if self.rule == "raw":
            return [max(0.0, x) for x in r]
        # a softmax: subtracting the largest rating keeps every power at most 1 (no overflow)
        top = max(r)
        odds = [10.0 ** ((x - top) / self.scale) for x in r]
        total = sum(odds)
        return [x / total for x in odds]


def reputation_weighted_mean(scores: Sequence[float], weights: Sequence[float]) -> float:
    """``Σ w_j s_j / Σ w_j``, clamped to the scores' range against rounding; equal weights when all are 0.

    Raises:
        ValueError: for no scores, mismatched lengths, a non-finite score or a negative or non-finite weight.
    """
    s, w = [float(x) for x in scores], [float(x) for x in weights]
    if not s:
        raise ValueError("reputation_weighted_mean needs at least one judge score")
    if len(s) != len(w):
        raise ValueError(f"{len(s)} scores but {len(w)} weights")
    if not all(math.isfinite(x) for x in s):
        raise ValueError(f"judge scores must be finite, got {s}")
    if not all(math.isfinite(x) and x >= 0 for x in w):
        raise ValueError(f"judge weights must be finite and non-negative, got {w}")
    total = sum(w)
    mean = sum(s) / len(s) if total == 0 else sum(x * y for x, y in zip(s, w)) / total
    return min(max(mean, min(s)), max(s))


def judge_verdicts(scores_a: Sequence[float], scores_b: Sequence[float]) -> list[float]:
    """Each judge's duel score for a: 1 if it scored a higher, ½ on a tie, 0 if lower."""
    if len(scores_a) != len(scores_b):
        raise ValueError(f"{len(scores_a)} scores for a but {len(scores_b)} for b")
    return [1.0 if x > y else 0.5 if x == y else 0.0 for x, y in zip(scores_a, scores_b)]


def aggregate_duel(
    table: Sequence[Sequence[Sequence[float]]], weights: Sequence[float]
) -> tuple[list[list[float]], list[float]]:
    """``table[s][r][k]`` (judge k, side s, response r) to weighted means ``[s][r]`` and judges' verdicts for a."""
    per_side = [[reputation_weighted_mean(row, weights) for row in side] for side in table]
    means = [[sum(row[k] for row in side) / len(side) for k in range(len(weights))] for side in table]
    return per_side, judge_verdicts(means[0], means[1])


def agreement_score(response_answer: str | None, judge_answers: Sequence[str | None]) -> tuple[float, bool]:
    """A solving judge's 1–10 score of a response: ``1 + 9 ×`` the share of its own answers the response agrees with.

    For task models that cannot follow a rating prompt but can solve the question: majority voting's self-consistency
    signal, without a reference. Returns ``(score, read)``: ``(5.0, False)`` when no solution of the judge has one.

    Raises:
        ValueError: when there are no judge answers.
    """
    if not judge_answers:
        raise ValueError("agreement_score needs at least one of the judge's answers")
    if all(a is None for a in judge_answers):
        return DEFAULT_SCORE, False
    if response_answer is None:
        return SCORE_RANGE[0], True
    agree = sum(1 for a in judge_answers if a is not None and answers_match(response_answer, a))
    low, high = SCORE_RANGE
    return low + (high - low) * agree / len(judge_answers), True


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_answer(text: str | None) -> str | None:
    """The final answer of a math response: the last ``\\boxed{}``, else the last number in the text, else ``None``."""
    boxed = extract_final_answer(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text or "")
    return numbers[-1].rstrip(",") if numbers else None


def reference_agreement(scores: Sequence[Sequence[float]], correct: Sequence[Sequence[bool]]) -> tuple[float, int]:
    """How well peer judging ranks right above wrong, where a reference exists (a diagnostic, never a reward).

    ``scores[d]``/``correct[d]``: duel d's responses (both sides, every rollout), their aggregate scores and whether
    each matches the reference. Returns the share of (right, wrong) pairs within a duel scored right > wrong, a tie
    counting ½ (per duel the AUC of the scores, pooled over duels by pairs), and the number of such pairs (0: nan).
    """
    total, n = 0.0, 0
    for s, c in zip(scores, correct, strict=True):
        for i, j in itertools.product(range(len(s)), repeat=2):
            if c[i] and not c[j]:
                total, n = total + (1.0 if s[i] > s[j] else 0.5 if s[i] == s[j] else 0.0), n + 1
    return (total / n if n else math.nan), n


def preference_pairs(scores_a: Sequence[float], scores_b: Sequence[float]) -> list[tuple[int, bool]]:
    """Non-tied duels as ``(duel index, a_is_chosen)``; ties give no DPO pair (§2.4)."""
    return [(i, v == 1.0) for i, v in enumerate(judge_verdicts(scores_a, scores_b)) if v != 0.5]


def peer_score_advantages(scores: Tensor, group_size: int, scale: bool = True, baseline: bool = True) -> Tensor:
    """GRPO advantages of rollouts ``[P·G]`` from their peer scores (§2.4): :func:`group_advantages` per prompt."""
    from alignment_games.modules.algorithms.rl_losses import group_advantages

    scores = torch.as_tensor(scores, dtype=torch.float32).flatten()
    if not torch.isfinite(scores).all():
        raise ValueError(f"peer scores must be finite, got {scores.tolist()}")
    return group_advantages(scores, group_size, scale=scale, baseline=baseline)


def category_weights(probs: Sequence[float], categories: Sequence[str | None]) -> dict[str, float]:
    """The leader's probability mass on each instruction category (first-seen order; ``"none"`` without one).

    Raises:
        ValueError: when ``probs`` and ``categories`` differ in length.
    """
    if len(probs) != len(categories):
        raise ValueError(f"{len(probs)} probabilities for {len(categories)} categories")
    out: dict[str, float] = {}
    for p, c in zip(probs, categories):
        key = "none" if c is None else str(c)
        out[key] = out.get(key, 0.0) + float(p)
    return out


def weight_extremes(probs: Sequence[float], n: int = 5) -> tuple[float, float]:
    """Mean probability of the ``n`` most and least likely instructions against uniform ``1/K`` (§5, Fig. 5).

    Raises:
        ValueError: for no probabilities or ``n`` < 1.
    """
    if not len(probs) or n < 1:
        raise ValueError(f"weight_extremes needs probabilities and n >= 1, got {len(probs)} and n={n}")
    k = len(probs)
    n = max(1, min(n, k // 2))
    ordered = sorted(float(p) for p in probs)
    return sum(ordered[-n:]) / n * k, sum(ordered[:n]) / n * k
