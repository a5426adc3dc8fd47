"""Command line of :mod:`alignment_games.modules.evaluation.accuracy_gain` (``python -m`` this module)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from alignment_games.datamodules.debate import single_step_problems
from alignment_games.datamodules.prompts import PromptSource
from alignment_games.modules.algorithms.answers import answers_match
from alignment_games.modules.algorithms.arithmetic import generate_problems
from alignment_games.modules.evaluation import accuracy_gain as library
from alignment_games.modules.evaluation.accuracy_gain import HELD_OUT_SEED, final_answers, paired_gain, seed_mean_gain
from alignment_games.modules.evaluation.audit import describe_models, problem_rows, provenance, write_report
from alignment_games.modules.lm.base_identity import base_identity, file_sha256


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Command line: print (and with ``--out`` write, with the per-problem rows beside) the gains as JSON."""
    parser = argparse.ArgumentParser(description=library.__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the policy the games started from")
    parser.add_argument("--trained", nargs="+", required=True, help="one trained policy per seed")
    parser.add_argument("--num-problems", type=int, default=400)
    parser.add_argument("--seed", type=int, default=HELD_OUT_SEED, help="default: problems no game trains on")
    parser.add_argument(
        "--problems",
        choices=("arithmetic", "single_step", "file"),
        default="arithmetic",
        help="as the games' data generates, or the first --num-problems rows of --data",
    )
    parser.add_argument("--min-steps", type=int, default=2, help="arithmetic: default the games' 2-4 operations")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--max-operand", type=int, default=9, help="single_step: largest operand")
    parser.add_argument("--data", help="file: a local jsonl/json/parquet/csv table (e.g. GSM8K's test split)")
    parser.add_argument("--prompt-column", default="question", help="file: the prompt's column")
    parser.add_argument("--reference-column", default="answer", help="file: the reference's column")
    parser.add_argument("--reference-format", default="gsm8k", help="file: plain, gsm8k (after ####) or boxed")
    parser.add_argument("--system-prompt", default="You are a helpful assistant.")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--players-per-seed", type=int, default=1, help="consecutive trained folders of one seed")
    parser.add_argument("--out", help="also write the report here, and each problem's results beside it")
    args = parser.parse_args(argv)
    if args.num_problems < 1:
        raise SystemExit(f"--num-problems must be at least 1, got {args.num_problems}")
    m = args.players_per_seed
    if m < 1 or len(args.trained) % m:
        raise SystemExit(f"--players-per-seed {m}: the {len(args.trained)} trained folders are not groups of {m}")
    base = base_identity(args.base)
    records = describe_models(args.trained, base, "--trained")  # before any generation: duplicates, other bases
    if args.problems == "arithmetic":
        problems = generate_problems(args.num_problems, args.seed, args.min_steps, args.max_steps)
        prompts, refs = [p.question for p in problems], [str(p.answer) for p in problems]
        drawn = {"kind": "arithmetic", "steps": [args.min_steps, args.max_steps]}
    elif args.problems == "single_step":
        rows = single_step_problems(args.num_problems, args.seed, args.max_operand)
        prompts, refs = [r["prompt"] for r in rows], [r["reference"] for r in rows]
        drawn = {"kind": "single_step", "max_operand": args.max_operand}
    else:
        prompts, refs, drawn = file_problems(args)
    models = {"base": args.base} | {f"trained[{i}]": path for i, path in enumerate(args.trained)}
    answers = {k: final_answers(path, prompts, args.system_prompt, args.max_new_tokens) for k, path in models.items()}
    correct = {name: [answers_match(a, r) for a, r in zip(given, refs)] for name, given in answers.items()}
    before, after = correct["base"], list(correct.values())[1:]
    gains = [  # each player's gain, its bootstrap seeded by the index of its seed's first player
        {"model": path, **paired_gain(before, a, seed=i - i % m)}
        for i, (path, a) in enumerate(zip(args.trained, after))
    ]
    per_seed = gains
    if m > 1:  # a seed's gain: its players' mean, with each player's own gain beside it
        per_seed = [
            {"players": gains[i : i + m], **seed_mean_gain(before, after[i : i + m], seed=i, players_per_seed=m)}
            for i in range(0, len(after), m)
        ]
    report: dict[str, Any] = {
        "base": base,
        "trained": records,
        "problems": {"n": args.num_problems, "seed": args.seed, **drawn},
        "per_seed": per_seed,
        # the share of replies with a final \boxed{} at all: what of a gain is the format, not the answer
        "answered": {name: sum(a is not None for a in given) / len(given) for name, given in answers.items()},
    }
    if len(per_seed) > 1:  # the headline: seeds and problems resampled
        report["across_seeds"] = seed_mean_gain(before, after, players_per_seed=m)
    inputs = {"--base": args.base, "--trained": args.trained, "--data": args.data if drawn["kind"] == "file" else None}
    if args.out:
        per_problem = problem_rows(prompts, refs, correct)
        for i, row in enumerate(per_problem):
            row["answer"] = {name: given[i] for name, given in answers.items()}
        write_report(report, args.out, per_problem, inputs)
    else:
        report["provenance"] = provenance(inputs)
    print(json.dumps(report, indent=2))
    return report


def file_problems(args: argparse.Namespace) -> tuple[list[str], list[str], dict[str, Any]]:
    """The first ``--num-problems`` rows of ``--data``: prompts, references and what identifies them (the file's hash).

    Raises:
        SystemExit: without ``--data``, with fewer rows than asked, or naming the first row without a reference.
    """
    if args.data is None:
        raise SystemExit("--problems file needs --data (the table to read)")
    settings = {k: getattr(args, k) for k in ("prompt_column", "reference_column", "reference_format")}
    rows = PromptSource(path=args.data, **settings).load()[: args.num_problems]
    if len(rows) < args.num_problems:
        raise SystemExit(f"--data {args.data} has {len(rows)} rows, fewer than --num-problems {args.num_problems}")
    missing = [i for i, r in enumerate(rows) if r["reference"] is None]
    if missing:
        raise SystemExit(f"--data {args.data}: row {missing[0]} has no {args.reference_format} reference")
    columns = dict(zip(("prompt", "reference", "format"), settings.values()))
    drawn = {"kind": "file", "path": args.data, "sha256": file_sha256(args.data), "columns": columns}
    return [r["prompt"] for r in rows], [r["reference"] for r in rows], drawn


if __name__ == "__main__":
    main()
