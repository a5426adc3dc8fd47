"""In-training evaluation counts each held-out item once, on one process and on two (the sampler's padding).

GRPO's ``val/accuracy`` and ``val/reward``, the pool's ``val/acc/<model>`` and deep-SMIDA's oracle counters in
``game_eval.json`` against hand values (``helpers.eval_items``): 5 items, item 0 repeated once.
"""

import math

import pytest
import torch
from helpers import eval_items

from alignment_games.modules.scorers.oracle import PreferenceOracle


class HandOracle(PreferenceOracle):
    """Row 0 valid, row 1 NaN, row 2 outside [0, 1]; every call late when ``late`` is set."""

    late = False

    def first_wins_probability(self, prompts, firsts, seconds, references):
        if self.late:
            import time

            time.sleep(0.5)
        return torch.tensor([0.7, float("nan"), 2.0], dtype=torch.float64)


def test_the_oracle_counts_what_it_left_out_per_row():
    """Three rows, two queries: per row 0, 2, 2 invalid verdicts; rows 1 and 2 unlabelled; sums = the counters."""
    oracle = HandOracle(num_queries=2, seed=0)
    labels = oracle.label(["x"] * 3, ["a"] * 3, ["b"] * 3)
    assert not math.isnan(labels[0]) and labels[1:].isnan().all()
    rows = {k: v.tolist() for k, v in oracle.last_rows.items()}
    assert rows == {"invalid_verdicts": [0, 2, 2], "timeouts": [0, 0, 0], "unlabelled_rows": [0, 1, 1]}
    assert (oracle.invalid_verdicts, oracle.timeouts, oracle.unlabelled_rows) == (4, 0, 2)
    late = HandOracle(num_queries=2, seed=0, timeout_s=0.05)
    late.late = True
    late.label(["x"] * 3, ["a"] * 3, ["b"] * 3)
    rows = {k: v.tolist() for k, v in late.last_rows.items()}
    assert rows == {"invalid_verdicts": [0, 0, 0], "timeouts": [2, 2, 2], "unlabelled_rows": [1, 1, 1]}
    assert (late.invalid_verdicts, late.timeouts, late.unlabelled_rows) == (0, 6, 3)


def _check(found):
    exact = eval_items.exact_figures()
    wrong = {k: (found.get(k), v) for k, v in exact.items() if found.get(k) != pytest.approx(v, abs=1e-6)}
    assert not wrong, f"found, expected: {wrong}"


def test_a_repeated_item_counts_once_on_one_process(tiny_lm_dir, tmp_path):
    """Item 0 validated twice (6 rows): the figures are the 5 items' (counted twice, GRPO's accuracy would be 3/6)."""
    torch.set_num_threads(1)
    _check(eval_items.figures(tmp_path, tiny_lm_dir, repeat_first=True, devices=1))


@pytest.mark.distributed
def test_two_ddp_processes_count_5_items_once(tiny_lm_dir):
    """5 items on 2 processes (the sampler pads to 6): both ranks log and write the 5 items' hand figures."""
    ranks = eval_items.ddp_figures(tiny_lm_dir)
    assert [r["world_size"] for r in ranks] == [2, 2]
    for found in ranks:
        _check(found)
