"""Command line of :mod:`alignment_games.modules.evaluation.policy_accuracy` (``python -m`` this module)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from alignment_games.modules.evaluation import policy_accuracy as library
from alignment_games.modules.evaluation.audit import provenance, write_report
from alignment_games.modules.evaluation.policy_accuracy import policy_accuracy


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Command line: print (and with ``--out`` write) :func:`policy_accuracy`'s report as JSON."""
    parser = argparse.ArgumentParser(description=library.__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="folder of the saved policy")
    parser.add_argument("--num-problems", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1_000_003, help="default: the games' held-out prompts")
    parser.add_argument("--min-steps", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--system-prompt", default="You are a helpful assistant.")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", help="also write the report here, and each problem's result beside it")
    args = parser.parse_args(argv)
    report = policy_accuracy(args.model, **{k: v for k, v in vars(args).items() if k not in ("model", "out")})
    rows = report.pop("problems")
    if args.out:
        write_report(report, args.out, rows, {"--model": args.model})
    else:
        report["provenance"] = provenance({"--model": args.model})
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
