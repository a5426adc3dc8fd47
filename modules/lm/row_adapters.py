"""Several players' LoRA adapters in one decode: each row its own player's update over the disabled-adapter base.

A layer's adapters are stacked once, so every row's update costs two matrix products and a row mask.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def plain_lora_layers(model: nn.Module, player: str, mergeable: bool = True) -> list[nn.Module] | None:
    """``player``'s LoRA layers when all are plain LoRA on ``nn.Linear`` (the form ``W + s·BA``), else ``None``.

    ``mergeable=False`` also takes ``nn.Linear`` subclasses (``Linear4bit``): :func:`row_adapters` adds to their output.
    """
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer) and player in m.lora_A]
    plain = all(
        (type(m.get_base_layer()) is nn.Linear or not mergeable and isinstance(m.get_base_layer(), nn.Linear))
        and not m.use_dora.get(player, False)
        and not getattr(m, "lora_bias", {}).get(player, False)
        for m in layers
    )
    return layers if plain else None


@contextmanager
def row_adapters(model: nn.Module, players: Sequence[str | None], group: int) -> Iterator[None]:
    """Each row's own adapter in a decode of several players' prompts over the base with adapters disabled.

    ``players[i]``: prompt ``i``'s player (``None``: the reference), its ``group`` rows following it. Every LoRA layer
    gets row masks (per prompt, per row, per player) and a hook adding the update, removed on exit.
    """
    from peft.tuners.lora import LoraLayer

    rows = [p for p in players for _ in range(group)]
    firsts = list(dict.fromkeys(players))  # one row per player: a prompt prefix it shares (decoding.prompt_cache)
    counts = [(len(players), players), (len(rows), rows)] + [(len(firsts), firsts)] * (len(firsts) < len(players))
    names = [p for p in firsts if p is not None]
    handles, layers = [], [m for m in model.modules() if isinstance(m, LoraLayer)]
    try:
        for m in layers:
            if not (own := [p for p in names if p in m.lora_A]):
                continue
            a = torch.cat([m.lora_A[p].weight for p in own])  # [Σr, in]
            b = torch.cat([m.lora_B[p].weight * m.scaling[p] for p in own], dim=1)  # [out, Σr]
            ranks = [m.lora_A[p].weight.shape[0] for p in own]
            masks = {n: _row_mask(who, own, ranks, a) for n, who in counts}
            m._row_adapter = (a, b, masks)
            handles.append(m.register_forward_hook(lambda mod, args, out: add_row_adapters(mod, args[0], out)))
        model.__dict__["_row_players"] = list(players)  # read by decoding.prompt_cache
        yield
    finally:
        model.__dict__.pop("_row_players", None)
        for h in handles:
            h.remove()
        for m in layers:
            m.__dict__.pop("_row_adapter", None)


def _row_mask(who: Sequence[str | None], own: list[str], ranks: list[int], like: Tensor) -> Tensor:
    """``[len(who), Σr]``: 1 on the rank block of each row's player (all 0 for a row without an adapter here)."""
    mask = torch.zeros(len(who), sum(ranks), dtype=like.dtype, device=like.device)
    starts = dict(zip(own, [sum(ranks[:i]) for i in range(len(own))]))
    for i, p in enumerate(who):
        if p in starts:
            mask[i, starts[p] : starts[p] + ranks[own.index(p)]] = 1
    return mask


def add_row_adapters(module: nn.Module, x: Tensor, out: Tensor) -> Tensor:
    """Add to ``out`` (the base layer's output for ``x``) each row's own LoRA update (no dropout).

    Raises:
        RuntimeError: naming the row counts, for an input whose rows are neither the prompts' nor the samples'.
    """
    a, b, masks = module._row_adapter
    if (mask := masks.get(x.shape[0])) is None:
        raise RuntimeError(f"row adapters: an input of {x.shape[0]} rows, set for {sorted(masks)} rows")
    h = F.linear(x.to(a.dtype), a)  # every player's A on every row: [N, ..., Σr]
    h = h * mask.view(mask.shape[0], *([1] * (h.dim() - 2)), mask.shape[1])
    out += F.linear(h, b).to(out.dtype)
    return out
