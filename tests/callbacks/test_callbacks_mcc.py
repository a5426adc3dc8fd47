import numpy as np
import pytest
import torch
from helpers.callback_helpers import (
    GameModule,
    IndexDataset,
    SyncSpy,
    ddp_results,
    make_trainer,
    run_docs_example,
    train_labels,
    val_tables,
)
from helpers.item_ddp import EPOCHS as ITEM_EPOCHS
from helpers.item_ddp import ITEMS, item_ddp_results
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import confusion_matrix, matthews_corrcoef

from alignment_games.callbacks import MCCTracker, least_squares_slope, matthews_corrcoef_from_counts

# scikit-learn warns on single-class inputs: exactly the degenerate cases these tests compare against.
pytestmark = pytest.mark.filterwarnings("ignore:A single label was found:UserWarning")


def counts(judge, truth):
    judge, truth = np.asarray(judge), np.asarray(truth)
    return (
        int(((judge == 1) & (truth == 1)).sum()),
        int(((judge == 1) & (truth == 0)).sum()),
        int(((judge == 0) & (truth == 0)).sum()),
        int(((judge == 0) & (truth == 1)).sum()),
    )


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 1)), min_size=1, max_size=60))
def test_counts_formula_equals_sklearn(pairs):
    judge, truth = zip(*pairs)
    expected = matthews_corrcoef(truth, judge)
    assert matthews_corrcoef_from_counts(*counts(judge, truth)) == pytest.approx(expected, abs=1e-12)


def test_counts_formula_degenerate_and_hand_values():
    assert matthews_corrcoef_from_counts(5, 0, 5, 0) == 1.0
    assert matthews_corrcoef_from_counts(0, 5, 0, 5) == -1.0
    assert matthews_corrcoef_from_counts(3, 1, 2, 4) == pytest.approx((3 * 2 - 1 * 4) / np.sqrt(4 * 7 * 3 * 6))
    # A single class in the truth or in the verdicts, or nothing at all: 0 like scikit-learn, not NaN.
    for tp, fp, tn, fn in [(7, 3, 0, 0), (0, 0, 6, 4), (5, 0, 0, 5), (0, 5, 5, 0), (0, 0, 0, 0)]:
        assert matthews_corrcoef_from_counts(tp, fp, tn, fn) == 0.0
    assert matthews_corrcoef([1, 1, 1, 1], [1, 1, 1, 1]) == 0.0  # scikit-learn's convention, checked
    with pytest.raises(ValueError, match=">= 0"):
        matthews_corrcoef_from_counts(-1, 0, 0, 0)


def test_slope_equals_polyfit():
    values = [0.61, 0.58, 0.52, 0.47, 0.49]
    assert least_squares_slope(values) == pytest.approx(np.polyfit(range(5), values, 1)[0], abs=1e-12)
    assert least_squares_slope([0.3]) == least_squares_slope([]) == 0.0
    assert least_squares_slope([1.0, 2.0, 4.0]) == 1.5


def test_val_mcc_equals_sklearn_per_epoch_with_trend_and_counts(tmp_path):
    module = GameModule(val_size=40, degenerate_epochs=(2,))
    tracker = MCCTracker("judge", "truth", stage="val", trend_window=3)
    trainer = make_trainer(tmp_path, [tracker], max_epochs=4, num_sanity_val_steps=2)  # sanity check is skipped
    trainer.fit(module)

    assert len(tracker.history) == 4
    expected = []
    for epoch, record in enumerate(tracker.history):
        judge, truth = val_tables(epoch, 40, degenerate_epochs=(2,))
        expected.append(matthews_corrcoef(truth.numpy(), judge.numpy()))
        assert record["mcc"] == pytest.approx(expected[-1], abs=1e-12)
        tp, fp, tn, fn = counts(judge, truth)
        assert (record["tp"], record["fp"], record["tn"], record["fn"]) == (tp, fp, tn, fn)
        assert record["accept_rate"] == pytest.approx(float(judge.float().mean()))
        window = expected[-3:]
        assert record["trend"] == pytest.approx(np.polyfit(range(len(window)), window, 1)[0] if epoch else 0.0)
    assert tracker.history[2]["mcc"] == 0.0 and expected[2] == 0.0  # the degenerate epoch
    assert 0.2 < expected[0] < 0.9  # the random epochs are informative, not degenerate
    metrics = trainer.callback_metrics
    assert float(metrics["val/mcc"]) == pytest.approx(expected[-1], abs=1e-6)
    assert float(metrics["val/mcc_trend"]) == pytest.approx(tracker.last["trend"], abs=1e-6)
    assert float(metrics["val/mcc_accept_rate"]) == pytest.approx(tracker.last["accept_rate"], abs=1e-6)
    assert float(metrics["val/mcc_tp"]) == tracker.last["tp"] and float(metrics["val/mcc_fn"]) == tracker.last["fn"]


def test_train_and_test_stages(tmp_path):
    module = GameModule()
    train = MCCTracker("judge", "truth", stage="train", name="judge_mcc")
    test = MCCTracker("judge", "truth", stage="test")
    trainer = make_trainer(tmp_path, [train, test], max_epochs=2, limit_val_batches=0)
    trainer.fit(module)
    for epoch in range(2):
        pairs = [train_labels(epoch, b, 0, 4) for b in range(12)]
        judge = torch.cat([j for j, _ in pairs]).numpy()
        truth = torch.cat([t for _, t in pairs]).numpy()
        assert train.history[epoch]["mcc"] == pytest.approx(matthews_corrcoef(truth, judge), abs=1e-12)
    assert test.history == []
    trainer.test(module, verbose=False)
    judge, truth = val_tables(2, 32)  # tested after two epochs: current_epoch == 2
    assert test.last["mcc"] == pytest.approx(matthews_corrcoef(truth.numpy(), judge.numpy()), abs=1e-12)
    assert float(trainer.callback_metrics["test/mcc"]) == pytest.approx(test.last["mcc"], abs=1e-6)


def test_probabilities_are_thresholded():
    tracker = MCCTracker("p", "y", threshold=0.5)

    class FakeTrainer:
        sanity_checking = False

    tracker._update(FakeTrainer(), {"p": torch.tensor([0.9, 0.2, 0.7, 0.4, 0.5]), "y": torch.tensor([1, 0, 0, 1, 1])})
    # p > 0.5 accepts: verdicts 1, 0, 1, 0, 0
    found = tuple(int(t) for t in (tracker.counts.tp, tracker.counts.fp, tracker.counts.tn, tracker.counts.fn))
    assert found == (1, 1, 1, 2)


def test_batch_update_reads_nothing_back_from_the_device():
    tracker = MCCTracker("judge", "truth")

    class FakeTrainer:
        sanity_checking = False

    judge = torch.tensor([1, 0, 1, 1, 0, 1]).as_subclass(SyncSpy)
    truth = torch.tensor([1, 0, 0, 1, 1, 1]).as_subclass(SyncSpy)
    probs = torch.tensor([0.9, 0.1, 0.6, 0.8, 0.3, 0.7]).as_subclass(SyncSpy)
    SyncSpy.calls.clear()
    for _ in range(3):
        tracker._update(FakeTrainer(), {"judge": judge, "truth": truth})
        tracker._update(FakeTrainer(), {"judge": probs, "truth": truth})
    assert SyncSpy.calls == []
    float(judge.sum())  # the spy does see a read-back
    assert SyncSpy.calls == ["__float__"]
    assert int(tracker.counts.tp.sum()) == 6 * 3


class MissingKey(GameModule):
    def validation_step(self, batch, batch_idx):
        return {"judge": super().validation_step(batch, batch_idx)["judge"]}


class WrongSize(GameModule):
    def validation_step(self, batch, batch_idx):
        out = super().validation_step(batch, batch_idx)
        return {"judge": out["judge"], "truth": out["truth"][:-1]}


def test_bad_outputs_raise(tmp_path):
    with pytest.raises(RuntimeError, match=r"`validation_step` must return a mapping .*'truth'.*got \['judge'\]"):
        make_trainer(tmp_path, [MCCTracker("judge", "truth")], max_epochs=1).fit(MissingKey())
    with pytest.raises(ValueError, match="8 verdicts under 'judge' but 7 truth values"):
        make_trainer(tmp_path, [MCCTracker("judge", "truth")], max_epochs=1).fit(WrongSize())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"stage": "predict"}, "stage"), ({"trend_window": 1}, "trend_window"), ({"threshold": 1.5}, "threshold")],
)
def test_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MCCTracker("judge", "truth", **kwargs)


def test_state_round_trip():
    tracker = MCCTracker("judge", "truth", stage="train")
    tracker.history = [{"mcc": 0.5, "trend": 0.0}, {"mcc": 0.25, "trend": -0.25}]
    tracker._offset = [1, 2, 3, 4]
    other = MCCTracker("judge", "truth", stage="train")
    other.load_state_dict(tracker.state_dict())
    assert other.state_dict() == tracker.state_dict() == {"history": tracker.history, "partial_counts": [1, 2, 3, 4]}
    assert MCCTracker("a", "b", stage="val").state_key != MCCTracker("a", "b", stage="train").state_key


@pytest.mark.distributed
def test_ddp_two_processes_equal_sklearn():
    """Two CPU processes (gloo), each validating half of the set: the epoch's MCC is the full set's."""
    outdir, (rank0, rank1) = ddp_results()
    val_key = MCCTracker("judge", "truth", stage="val").state_key
    train_key = MCCTracker("judge", "truth", stage="train", name="judge_mcc").state_key
    assert rank0["states"][val_key] == rank1["states"][val_key]
    assert rank0["states"][train_key] == rank1["states"][train_key]
    history = rank0["states"][val_key]["history"]
    assert len(history) == 3
    for epoch, record in enumerate(history):
        judge, truth = val_tables(epoch, 32, degenerate_epochs=(1,))
        assert record["mcc"] == pytest.approx(matthews_corrcoef(truth.numpy(), judge.numpy()), abs=1e-12)
        assert record["tp"] + record["fp"] + record["tn"] + record["fn"] == 32  # every sample once, no padding
    assert history[1]["mcc"] == 0.0  # degenerate epoch
    assert rank0["callback_metrics"]["val/mcc"] == pytest.approx(history[-1]["mcc"], abs=1e-6)
    assert rank1["callback_metrics"]["val/mcc"] == rank0["callback_metrics"]["val/mcc"]
    # Training stage: both ranks' batches (6 each per epoch) pooled.
    for epoch, record in enumerate(rank0["states"][train_key]["history"]):
        pairs = [train_labels(epoch, b, r, 4) for r in (0, 1) for b in range(6)]
        judge = torch.cat([j for j, _ in pairs]).numpy()
        truth = torch.cat([t for _, t in pairs]).numpy()
        assert record["mcc"] == pytest.approx(matthews_corrcoef(truth, judge), abs=1e-12)
    # A mid-epoch checkpoint holds the running epoch's counts summed over both ranks (batches 0-1 of epoch 1).
    ckpt = torch.load(f"{outdir}/steps/epoch=1-step=16.ckpt", weights_only=False)
    pairs = [train_labels(1, b, r, 4) for r in (0, 1) for b in range(2)]
    judge = torch.cat([j for j, _ in pairs]).numpy()
    truth = torch.cat([t for _, t in pairs]).numpy()
    assert ckpt["callbacks"][train_key]["partial_counts"] == list(counts(judge, truth))


def test_readme_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    example = run_docs_example("tracker = MCCTracker(")
    tracker, module, data = example["tracker"], example["trainer"].lightning_module, example["DATA"]
    x, truth = data.tensors
    with torch.no_grad():
        verdicts = (module.judge(x).squeeze(-1) > 0).long()
    assert len(tracker.history) == 3
    assert tracker.last["mcc"] == pytest.approx(matthews_corrcoef(truth.numpy(), verdicts.numpy()), abs=1e-12)


def test_item_ids_count_each_item_once_on_one_process(tmp_path):
    """Repeated item ids (a padded evaluation) count once: the first record wins, as across ranks."""
    tracker = MCCTracker("judge", "truth", stage="val", id_key="item")

    class Repeats(GameModule):
        def validation_step(self, batch, batch_idx):
            out = super().validation_step(batch, batch_idx)
            return {**out, "item": batch["index"]}

        def val_dataloader(self):  # items 0..31 and then items 0..7 again, as a sampler's padding would repeat
            data = torch.utils.data.ConcatDataset(
                [IndexDataset(32, seed=1), torch.utils.data.Subset(IndexDataset(32, seed=1), range(8))]
            )
            return torch.utils.data.DataLoader(data, batch_size=8)

    make_trainer(tmp_path, [tracker], max_epochs=1, limit_train_batches=1).fit(Repeats())
    judge, truth = val_tables(0, 32)
    tn, fp, fn, tp = confusion_matrix(truth.numpy(), judge.numpy(), labels=[0, 1]).ravel()
    record = tracker.last
    assert [record[k] for k in ("tp", "fp", "tn", "fn")] == [tp, fp, tn, fn]
    assert record["mcc"] == pytest.approx(matthews_corrcoef(truth.numpy(), judge.numpy()), abs=1e-12)


def test_item_ids_missing_or_of_another_size_raise(tmp_path):
    tracker = MCCTracker("judge", "truth", id_key="item")
    trainer = make_trainer(tmp_path, [tracker], max_epochs=1, limit_train_batches=1)
    with pytest.raises(RuntimeError, match="item ids under 'item'"):
        trainer.fit(GameModule())
    with pytest.raises(ValueError, match="2 verdicts under 'judge' but 3 item ids under 'item'"):
        tracker._update(
            trainer, {"judge": torch.tensor([1, 0]), "truth": torch.tensor([1, 1]), "item": torch.arange(3)}
        )


@pytest.mark.distributed
def test_ddp_two_processes_count_101_items_once():
    """101 items on 2 processes (the sampler pads to 102): with item ids, the counts are sklearn's on the 101."""
    rank0, rank1 = item_ddp_results()
    assert rank0["world_size"] == 2
    exact = MCCTracker("judge", "truth", stage="val", id_key="item").state_key
    padded = MCCTracker("judge", "truth", stage="val", name="mcc_padded").state_key
    assert rank0["states"][exact] == rank1["states"][exact]
    history = rank0["states"][exact]["history"]
    assert len(history) == ITEM_EPOCHS
    for epoch, record in enumerate(history):
        judge, truth = val_tables(epoch, ITEMS)
        tn, fp, fn, tp = confusion_matrix(truth.numpy(), judge.numpy(), labels=[0, 1]).ravel()
        assert [record[k] for k in ("tp", "fp", "tn", "fn")] == [tp, fp, tn, fn]
        assert record["mcc"] == pytest.approx(matthews_corrcoef(truth.numpy(), judge.numpy()), abs=1e-12)
        # the control: without ids the padded item is counted twice
        assert sum(rank0["states"][padded]["history"][epoch][k] for k in ("tp", "fp", "tn", "fn")) == ITEMS + 1
