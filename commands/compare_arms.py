"""``python -m alignment_games.commands.compare_arms``: arms of a study compared on the same held-out problems.

Each arm is an ``accuracy_gain`` report (``--out``) over the same problems and base. Per arm: its accuracy with the
three intervals of :func:`alignment_games.modules.evaluation.intervals.seed_intervals` (null: the base's accuracy);
against the first arm, the difference paired seed by seed (a seed's runs share their data), with the same intervals.

    python -m alignment_games.commands.compare_arms exp3=exp3.json uniform=uniform.json single=single.json --out c.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

import torch

from alignment_games.modules.evaluation.audit import provenance
from alignment_games.modules.evaluation.intervals import seed_intervals
from alignment_games.modules.training.artifacts import atomic_write_text


def rows_file(path: str) -> str:
    """The per-problem file an ``accuracy_gain`` report at ``path`` names (beside it)."""
    with open(path) as f:
        return os.path.join(os.path.dirname(path), json.load(f)["per_problem"]["file"])


def load_arm(path: str) -> tuple[torch.Tensor, list[bool], list[str], int]:
    """An arm's ``[seeds, problems]`` accuracy, the base's results, the problems' sha256 and the players per seed.

    Raises:
        SystemExit: naming the file when the per-problem file is missing, altered or does not fit the report.
    """
    with open(path) as f:
        report = json.load(f)
    rows_path = rows_file(path)
    with open(rows_path, "rb") as f:
        text = f.read()
    if hashlib.sha256(text).hexdigest() != report["per_problem"]["sha256"]:
        raise SystemExit(f"{rows_path}: its sha256 is not the one {path} records (altered or another run's)")
    rows = [json.loads(line) for line in text.decode().splitlines()]
    trained, seeds = len(report["trained"]), len(report["per_seed"])
    m = trained // seeds
    names = [f"trained[{i}]" for i in range(trained)]
    if any(sorted(r["correct"]) != sorted(["base", *names]) for r in rows):
        raise SystemExit(f"{rows_path}: rows do not hold the base and the {trained} trained models of {path}")
    solved = torch.tensor([[float(r["correct"][n]) for r in rows] for n in names], dtype=torch.float64)
    base = [r["correct"]["base"] for r in rows]
    return solved.view(seeds, m, len(rows)).mean(dim=1), base, [r["sha256"] for r in rows], m


def compare(arms: dict[str, str], n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    """The comparison of ``{name: report path}`` (the first arm is the baseline of the differences).

    Raises:
        SystemExit: naming the arm whose problems, base results or number of seeds differ from the first arm's.
    """
    loaded = {name: load_arm(path) for name, path in arms.items()}
    name0, (acc0, base0, problems0, _) = next(iter(loaded.items()))
    out: dict[str, Any] = {"problems": len(problems0), "baseline": name0, "base": sum(base0) / len(base0), "arms": {}}
    for name, (acc, base, problems, m) in loaded.items():
        if problems != problems0 or base != base0:
            raise SystemExit(f"arm {name}: other problems or base results than arm {name0} ({arms[name]})")
        arm = {"report": arms[name], "seeds": len(acc), "players_per_seed": m, "accuracy": float(acc.mean())}
        arm["accuracy_intervals"] = seed_intervals(acc, n_boot, seed, null=out["base"])
        arm["per_seed"] = acc.mean(dim=1).tolist()
        if name != name0:
            if len(acc) != len(acc0):
                raise SystemExit(f"arm {name}: {len(acc)} seeds against {len(acc0)} of arm {name0}: none to pair")
            arm["difference"] = float((acc - acc0).mean())
            arm["difference_intervals"] = seed_intervals(acc - acc0, n_boot, seed)
        out["arms"][name] = arm
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Command line: print (and with ``--out`` write) the comparison as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("arms", nargs="+", help="NAME=accuracy_gain report, the baseline first")
    parser.add_argument("--n-boot", type=int, default=2000)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    pairs = [a.partition("=") for a in args.arms]
    if len(pairs) < 2 or any(not name or not path for name, _, path in pairs):
        raise SystemExit(f"give at least two arms as NAME=report.json, got {args.arms}")
    if len({name for name, _, _ in pairs}) != len(pairs):
        raise SystemExit(f"arm names repeat: {args.arms}")
    arms = {name: path for name, _, path in pairs}
    result = compare(arms, args.n_boot)
    inputs = arms | {f"{name} rows": rows_file(path) for name, path in arms.items()}
    result["provenance"] = provenance(inputs)
    text = json.dumps(result, indent=2)
    if args.out:
        atomic_write_text(args.out, text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
