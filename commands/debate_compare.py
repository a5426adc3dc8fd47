"""Command line of :mod:`alignment_games.modules.evaluation.debate_compare` (``python -m`` this module)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from alignment_games.modules.evaluation import debate_compare as library
from alignment_games.modules.evaluation.audit import provenance
from alignment_games.modules.evaluation.debate_compare import (
    compare_groups,
    evaluations_file,
    format_table,
    load_evaluations,
)
from alignment_games.modules.training.artifacts import atomic_write_text


def _parse_group(spec: str) -> tuple[str, list[str]]:
    if "=" not in spec:
        raise argparse.ArgumentTypeError(f"expected NAME=RUN[,RUN...], got {spec!r}")
    name, runs = spec.split("=", 1)
    return name.strip(), [r for r in runs.split(",") if r.strip()]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command line: ``--group NAME=RUN,RUN ... [--upper NAME=RUN] [--baseline NAME] [--out FILE]``."""
    ap = argparse.ArgumentParser(description=library.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", action="append", type=_parse_group, required=True, help="NAME=RUN[,RUN...]")
    ap.add_argument("--upper", type=_parse_group, default=None, help="the upper-bound group (RLVR): NAME=RUN[,...]")
    ap.add_argument("--baseline", default=None, help="name of the baseline group (RLAIF-A) for the gap recovery")
    ap.add_argument("--window", type=int, default=3)
    ap.add_argument("--quantile", type=float, default=0.025)
    ap.add_argument("--draws", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="debate_compare.json", help="JSON file to write")
    args = ap.parse_args(argv)
    specs = list(args.group) + ([args.upper] if args.upper else [])
    names = [n for n, _ in specs]
    if len(set(names)) != len(names):
        raise SystemExit(f"group names must be distinct, got {names}")
    groups = {name: [load_evaluations(r) for r in runs] for name, runs in specs}
    settings = {k: getattr(args, k) for k in ("baseline", "window", "quantile", "draws", "seed")}
    result = compare_groups(groups, upper=args.upper[0] if args.upper else None, **settings)
    result["runs"] = dict(specs)
    result["provenance"] = provenance({name: [evaluations_file(r) for r in runs] for name, runs in specs})
    print(format_table(result))
    atomic_write_text(args.out, json.dumps(result, indent=2))
    print(f"written to {args.out}")
    return result


if __name__ == "__main__":
    main()
