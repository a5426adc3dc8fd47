"""Several players' LoRA adapters in one decode: each row gets its own player's update over the disabled-adapter base.

:meth:`~modules.lm.policy_bank.PolicyBank.generate` with a player per prompt runs the base with adapters disabled
inside :func:`row_adapters`, which hooks every LoRA layer to add each row its own player's update
(:func:`add_row_adapters`); :class:`~modules.lm.decode_step.LeanDecoder` adds them in its own projections.

The players' adapters of a layer are stacked once per decode (``A`` of all of them as one ``[Σr, in]`` matrix, ``B``
scaled as one ``[out, Σr]``), so a forward adds every row's update with two matrix products and a row mask that keeps
each row's own player's block: a fixed number of operations whatever the number of players or how their rows
interleave (a loop over runs of rows cost several small operations per run, per layer, per token).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["add_row_adapters", "plain_lora_layers", "row_adapters"]


def plain_lora_layers(model: nn.Module, player: str) -> list[nn.Module] | None:
    """``player``'s LoRA layers in ``model`` when all are plain LoRA on ``nn.Linear``, else ``None``.

    The form ``W + s·BA`` (merged into the weights, or added per row by :func:`row_adapters`) holds for those only, not
    for DoRA, a LoRA bias, embeddings or convolutions.
    """
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer) and player in m.lora_A]
    plain = all(
        type(m.get_base_layer()) is nn.Linear
        and not m.use_dora.get(player, False)
        and not getattr(m, "lora_bias", {}).get(player, False)
        for m in layers
    )
    return layers if plain else None


@contextmanager
def row_adapters(model: nn.Module, players: Sequence[str | None], group: int) -> Iterator[None]:
    """Each row's own adapter in a decode of several players' prompts over the base with adapters disabled.

    ``players[i]`` is prompt ``i``'s player (``None``: no adapter, the frozen reference); its ``group`` rows
    (``i*group …``) follow it. Every LoRA layer gets its players' stacked adapters (see the module's docstring), a
    row mask for inputs of one row per prompt (the prefill), one for ``len(players) · group`` rows, and, where a
    player has several prompts, one for a row per player in order of first appearance (a shared prompt prefix, see
    :func:`~modules.lm.decoding.prompt_cache`), and a forward hook that adds the update to its base output
    (:func:`add_row_adapters`). The players are kept on ``model._row_players``. All is removed on exit.
    """
    from peft.tuners.lora import LoraLayer

    rows = [p for p in players for _ in range(group)]
    firsts = list(dict.fromkeys(players))  # one row per player: a prompt prefix it shares (decoding.prompt_cache)
    counts = [(len(players), players), (len(rows), rows)] + [(len(firsts), firsts)] * (len(firsts) < len(players))
    names = [p for p in firsts if p is not None]
    handles, layers = [], [m for m in model.modules() if isinstance(m, LoraLayer)]
    try:
        for m in layers:
            own = [p for p in names if p in m.lora_A]
            if not own:
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
    """Add to ``out`` (the base layer's output for ``x``) each row's own LoRA update (set by :func:`row_adapters`).

    The update is peft's ``lora_B(lora_A(x)) · scaling`` (no dropout: generation runs in eval mode) of the row's
    player, through the stacked adapters and the row mask; a row of no adapter here gets none.

    Raises:
        RuntimeError: naming the row counts, for an input whose rows are neither the prompts' nor the samples'.
    """
    a, b, masks = module._row_adapter
    mask = masks.get(x.shape[0])
    if mask is None:
        raise RuntimeError(f"row adapters: an input of {x.shape[0]} rows, set for {sorted(masks)} rows")
    h = F.linear(x.to(a.dtype), a)  # every player's A on every row: [N, ..., Σr]
    h = h * mask.view(mask.shape[0], *([1] * (h.dim() - 2)), mask.shape[1])
    out += F.linear(h, b).to(out.dtype)
    return out
