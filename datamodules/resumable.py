"""A training data loader that resumes mid-epoch: same order, next batch, after a checkpoint."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from typing_extensions import override

from alignment_games.callbacks.fault_tolerance import rank_and_world

#: how far apart the orders of consecutive run seeds start (the sampler adds the epoch to its seed)
RUN_SEED_STRIDE = 1_000_003


def run_seed() -> int:
    """The seed ``seed_everything`` set in this process (``PL_GLOBAL_SEED``, passed to spawned ranks), else 0."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def bucket_order(
    indices: Sequence[int], lengths: Sequence[int], batch_size: int, window: int, rng: random.Random
) -> list[int]:
    """``indices`` regrouped into batches of similar length (sorted within runs of ``window`` batches, then shuffled).

    Example:
        >>> bucket_order([0, 1, 2, 3, 4], [5, 1, 4, 2, 3], 2, 4, random.Random(0))
        [1, 3, 4, 2, 0]

    Raises:
        ValueError: for ``batch_size`` or ``window`` below 1.
    """
    if batch_size < 1 or window < 1:
        raise ValueError(f"batch_size and window must be at least 1, got {batch_size}, {window}")
    out: list[int] = []
    step = batch_size * window
    for start in range(0, len(indices), step):
        chunk = sorted(indices[start : start + step], key=lambda i: lengths[i])
        full = len(chunk) // batch_size * batch_size
        batches = [chunk[i : i + batch_size] for i in range(0, full, batch_size)]
        rng.shuffle(batches)
        out += [i for b in batches for i in b] + chunk[full:]
    return out


class ResumableSampler(DistributedSampler):
    """Each epoch's order from ``seed + epoch`` (shuffled or not), split across ranks, with a skip for resuming.

    A ``DistributedSampler``, so Lightning neither replaces it under DDP nor forgets :meth:`set_epoch`. ``replicated``:
    every rank gets every item; ``lengths``, ``bucket_batch``, ``bucket_window``: :func:`bucket_order` batches.
    """

    def __init__(
        self,
        dataset: Dataset,
        shuffle: bool = True,
        seed: int = 0,
        replicated: bool = False,
        lengths: Sequence[int] | None = None,
        bucket_batch: int = 1,
        bucket_window: int = 0,
    ) -> None:
        rank, world = (0, 1) if replicated else rank_and_world()
        super().__init__(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=False)
        if lengths is not None and len(lengths) != len(dataset):  # type: ignore[arg-type]
            raise ValueError(f"lengths holds {len(lengths)} entries for {len(dataset)} items")  # type: ignore[arg-type]
        if bucket_window < 0:
            raise ValueError(f"bucket_window must be non-negative, got {bucket_window}")
        self.lengths = None if lengths is None else list(lengths)
        self.bucket_batch, self.bucket_window = bucket_batch, bucket_window
        self.skip, self._epoch_fresh = 0, True

    @override
    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self._epoch_fresh = True

    def __iter__(self) -> Iterator[int]:
        if not self._epoch_fresh:
            self.epoch += 1
        self._epoch_fresh = False
        skip, self.skip = self.skip, 0
        indices = list(super().__iter__())
        if self.lengths is not None and self.bucket_window > 0:
            # a function of seed + epoch only, so a resumed epoch skips into the same order
            rng = random.Random(f"bucket-{self.seed}-{self.epoch}")
            indices = bucket_order(indices, self.lengths, self.bucket_batch, self.bucket_window, rng)
        return iter(indices[skip:])


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` whose ``state_dict`` (``{"epoch", "batches"}``) resumes it exactly mid-epoch.

    Orders come from ``seed`` plus the run's seed, or ``order_seed`` as given; the global generator is never used.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        drop_last: bool = False,
        replicated: bool = False,
        lengths: Sequence[int] | None = None,
        bucket_window: int = 0,
        order_seed: int | None = None,
        **kwargs: Any,
    ) -> None:
        seed = seed + RUN_SEED_STRIDE * run_seed() if order_seed is None else order_seed
        for key in ("sampler", "batch_sampler", "generator"):
            if kwargs.get(key) is not None:
                raise ValueError(f"ResumableDataLoader sets its own {key}; do not pass one")
            kwargs.pop(key, None)
        kwargs.pop("shuffle", None)
        sampler = ResumableSampler(dataset, shuffle, seed, replicated, lengths, batch_size or 1, bucket_window)
        generator = torch.Generator().manual_seed(seed)
        loader_args = dict(collate_fn=collate_fn, num_workers=num_workers, drop_last=drop_last, generator=generator)
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, **loader_args, **kwargs)
        self.seed, self.shuffle = seed, shuffle
        self._batches = 0
        self._resume: tuple[int, int] | None = None

    def __iter__(self) -> Iterator[Any]:
        # A generator: the body runs at the first next(), after Lightning's set_epoch for this epoch.
        sampler: ResumableSampler = self.sampler  # type: ignore[assignment]
        epoch = sampler.epoch if sampler._epoch_fresh else sampler.epoch + 1
        saved, self._resume = self._resume, None
        skip = saved[1] if saved is not None and saved[0] == epoch else 0
        sampler.skip = skip * (self.batch_size or 1)  # batch_size=None: one item per batch
        self._batches = skip
        for batch in super().__iter__():
            self._batches += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "batches"}``: where the training stands in the data."""
        sampler: ResumableSampler = self.sampler  # type: ignore[assignment]
        return {"epoch": int(sampler.epoch), "batches": int(self._batches)}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Resume in epoch ``state_dict["epoch"]`` after batch ``state_dict["batches"]`` at the next iteration."""
        self._resume = (int(state_dict["epoch"]), int(state_dict["batches"]))
        self._batches = int(state_dict["batches"])


def split_loader(
    dataset: Dataset | Sequence[Any],
    batch_size: int,
    collate_fn: Callable[[list[Any]], Any],
    *,
    train: bool,
    shuffle: bool = False,
    seed: int = 0,
    num_workers: int = 0,
) -> DataLoader:
    """The loader of one split (a list of items serves): :class:`ResumableDataLoader` for training, else plain."""
    common = dict(batch_size=batch_size, shuffle=shuffle, num_workers=num_workers, collate_fn=collate_fn)
    return ResumableDataLoader(dataset, seed=seed, **common) if train else DataLoader(dataset, **common)
