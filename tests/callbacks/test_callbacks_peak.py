import csv
import math

import pytest
import torch
from helpers.callback_helpers import SeriesModule, ddp_results, make_trainer, run_docs_example, val_tables
from helpers.item_ddp import EPOCHS as ITEM_EPOCHS
from helpers.item_ddp import ITEMS, item_ddp_results
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger
from scipy import stats
from scipy.special import betaln

from alignment_games.callbacks import (
    PeakCheckpoint,
    beta_lower_bound,
    gap_recovery,
    p_best,
    pooled_lower_bound,
    posterior_mean,
)

# Evaluation 2 has the highest raw accuracy (10/10) but few trials; evaluation 4 has the highest pooled raw
# accuracy over the window of 3 (145/210); evaluation 5 has the highest lower bound (207/300 pooled).
SERIES = [(50, 100), (60, 100), (10, 10), (65, 100), (70, 100), (72, 100), (40, 100), (45, 100)]


def test_lower_bound_matches_scipy_and_closed_forms():
    for successes, trials, q in [(0, 0, 0.025), (3, 10, 0.025), (207, 300, 0.025), (7, 9, 0.1), (50, 50, 0.5)]:
        expected = stats.beta.ppf(q, 1 + successes, 1 + trials - successes)
        assert beta_lower_bound(successes, trials, q) == pytest.approx(expected, rel=1e-12)
        assert stats.beta.cdf(beta_lower_bound(successes, trials, q), 1 + successes, 1 + trials - successes) == (
            pytest.approx(q, rel=1e-9)
        )
    # Beta(1, 1 + n) and Beta(1 + n, 1) have closed-form quantiles.
    for n in (0, 1, 9, 100):
        assert beta_lower_bound(0, n) == pytest.approx(1 - 0.975 ** (1 / (n + 1)), rel=1e-10)
        assert beta_lower_bound(n, n) == pytest.approx(0.025 ** (1 / (n + 1)), rel=1e-10)
    assert beta_lower_bound(0, 0) == pytest.approx(0.025)  # the Beta(1, 1) prior alone is uniform
    assert posterior_mean(207, 300) == pytest.approx(208 / 302)


def test_pooled_lower_bound_pools_the_last_window():
    assert pooled_lower_bound(SERIES[:6], window=3) == beta_lower_bound(207, 300)
    assert pooled_lower_bound(SERIES[:2], window=3) == beta_lower_bound(110, 200)  # a short window pools what exists
    assert pooled_lower_bound(SERIES[:3], window=1) == beta_lower_bound(10, 10)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: beta_lower_bound(5, 4), "successes <= trials"),
        (lambda: beta_lower_bound(-1, 4), "successes <= trials"),
        (lambda: beta_lower_bound(1, 4, quantile=1.0), "quantile"),
        (lambda: pooled_lower_bound([], 3), "No evaluations"),
        (lambda: pooled_lower_bound([(1, 2)], 0), "window"),
        (lambda: p_best([]), "at least one group"),
        (lambda: p_best([(1, 2)], draws=0), "draws"),
        (lambda: gap_recovery((5, 10), (3, 10), (3, 10)), "no gap"),
    ],
)
def test_pure_functions_reject_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def prob_b_beats_a(a: tuple[int, int], b: tuple[int, int]) -> float:
    """Closed form of P(X_B > X_A) for independent Beta posteriors with an integer first parameter of B."""
    alpha_a, beta_a = 1 + a[0], 1 + a[1] - a[0]
    alpha_b, beta_b = 1 + b[0], 1 + b[1] - b[0]
    return sum(
        math.exp(
            betaln(alpha_a + i, beta_a + beta_b)
            - math.log(beta_b + i)
            - betaln(1 + i, beta_b)
            - betaln(alpha_a, beta_a)
        )
        for i in range(alpha_b)
    )


@pytest.mark.parametrize(("a", "b"), [((30, 50), (36, 50)), ((700, 1000), (712, 1000)), ((3, 10), (2, 4))])
def test_p_best_matches_the_two_group_closed_form(a, b):
    exact = prob_b_beats_a(a, b)
    draws = 100_000
    shares = p_best({"a": a, "b": b}, draws=draws, seed=123)
    tolerance = 5 * math.sqrt(exact * (1 - exact) / draws) + 1e-9  # five Monte Carlo standard errors
    assert shares["b"] == pytest.approx(exact, abs=tolerance)
    assert shares["a"] + shares["b"] == pytest.approx(1.0)


def test_p_best_is_reproducible_and_keeps_the_input_shape():
    groups = [(740, 1000), (726, 1000), (740, 1000)]
    first = p_best(groups, draws=20_000, seed=7)
    assert isinstance(first, list) and first == p_best(groups, draws=20_000, seed=7)
    assert sum(first) == pytest.approx(1.0)
    assert first[1] < min(first[0], first[2])  # the weaker group wins least often
    assert abs(first[0] - first[2]) < 0.03  # two identical groups share the rest evenly
    assert p_best({"only": (3, 4)}, draws=10) == {"only": 1.0}


def test_gap_recovery_on_posterior_means():
    assert gap_recovery(debate=(74, 98), baseline=(69, 98), upper_bound=(79, 98)) == pytest.approx(0.5)
    # The paper's Table 1 orders of magnitude: about 45% of the gap (means 0.7474, 0.7263, 0.7730).
    recovered = gap_recovery((7472, 9998), (7261, 9998), (7728, 9998))
    assert recovered == pytest.approx((0.7474 - 0.7263) / (0.7730 - 0.7263), abs=1e-3)
    assert 0.44 < recovered < 0.46
    assert gap_recovery((3, 10), (5, 10), (9, 10)) < 0  # worse than the baseline


class WeightSnapshots(Callback):
    def __init__(self):
        self.weights = []

    def on_validation_end(self, trainer, pl_module):
        self.weights.append({k: v.clone() for k, v in pl_module.state_dict().items()})


def test_keeps_the_evaluation_with_the_highest_lower_bound(tmp_path):
    peak = PeakCheckpoint("val/correct", "val/total", window=3, dirpath=tmp_path / "peak", verbose=True)
    snapshots = WeightSnapshots()
    logger = CSVLogger(tmp_path, name="csv")
    trainer = make_trainer(tmp_path, [peak, snapshots], max_epochs=len(SERIES), logger=logger)
    trainer.fit(SeriesModule(SERIES))

    # The three candidates really differ.
    raw_best = max(range(len(SERIES)), key=lambda i: SERIES[i][0] / SERIES[i][1])
    pooled = [SERIES[max(0, i - 2) : i + 1] for i in range(len(SERIES))]
    pooled_raw_best = max(range(len(SERIES)), key=lambda i: sum(s for s, _ in pooled[i]) / sum(n for _, n in pooled[i]))
    assert (raw_best, pooled_raw_best) == (2, 4)
    assert peak.peak["evaluation"] == 5
    # Every evaluation's lower bound is scipy's quantile of the pooled posterior.
    for i, record in enumerate(peak.evaluations):
        s, n = sum(c for c, _ in pooled[i]), sum(t for _, t in pooled[i])
        assert record["lower_bound"] == pytest.approx(stats.beta.ppf(0.025, 1 + s, 1 + n - s), rel=1e-12)
        assert (record["successes"], record["trials"]) == SERIES[i]
    assert peak.peak["value"] == max(r["lower_bound"] for r in peak.evaluations)
    assert peak.peak["step"] == 6 * 2 and peak.peak["epoch"] == 5  # two training batches per epoch
    assert peak.peak["accuracy"] == pytest.approx(208 / 302)
    # The file on disk is that evaluation's checkpoint, and knows it is the peak.
    assert peak.best_model_path == str(tmp_path / "peak" / "peak.ckpt")
    ckpt = torch.load(peak.best_model_path, weights_only=False)
    assert ckpt["global_step"] == 12 and ckpt["epoch"] == 5
    for key, value in snapshots.weights[5].items():
        assert torch.equal(ckpt["state_dict"][key], value)
    assert not torch.equal(snapshots.weights[5]["layer.weight"], snapshots.weights[7]["layer.weight"])
    assert ckpt["callbacks"][peak.state_key]["peak"]["evaluation"] == 5
    # Logged under peak/ after every evaluation.
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("peak/step")]
    assert len(rows) == len(SERIES)
    assert [float(r["peak/step"]) for r in rows] == [2, 4, 6, 8, 10, 12, 12, 12]
    assert float(rows[-1]["peak/value"]) == pytest.approx(peak.peak["value"])
    assert float(rows[3]["peak/lower_bound"]) == pytest.approx(peak.evaluations[3]["lower_bound"])


def test_window_one_picks_the_small_perfect_evaluation(tmp_path):
    peak = PeakCheckpoint("val/correct", "val/total", window=1, dirpath=tmp_path)
    make_trainer(tmp_path, [peak], max_epochs=len(SERIES)).fit(SeriesModule(SERIES))
    assert peak.peak["evaluation"] == 2  # Beta(11, 1): 0.025 ** (1 / 11) = 0.715 beats 72/100's 0.625


def test_default_dirpath_and_skipping_outside_fit(tmp_path):
    peak = PeakCheckpoint("val/correct", "val/total")
    trainer = make_trainer(tmp_path, [peak], max_epochs=2)
    module = SeriesModule(SERIES)
    trainer.fit(module)
    assert peak.best_model_path == str(tmp_path / "checkpoints" / "peak.ckpt")
    assert len(peak.evaluations) == 2
    trainer.validate(module, verbose=False)
    assert len(peak.evaluations) == 2  # a stand-alone validation is not a training evaluation


class NoTotal(SeriesModule):
    def validation_step(self, batch, batch_idx):
        self.log("val/correct", 3.0, reduce_fx="sum")


def test_bad_monitors_raise(tmp_path):
    with pytest.raises(RuntimeError, match=r"monitors \['val/total'\] but the module did not log it"):
        make_trainer(tmp_path, [PeakCheckpoint("val/correct", "val/total")], max_epochs=1).fit(NoTotal(SERIES))
    with pytest.raises(ValueError, match=r"0 <= val/correct <= val/total"):
        make_trainer(tmp_path, [PeakCheckpoint("val/correct", "val/total")], max_epochs=1).fit(SeriesModule([(5, 4)]))


@pytest.mark.parametrize(("kwargs", "match"), [({"window": 0}, "window"), ({"quantile": 0.0}, "quantile")])
def test_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PeakCheckpoint("c", "t", **kwargs)


def test_state_round_trip():
    peak = PeakCheckpoint("c", "t")
    peak.evaluations = [{"successes": 3.0, "trials": 4.0, "lower_bound": 0.3, "step": 2.0, "epoch": 0.0}]
    peak.peak = {"value": 0.3, "accuracy": 2 / 3, "step": 2, "epoch": 0, "evaluation": 0, "path": "x/peak.ckpt"}
    other = PeakCheckpoint("c", "t")
    other.load_state_dict(peak.state_dict())
    assert (other.evaluations, other.peak) == (peak.evaluations, peak.peak)


@pytest.mark.distributed
def test_ddp_ranks_agree_on_the_peak():
    outdir, (rank0, rank1) = ddp_results()
    key = PeakCheckpoint("val/correct", "val/total").state_key
    assert rank0["states"][key] == rank1["states"][key]
    evaluations = rank0["states"][key]["evaluations"]
    for epoch, record in enumerate(evaluations):
        _, truth = val_tables(epoch, 32, degenerate_epochs=(1,))
        assert (record["successes"], record["trials"]) == (float(truth.sum()), 32.0)  # summed over both ranks
    best = max(range(3), key=lambda i: evaluations[i]["lower_bound"])
    assert rank0["states"][key]["peak"]["evaluation"] == best
    ckpt = torch.load(f"{outdir}/peak/peak.ckpt", weights_only=False)
    assert ckpt["global_step"] == rank0["states"][key]["peak"]["step"]


def test_readme_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    example = run_docs_example("peak = PeakCheckpoint(")
    peak = example["peak"]
    assert len(peak.evaluations) == 4
    assert peak.peak["value"] == max(e["lower_bound"] for e in peak.evaluations)
    assert (tmp_path / "checkpoints" / "peak.ckpt").exists()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "Give either"),
        ({"monitor_correct": "c"}, "Give either"),
        ({"monitor_correct": "c", "monitor_total": "t", "success_key": "ok", "id_key": "item"}, "Give either"),
        ({"success_key": "ok"}, "go together"),
    ],
)
def test_monitors_or_item_outcomes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PeakCheckpoint(**kwargs)
    assert PeakCheckpoint(success_key="ok", id_key="item").state_key != PeakCheckpoint("c", "t").state_key


@pytest.mark.distributed
def test_ddp_two_processes_count_101_items_once():
    """101 items on 2 processes (the sampler pads to 102): with item ids, every evaluation has 101 trials."""
    rank0, rank1 = item_ddp_results()
    key = PeakCheckpoint(success_key="truth", id_key="item").state_key
    assert rank0["states"][key] == rank1["states"][key]
    evaluations = rank0["states"][key]["evaluations"]
    assert len(evaluations) == ITEM_EPOCHS
    for epoch, record in enumerate(evaluations):
        _, truth = val_tables(epoch, ITEMS)
        assert (record["successes"], record["trials"]) == (float(truth.sum()), float(ITEMS))
        assert record["lower_bound"] == pytest.approx(
            stats.beta.ppf(0.025, 1 + truth.sum().item(), 1 + ITEMS - truth.sum().item()), rel=1e-12
        )


def test_peak_saves_say_what_they_save(tmp_path):
    """A peak save asks for the full checkpoint by name: Lightning's "`weights_only` was not set, defaulting to
    `False`" (which read as if the suite loaded without weights_only) is not logged, and the file still resumes."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    source = logging.getLogger("lightning.pytorch.trainer.connectors.checkpoint_connector")
    source.addHandler(handler)
    level = source.level
    source.setLevel(logging.INFO)
    try:
        peak = PeakCheckpoint("val/correct", "val/total", window=1, dirpath=tmp_path / "peak")
        make_trainer(tmp_path, [peak], max_epochs=3).fit(SeriesModule(SERIES))
    finally:
        source.removeHandler(handler)
        source.setLevel(level)
    assert len(peak.evaluations) == 3 and peak.peak is not None
    assert not [r for r in records if "weights_only" in r.getMessage()]
    ckpt = torch.load(peak.best_model_path, weights_only=True)
    assert ckpt["optimizer_states"] and peak.state_key in ckpt["callbacks"]  # the full state, as before
