"""A player's LoRA update merged into copies of its base weights, kept until the adapter or the base changes."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn


def values_snapshot(tensors: Sequence[Tensor]) -> Tensor:
    """One flat copy of ``tensors``' values; ``torch.equal`` with a later one tells whether any was written.

    Compares values, not ``_version``: a fused optimizer step and an edit through ``.data`` leave the version as it was.
    """
    with torch.no_grad():
        return torch.cat([t.detach().reshape(-1) for t in tensors])


class MergedAdapters:
    """Per player: ``W + s·BA`` of each plain LoRA layer, as parameters ready to stand in for the base weights."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[tuple, Tensor, list[nn.Parameter]]] = {}
        self.merges = 0  # layers merged so far (what a reuse saves)

    def clear(self) -> None:
        """Drop every player's copies (their memory)."""
        self.entries.clear()

    def weights(self, player: str, layers: Sequence[nn.Module]) -> list[nn.Parameter]:
        """The merged weight of each of ``layers`` (peft LoRA layers on ``nn.Linear``), reused while still current."""
        bases = [m.get_base_layer().weight for m in layers]
        key = tuple(
            (id(w), w.data_ptr(), w._version, w.dtype, w.device, m.scaling[player]) for w, m in zip(bases, layers)
        )
        with torch.no_grad():
            adapter = values_snapshot([t for m in layers for t in (m.lora_A[player].weight, m.lora_B[player].weight)])
            entry = self.entries.get(player)
            if entry is not None and entry[0] == key and torch.equal(entry[1], adapter):
                return entry[2]
            self.entries.pop(player, None)  # the stale copies go before the new ones are made
            delta = [m.get_delta_weight(player) for m in layers]
            merged = [nn.Parameter(w + d.to(w.dtype), requires_grad=False) for w, d in zip(bases, delta, strict=True)]
            self.merges += len(layers)
        self.entries[player] = (key, adapter, merged)
        return merged
