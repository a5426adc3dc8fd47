"""How well a judge tells right answers from wrong ones, with problem-bootstrap intervals, before a game relies on it.

The debate paper scores the judge as a binary classifier of "Alice's final answer is correct" (MCC over its
verdicts). With an even number of votes a verdict can tie, and a reply may not parse. ``mcc`` counts a tie or an
unparsed verdict as not accepting (a judge must affirm an answer to pass it), so every answer counts and a judge
cannot look better by abstaining; ``mcc_decisive`` is the training tracker's rule (ties and unparsed left out), kept
to compare with the runs' logs. ``auroc`` ranks answers by Alice's vote share (ties need no rule there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from alignment_games.callbacks.functional.mcc import matthews_corrcoef_from_counts
from alignment_games.modules.algorithms.verdicts import verdict_of, vote_share
from alignment_games.modules.evaluation.intervals import percentile_interval
from alignment_games.modules.evaluation.preference_report import error_auroc

JUDGE_STATISTICS = ("mcc", "mcc_decisive", "auroc", "accept_rate", "tie_share", "unparsed_share", "truth_rate")


def judge_statistics(shares: Tensor, verdicts: Sequence[str], truth: Tensor) -> dict[str, float]:
    """The :data:`JUDGE_STATISTICS` of answers: Alice's vote ``shares``, :func:`.verdict_of` ``verdicts``, ``truth``.

    Example:
        >>> truth = torch.tensor([True, True, False])
        >>> s = judge_statistics(torch.tensor([1.0, 0.5, 0.0]), ["alice", "tie", "bob"], truth)
        >>> s["mcc"], s["mcc_decisive"], s["tie_share"]
        (0.5, 1.0, 0.3333333333333333)
    """
    accept = torch.tensor([v == "alice" for v in verdicts])
    decisive = torch.tensor([v in ("alice", "bob") for v in verdicts])

    def mcc(keep: Tensor) -> float:
        a, t = accept[keep], truth[keep]
        counts = [int((a & t).sum()), int((a & ~t).sum()), int((~a & ~t).sum()), int((~a & t).sum())]
        return matthews_corrcoef_from_counts(*counts)

    n = len(verdicts)
    return {
        "mcc": mcc(torch.ones(n, dtype=torch.bool)),
        "mcc_decisive": mcc(decisive),
        "auroc": error_auroc(shares.double(), truth),
        "accept_rate": int(accept.sum()) / n,
        "tie_share": sum(v == "tie" for v in verdicts) / n,
        "unparsed_share": sum(v == "unparsed" for v in verdicts) / n,
        "truth_rate": int(truth.sum()) / n,
    }


def judge_report(
    votes: Tensor,
    truth: Sequence[bool],
    problems: Sequence[int],
    n_boot: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """:func:`judge_statistics` of ``votes`` with percentile intervals from resampling whole problems.

    Answers to one problem share its difficulty, so the bootstrap draws problems with replacement and keeps all their
    answers (a cluster bootstrap): ``k`` answers a problem do not narrow the interval as ``k`` problems would.
    ``votes`` ``[answers, num_votes]``: 1 for Alice, 0 against, 0.5 a tie vote, NaN unparsed.

    Returns:
        ``{"n_answers", "n_problems", "num_votes", <statistic>: value, "intervals": {<statistic>: [lo, hi]},
        "interval_method"}``.

    Raises:
        ValueError: for an empty or mismatched input.
    """
    if votes.ndim != 2 or not len(votes) or len(truth) != len(votes) or len(problems) != len(votes):
        raise ValueError(
            f"votes must be [answers, num_votes] with one truth and one problem per answer, got votes "
            f"{tuple(votes.shape)}, {len(truth)} truth values, {len(problems)} problem ids"
        )
    rows = [row.tolist() for row in votes.float()]
    shares = torch.tensor([vote_share(r)[0] for r in rows])
    verdicts = [verdict_of(r) for r in rows]
    right = torch.as_tensor(list(truth), dtype=torch.bool)
    point = judge_statistics(shares, verdicts, right)
    ids = sorted(set(problems))
    members = [torch.tensor([i for i, p in enumerate(problems) if p == q]) for q in ids]
    gen = torch.Generator().manual_seed(seed)
    draws = []
    for _ in range(n_boot):
        pick = torch.cat([members[int(j)] for j in torch.randint(len(ids), (len(ids),), generator=gen)])
        stats = judge_statistics(shares[pick], [verdicts[int(i)] for i in pick], right[pick])
        draws.append([stats[k] for k in JUDGE_STATISTICS])
    bounds = percentile_interval(torch.tensor(draws, dtype=torch.float64).T, confidence)
    return {
        "n_answers": len(rows),
        "n_problems": len(ids),
        "num_votes": votes.shape[1],
        **point,
        "intervals": {k: bounds[j].tolist() for j, k in enumerate(JUDGE_STATISTICS)},
        "interval_method": f"percentile bootstrap over problems (all of a problem's answers together), {n_boot} draws",
    }
