"""Item records: each item id counted once, restored records first; the MCC tracker's resume state with ids."""

import pytest
import torch

from alignment_games.callbacks import ItemRecords, MCCTracker, first_occurrences, gather_unique_items


def test_first_occurrences_by_hand():
    assert first_occurrences(torch.tensor([4, 1, 4, 2, 1])).tolist() == [1, 3, 0]
    assert first_occurrences(torch.tensor([], dtype=torch.long)).tolist() == []
    with pytest.raises(ValueError, match="one-dimensional"):
        first_occurrences(torch.zeros(2, 2, dtype=torch.long))


def test_gather_on_one_process_drops_repeats_and_names_bad_fields():
    ids, cols = gather_unique_items(torch.tensor([3, 0, 3]), {"ok": torch.tensor([1.0, 0.0, 0.0])})
    assert ids.tolist() == [0, 3] and cols["ok"].tolist() == [0.0, 1.0]  # item 3's first record wins
    with pytest.raises(ValueError, match="column 'ok' has 2 rows for 3 item ids"):
        gather_unique_items(torch.tensor([3, 0, 1]), {"ok": torch.tensor([1.0, 0.0])})
    with pytest.raises(ValueError, match="integer"):
        gather_unique_items(torch.tensor([0.5]), {})


def test_records_restored_from_a_checkpoint_come_first():
    records = ItemRecords(("preds", "target"))
    records.update(torch.tensor([5, 2]), preds=torch.tensor([0, 1]), target=torch.tensor([1, 1]))
    ids, v = records.compute(torch.device("cpu"), extra={"ids": [5], "preds": [1.0], "target": [1.0]})
    assert ids.tolist() == [2, 5] and v["preds"].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="'target'"):
        records.update(torch.tensor([1, 2]), preds=torch.tensor([0, 1]), target=torch.tensor([1]))
    with pytest.raises(ValueError, match="columns"):
        records.update(torch.tensor([1]), preds=torch.tensor([0]))


def test_tracker_with_ids_keeps_its_running_records_across_a_resume():
    tracker = MCCTracker("judge", "truth", stage="train", id_key="item")
    tracker._offset_items = {"ids": [7.0], "preds": [1.0], "target": [0.0]}
    state = tracker.state_dict()
    assert state["partial_items"] == {"ids": [7.0], "preds": [1.0], "target": [0.0]}
    other = MCCTracker("judge", "truth", stage="train", id_key="item")
    other.load_state_dict(state)
    # item 7 again after the resume (a repeat) is dropped; item 8 is new: one fp from before, one tp now
    other.items.update(torch.tensor([7, 8]), preds=torch.tensor([0, 1]), target=torch.tensor([1, 1]))
    assert other._synced_counts() == [1, 1, 0, 0]
    assert "partial_items" not in MCCTracker("judge", "truth", stage="train").state_dict()
