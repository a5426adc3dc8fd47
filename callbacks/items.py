"""Each evaluation item counted once across ranks, undoing the distributed sampler's padding with repeated items."""

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from alignment_games.callbacks.fault_tolerance import rank_and_world


def read_step_outputs(outputs: Any, wanted: Mapping[str, str], owner: str, step: str) -> dict[str, Tensor]:
    """The values under each key of ``wanted`` (key → what it holds, for errors) in a step's output, as 1-D tensors.

    Raises:
        RuntimeError: when ``outputs`` is not a mapping holding every key, listing what it holds.
        ValueError: when two of the values differ in length, naming both.
    """
    if not isinstance(outputs, Mapping) or any(key not in outputs for key in wanted):
        found = sorted(outputs) if isinstance(outputs, Mapping) else type(outputs).__name__
        needs = ", ".join(f"{what} under {key!r}" for key, what in wanted.items())
        raise RuntimeError(f"{owner}: `{step}` must return a mapping with {needs}; got {found}.")
    values = {key: torch.as_tensor(outputs[key]).reshape(-1) for key in wanted}
    first, *others = wanted
    for key in others:
        if values[key].numel() != values[first].numel():
            raise ValueError(
                f"{owner}: {values[first].numel()} {wanted[first]} under {first!r} but {values[key].numel()} "
                f"{wanted[key]} under {key!r}."
            )
    return values


def first_occurrences(ids: Tensor) -> Tensor:
    """Positions of the first occurrence of each distinct id of the 1-D tensor ``ids``, in increasing id order.

    Example:
        >>> first_occurrences(torch.tensor([4, 1, 4, 2, 1])).tolist()
        [1, 3, 0]
    """
    if ids.dim() != 1:
        raise ValueError(f"item ids must be one-dimensional, got shape {tuple(ids.shape)}")
    if ids.numel() == 0:
        return torch.zeros(0, dtype=torch.long, device=ids.device)
    uniq, inverse = torch.unique(ids, return_inverse=True)
    positions = torch.arange(ids.numel(), device=ids.device)
    return torch.full_like(uniq, ids.numel()).scatter_reduce(0, inverse, positions, reduce="amin")


def _gather(tensor: Tensor) -> Tensor:
    """``tensor`` of every rank concatenated along dim 0 in rank order (itself on one process); sizes may differ."""
    _, world = rank_and_world()
    if world == 1:
        return tensor
    local = torch.tensor([tensor.shape[0]], dtype=torch.long, device=tensor.device)
    sizes = [torch.zeros_like(local) for _ in range(world)]
    torch.distributed.all_gather(sizes, local)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros((longest, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    padded[: tensor.shape[0]] = tensor
    parts = [torch.zeros_like(padded) for _ in range(world)]
    torch.distributed.all_gather(parts, padded)
    return torch.cat([p[: int(s)] for p, s in zip(parts, sizes)])


def gather_unique_items(ids: Tensor, columns: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """Gather per-item records (``columns``, each ``[n, ...]``) from every rank; keep each id once, first in rank order.

    A collective: every rank calls it in the same order with the same column names (row counts may differ). Returns
    the unique ids in increasing order and the columns' matching rows.

    Raises:
        ValueError: if ids are not one-dimensional integers or a column's length differs from the ids'.
    """
    if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex():
        raise ValueError(f"item ids must be a one-dimensional integer tensor, got {ids.dtype} of {tuple(ids.shape)}")
    for name, col in columns.items():
        if col.shape[0] != ids.shape[0]:
            raise ValueError(f"column {name!r} has {col.shape[0]} rows for {ids.shape[0]} item ids")
    all_ids = _gather(ids.long())
    keep = first_occurrences(all_ids)
    return all_ids[keep], {name: _gather(col)[keep] for name, col in sorted(columns.items())}


class ItemRecords:
    """Per-item records of one epoch, kept on the device and gathered once, each item id once, at the end.

    ``extra`` records (e.g. restored from a checkpoint) are put first, so they win over a repeat of the same item.

    Args:
        columns: Names of the per-record values (each a 1-D tensor in :meth:`update`).
    """

    def __init__(self, columns: tuple[str, ...]) -> None:
        self.columns = tuple(columns)
        self.reset()

    def reset(self) -> None:
        """Forget the epoch's records."""
        self._ids: list[Tensor] = []
        self._values: dict[str, list[Tensor]] = {c: [] for c in self.columns}

    def update(self, ids: Tensor, **values: Tensor) -> None:
        """Append one batch's records: ``ids`` ``[n]`` and one ``[n]`` tensor per column.

        Raises:
            ValueError: naming the field, if a column is missing, unknown or of another length than ``ids``.
        """
        if set(values) != set(self.columns):
            raise ValueError(f"item records need the columns {sorted(self.columns)}, got {sorted(values)}")
        ids = torch.as_tensor(ids).reshape(-1)
        if ids.is_floating_point() or ids.is_complex():
            raise ValueError(f"item ids must be integers, got {ids.dtype}")
        for name, value in values.items():
            if value.numel() != ids.numel():
                raise ValueError(f"{value.numel()} values under {name!r} for {ids.numel()} item ids")
        self._ids.append(ids.detach().long())
        for name, value in values.items():
            self._values[name].append(value.detach().reshape(-1).double().to(ids.device))

    def compute(self, device: torch.device, extra: dict[str, Any] | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """All ranks' records, each id once, as ``(ids, {column: values})``; ``extra`` lists come before this rank's."""
        head = extra if extra and extra.get("ids") else {}

        def column(parts: list[Tensor], name: str, dtype: torch.dtype) -> Tensor:
            restored = torch.tensor(head.get(name, []), dtype=dtype, device=device)
            return torch.cat([restored, *(p.to(device) for p in parts)])

        values = {c: column(v, c, torch.float64) for c, v in self._values.items()}
        return gather_unique_items(column(self._ids, "ids", torch.long), values)
