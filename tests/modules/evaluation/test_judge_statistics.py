import math

import pytest
import torch
from sklearn.metrics import matthews_corrcoef, roc_auc_score

from alignment_games.modules.evaluation.judge_score import JUDGE_STATISTICS, judge_report, judge_statistics

NAN = math.nan
# 6 answers x 4 votes: Alice, tie, Bob, unparsed (all NaN), 3-1 Alice, 1-3 Alice
VOTES = torch.tensor(
    [
        [1.0, 1.0, 1.0, 1.0],
        [1.0, 1.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 1.0],
        [NAN, NAN, NAN, NAN],
        [1.0, 1.0, 1.0, 0.0],
        [0.0, 0.0, 1.0, 0.0],
    ]
)
TRUTH = [True, True, False, True, False, False]


def test_every_statistic_against_sklearn_and_hand_counts():
    report = judge_report(VOTES, TRUTH, list(range(6)), n_boot=50)
    accept = [1, 0, 0, 0, 1, 0]  # a tie or no parsed vote does not accept
    assert report["mcc"] == pytest.approx(matthews_corrcoef(TRUTH, accept))
    decisive = [0, 2, 4, 5]  # the tracker's rule: the tie and the unparsed answer left out
    assert report["mcc_decisive"] == pytest.approx(
        matthews_corrcoef([TRUTH[i] for i in decisive], [accept[i] for i in decisive])
    )
    shares = [1.0, 0.5, 0.25, 0.5, 0.75, 0.25]  # Alice's share of the parsed votes, 0.5 when none parses
    assert report["auroc"] == pytest.approx(roc_auc_score(TRUTH, shares))
    assert (report["accept_rate"], report["tie_share"], report["unparsed_share"]) == (2 / 6, 1 / 6, 1 / 6)
    assert report["truth_rate"] == 0.5
    assert (report["n_answers"], report["n_problems"], report["num_votes"]) == (6, 6, 4)
    for key in JUDGE_STATISTICS:
        lo, hi = report["intervals"][key]
        assert lo <= report[key] + 1e-12 and report[key] - 1e-12 <= hi


def test_the_bootstrap_resamples_problems_not_answers():
    """Each answer twice under its own problem: the interval is the original's; as two problems, it narrows."""
    votes, truth = VOTES[torch.arange(6).repeat_interleave(2)], [t for t in TRUTH for _ in range(2)]
    alone = judge_report(VOTES, TRUTH, list(range(6)), n_boot=400, seed=3)
    clustered = judge_report(votes, truth, [i // 2 for i in range(12)], n_boot=400, seed=3)
    split = judge_report(votes, truth, list(range(12)), n_boot=400, seed=3)
    width = lambda r: r["intervals"]["auroc"][1] - r["intervals"]["auroc"][0]  # noqa: E731
    for key in JUDGE_STATISTICS:
        assert clustered["intervals"][key] == pytest.approx(alone["intervals"][key])
    assert clustered["n_problems"] == 6 and width(split) < width(clustered)


def test_the_tie_rule_in_one_line():
    stats = judge_statistics(torch.tensor([1.0, 0.5, 0.0]), ["alice", "tie", "bob"], torch.tensor([True, True, False]))
    assert stats["mcc"] == pytest.approx(0.5) and stats["mcc_decisive"] == 1.0


@pytest.mark.parametrize(
    ("votes", "truth", "problems"),
    [(VOTES, TRUTH[:5], list(range(6))), (VOTES, TRUTH, [0]), (VOTES[0], TRUTH[:1], [0]), (VOTES[:0], [], [])],
)
def test_mismatched_or_empty_input_is_refused(votes, truth, problems):
    with pytest.raises(ValueError, match="votes must be"):
        judge_report(votes, truth, problems)
