"""Round-robin oracle preference rates between trained policies and the reference (App. G.4, Table 4)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from alignment_games.modules.evaluation.game_eval import interval_ends, resample_prompts

#: which player of a checkpoint's family is compared (the Leaders, as in Table 4; NLHF's one policy)
PLAYER_OF_FAMILY = {
    "alignment_games.modules.deep_smida.DeepSMIDA": "leader",
    "alignment_games.modules.slhf.SLHF": "leader",
    "alignment_games.modules.nlhf.NashMDPG": "policy",
}
REFERENCE = "reference"


def round_robin_table(
    labels: dict[tuple[str, str], Tensor], names: Sequence[str], n_boot: int = 1000, seed: int = 0, level: float = 0.95
) -> dict[str, Any]:
    """Pairwise preference rates with prompt-bootstrap intervals, every cell from the same resamples.

    ``labels[(a, b)]`` ``[P, R]``: the oracle's preference of ``a`` over ``b`` (NaN: unlabelled); a cell is the mean
    over prompts of their labelled pairs' mean, and ``(b, a)`` is ``1 − (a, b)``.

    Raises:
        ValueError: for a pair given twice or not at all, an unknown name, or tensors not ``[P, R]`` on the same P.
    """
    names = list(names)
    if len(set(names)) != len(names) or len(names) < 2:
        raise ValueError(f"names must be at least two distinct policies, got {names}")
    pairs = list(itertools.combinations(names, 2))
    given = set(labels)
    for a, b in given:
        if a not in names or b not in names or a == b:
            raise ValueError(f"labels hold the pair ({a!r}, {b!r}), which is not two of {names}")
    for a, b in pairs:
        if ((a, b) in given) == ((b, a) in given):
            raise ValueError(f"labels must hold the pair {a!r}, {b!r} exactly once (either order)")
    shapes = {k: tuple(v.shape) for k, v in labels.items()}
    if any(len(s) != 2 for s in shapes.values()) or len({s[0] for s in shapes.values()}) != 1:
        raise ValueError(f"every label tensor must be [prompts, pairs] over the same prompts, got {shapes}")
    n, r = next(iter(shapes.values()))
    idx = resample_prompts(n, n_boot, seed)
    q = interval_ends(level)
    rates: dict[str, dict[str, Any]] = {a: {} for a in names}
    for a, b in pairs:
        flip = (a, b) not in given
        v = labels[(b, a) if flip else (a, b)].double()
        v = 1.0 - v if flip else v
        valid = ~torch.isnan(v)
        count = valid.sum(dim=1)
        per_prompt = torch.where(valid, v, 0.0).sum(dim=1) / count.clamp(min=1)
        keep = (count > 0).double()
        if keep.sum() == 0:
            cell = {"rate": math.nan, "ci": [math.nan, math.nan], "n_prompts": 0}
        else:
            rate = float((per_prompt * keep).sum() / keep.sum())
            boot = (per_prompt[idx] * keep[idx]).sum(dim=1) / keep[idx].sum(dim=1)  # NaN when a resample has none
            lo, hi = torch.nanquantile(boot, q).tolist()
            cell = {"rate": rate, "ci": [lo, hi], "n_prompts": int(keep.sum())}
        rates[a][b] = cell
        rates[b][a] = cell | {"rate": 1.0 - cell["rate"], "ci": [1.0 - cell["ci"][1], 1.0 - cell["ci"][0]]}
    return {"names": names, "n_prompts": n, "pairs_per_prompt": r, "level": level, "n_boot": n_boot, "rates": rates}


def markdown_table(table: dict[str, Any]) -> str:
    """Rows: the preferred policy; columns: its opponent; cells ``rate [lo, hi]`` (4 decimals)."""
    names = table["names"]
    lines = ["| row ≻ column | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for a in names:
        cells = [
            "—" if a == b else "{rate:.4f} [{ci[0]:.4f}, {ci[1]:.4f}]".format(**table["rates"][a][b]) for b in names
        ]
        lines.append(f"| {a} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def adapter_tensors(state: dict[str, Tensor], player: str, run: str, source: str) -> dict[str, Tensor]:
    """A checkpoint's LoRA tensors of ``player`` renamed to the round robin's adapter ``run`` (bank state names).

    Raises:
        ValueError: naming ``source`` when it holds no LoRA tensors of ``player``.
    """
    marker = f".{player}."
    out = {
        name[len("players.") :].replace(marker, f".{run}."): value
        for name, value in state.items()
        if name.startswith("players.model.") and marker in name and ".lora_" in name
    }
    if not out:
        raise ValueError(
            f"{source} holds no LoRA adapter tensors of player {player!r} (only LoRA-player checkpoints, "
            "players: lora, can be compared here)"
        )
    return out
