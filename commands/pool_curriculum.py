"""Command line of :mod:`alignment_games.modules.evaluation.pool_curriculum` (``python -m`` this module)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import yaml

from alignment_games.modules.evaluation import pool_curriculum as library
from alignment_games.modules.evaluation.audit import provenance
from alignment_games.modules.evaluation.pool_curriculum import (
    DATA_FIELDS,
    feature_extremes,
    history_file,
    load_weights,
    pool_operations,
    sharpening,
)
from alignment_games.modules.training.artifacts import atomic_write_text


def _data_settings(run: str) -> dict[str, Any] | None:
    """The data section of the run's saved ``config.yaml`` when it is a generated pool; ``None`` otherwise."""
    file = os.path.join(run, "config.yaml")
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        config = yaml.safe_load(f)  # plain values only: nothing in it is imported or run
    data = config.get("data") if isinstance(config, dict) else None
    args = data.get("init_args", data) if isinstance(data, dict) else None
    if not isinstance(args, dict):
        return None  # not a pool run's saved config: the sharpening alone is reported
    source = args.get("source") or {}
    if isinstance(source, dict) and (source.get("path") or source.get("hub")):
        return None
    return {k: args[k] for k in DATA_FIELDS if k in args}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command line: ``--run NAME=RUN_FOLDER ... [--top 5] [--feature-top 20] [--out FILE]``."""
    ap = argparse.ArgumentParser(description=library.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", required=True, help="NAME=RUN_FOLDER (holding pool_history.json)")
    ap.add_argument("--top", type=int, default=5, help="instructions in the top and bottom sets of the sharpening")
    ap.add_argument("--feature-top", type=int, default=20, help="instructions whose operation counts are compared")
    ap.add_argument("--out", default="pool_curriculum.json", help="JSON file to write")
    args = ap.parse_args(argv)
    result: dict[str, Any] = {}
    inputs: dict[str, str | None] = {}
    for spec in args.run:
        name, sep, run = spec.partition("=")
        if not sep or not name or not run:
            raise SystemExit(f"--run takes NAME=RUN_FOLDER, got {spec!r}")
        weights = load_weights(run)
        inputs[name] = history_file(run)
        entry: dict[str, Any] = {"run": run, "sharpening": sharpening(weights, args.top)}
        data, config = _data_settings(run), os.path.join(run, "config.yaml")  # neither for a history file
        inputs[f"{name} config"] = config if os.path.isfile(config) else None
        last = entry["sharpening"][-1]
        line = f"{name}: iteration {last['iteration']}: top {args.top} {last['top']:.2f}x, bottom {last['bottom']:.2f}x"
        if data is not None:
            ops = pool_operations(data)
            if len(ops) != len(weights[-1]):
                raise ValueError(f"{run}: {len(weights[-1])} weights but the rebuilt pool has {len(ops)} instructions")
            o = entry["operations"] = feature_extremes(weights[-1], ops, min(args.feature_top, len(ops) // 2))
            line += f"; operations top {o['top']:.2f}, bottom {o['bottom']:.2f}, all {o['all']:.2f}"
        result[name] = entry
        print(line)
    if "provenance" in result:
        raise SystemExit("--run: 'provenance' is the report's own key; name the run otherwise")
    result["provenance"] = provenance(inputs)
    atomic_write_text(args.out, json.dumps(result, indent=2))
    print(f"written to {args.out}")
    return result


if __name__ == "__main__":
    main()
