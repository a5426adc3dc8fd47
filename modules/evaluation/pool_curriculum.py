"""The pool leader's curriculum from runs' ``pool_history.json``: how it sharpens, and which instructions it favours.

Per iteration, the top and bottom instructions' mean weight against uniform (Fig. 5); at the end, for a generated
pool (rebuilt from ``config.yaml``'s data numbers), the mean operation count of the most and least likely ones.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

from alignment_games.modules.algorithms.checks import require_in_range
from alignment_games.modules.algorithms.pool import weight_extremes

#: the data settings a generated pool is rebuilt from (InstructionPoolDataModule's), with their defaults
DATA_FIELDS = {"num_problems": 200, "val_fraction": 0.2, "seed": 0, "generation_seed_offset": 2_000_003}


def history_file(path: str) -> str:
    """The file a pool run's history is read from: ``path``'s ``pool_history.json`` for a run folder, else ``path``."""
    return os.path.join(path, "pool_history.json") if os.path.isdir(path) else path


def load_weights(path: str) -> list[list[float]]:
    """The leader's distribution per iteration (row 0: before the first update) from a run folder or the JSON file.

    Raises:
        FileNotFoundError: naming the path when there is no ``pool_history.json``.
        ValueError: naming the file and row when the weights are missing, ragged, negative or not finite.
    """
    file = history_file(path)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path!r}: no pool_history.json (a pool run writes it at the end of fit)")
    with open(file) as f:
        record = json.load(f)
    weights = record.get("weights") if isinstance(record, dict) else None
    if not isinstance(weights, list) or not weights:
        raise ValueError(f"{file}: no 'weights' list of the leader's distributions")
    k = len(weights[0]) if isinstance(weights[0], list) else 0
    for i, row in enumerate(weights):
        if not isinstance(row, list) or len(row) != k or k == 0:
            raise ValueError(f"{file}: weights row {i} is not a list of {k or 'some'} probabilities")
        if not all(isinstance(p, (int, float)) and math.isfinite(p) and p >= 0 for p in row):
            raise ValueError(f"{file}: weights row {i} holds a negative or non-finite probability")
    return [[float(p) for p in row] for row in weights]


def sharpening(weights: Sequence[Sequence[float]], n: int = 5) -> list[dict[str, float]]:
    """Per iteration, the top-``n`` and bottom-``n`` mean weights against uniform (both 1.0 for a uniform leader)."""
    extremes = [weight_extremes(row, n) for row in weights]
    return [{"iteration": i, "top": top, "bottom": bottom} for i, (top, bottom) in enumerate(extremes)]


def feature_extremes(probs: Sequence[float], feature: Sequence[float], n: int) -> dict[str, float]:
    """The mean ``feature`` of the ``n`` most and least likely instructions (ties by position), and over all.

    Raises:
        ValueError: for lengths that differ or ``n`` outside ``[1, K // 2]``.
    """
    if len(probs) != len(feature):
        raise ValueError(f"{len(probs)} probabilities for {len(feature)} feature values")
    require_in_range("n", n, 1, len(probs) // 2)
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    mean = lambda idx: sum(feature[i] for i in idx) / len(idx)  # noqa: E731
    return {"top": mean(order[:n]), "bottom": mean(order[-n:]), "all": mean(range(len(probs)))}


def pool_operations(data: dict[str, Any]) -> list[int]:
    """The operation count of each instruction of the generated pool that ``data`` rebuilds, in the leader's order."""
    from alignment_games.datamodules.pool import InstructionPoolDataModule
    from alignment_games.modules.algorithms.arithmetic import generate_problems

    settings = {k: data.get(k, v) for k, v in DATA_FIELDS.items()}
    for k, v in settings.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"data.{k} must be a number, got {v!r}")
    dm = InstructionPoolDataModule(**settings)
    dm.setup("fit")
    seed = int(settings["seed"] + settings["generation_seed_offset"])
    ops = {p.question: len(p.ops) for p in generate_problems(int(settings["num_problems"]), seed=seed)}
    return [ops[r["prompt"]] for r in dm.splits["train"]]
