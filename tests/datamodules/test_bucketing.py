"""Batches of similar lengths (``bucket_window``): the same examples, fewer pad tokens, the resumable order kept."""

import random

import pytest

from alignment_games.datamodules.resumable import ResumableDataLoader, bucket_order
from alignment_games.datamodules.sft import ArithmeticSFTDataModule, _chars


def _dm(window, seed=0):
    dm = ArithmeticSFTDataModule(
        num_prompts=403,
        kinds=["correct"],
        style="think_reversed",
        min_steps=1,
        max_steps=6,
        follower_fraction=0.0,
        val_fraction=0.005,
        batch_size=8,
        seed=seed,
        bucket_window=window,
    )
    dm.setup()
    return dm


def _triples(batch):
    return list(zip(batch["system"], batch["prompt"], batch["response"]))


def _epoch(loader):
    return [_triples(b) for b in loader]


def _padding(batches):
    return sum(len(b) * max(map(_chars, b)) - sum(map(_chars, b)) for b in batches)


def test_bucket_order_is_a_permutation_cut_into_sorted_runs():
    rng = random.Random(1)
    lengths = [rng.randint(1, 100) for _ in range(103)]
    indices = list(range(103))
    rng.shuffle(indices)
    out = bucket_order(indices, lengths, 4, 5, random.Random(2))
    assert sorted(out) == sorted(indices)
    # each run of 5 batches holds the same items as the input's run, and the last incomplete batch stays last
    for start in range(0, 103, 20):
        assert sorted(out[start : start + 20]) == sorted(indices[start : start + 20])
    assert len(out) % 4 == 3 and sorted(out[-3:]) == sorted(sorted(indices[100:], key=lambda i: lengths[i])[-3:])
    with pytest.raises(ValueError, match="at least 1"):
        bucket_order(indices, lengths, 4, 0, rng)


def test_bucketed_epochs_hold_the_same_examples_with_fewer_pad_tokens():
    plain, bucketed = _dm(0), _dm(16)
    assert plain.train_pairs == bucketed.train_pairs
    p_loader, b_loader = plain.train_dataloader(), bucketed.train_dataloader()
    for _ in range(2):  # two epochs, each a new order
        p_epoch, b_epoch = _epoch(p_loader), _epoch(b_loader)
        assert sorted(sum(p_epoch, [])) == sorted(sum(b_epoch, [])) == sorted(plain.train_pairs)
        assert len(p_epoch) == len(b_epoch) and [len(b) for b in b_epoch] == [len(b) for b in p_epoch]
        assert _padding(b_epoch) < 0.3 * _padding(p_epoch)


def test_no_window_keeps_the_plain_order():
    loader = _dm(0).train_dataloader()
    reference = ResumableDataLoader(_dm(0).train_pairs, batch_size=8, shuffle=True, seed=0, collate_fn=lambda b: b)
    assert _epoch(loader) == [list(b) for b in reference]


def test_bucketed_order_is_deterministic_and_resumes_mid_epoch():
    epochs = [_epoch(loader := _dm(16).train_dataloader()), _epoch(loader)]
    assert epochs[0] != epochs[1]
    assert _epoch(_dm(16).train_dataloader()) == epochs[0]  # a fresh module, the same first epoch
    assert _epoch(_dm(16, seed=1).train_dataloader()) != epochs[0]
    stopped = _dm(16).train_dataloader()
    _epoch(stopped)  # all of epoch 0
    it = iter(stopped)
    for _ in range(5):
        next(it)  # five batches of epoch 1
    state = stopped.state_dict()
    assert state == {"epoch": 1, "batches": 5}
    resumed = _dm(16).train_dataloader()
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(1)  # what Lightning does at the start of the resumed epoch
    assert _epoch(resumed) == epochs[1][5:]
