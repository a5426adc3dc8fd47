"""``python -m alignment_games.commands.ifeval``: command line of :mod:`alignment_games.modules.evaluation.ifeval`."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any

from alignment_games.modules.evaluation import ifeval as library
from alignment_games.modules.evaluation.audit import describe_models, provenance
from alignment_games.modules.evaluation.ifeval import load_policy, paired_difference, read_ifeval, score_responses
from alignment_games.modules.lm.base_identity import base_identity
from alignment_games.modules.training.artifacts import atomic_write_text


def _policy_arg(text: str) -> tuple[str, str]:
    name, sep, folder = text.partition("=")
    if not sep or not name or not folder:
        raise argparse.ArgumentTypeError(f"--policy takes NAME=FOLDER, got {text!r}")
    return name, folder


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Command line: score one or two exported policies on an IFEval jsonl; print and write the report as JSON."""
    from alignment_games.modules.evaluation.policy_accuracy import greedy_replies
    from alignment_games.modules.lm.prompts import QWEN_SYSTEM

    parser = argparse.ArgumentParser(description=library.__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="IFEval-format jsonl (key, prompt, instruction_id_list, kwargs)")
    parser.add_argument(
        "--policy", nargs="+", required=True, type=_policy_arg, help="NAME=FOLDER, one or two (first − second)"
    )
    parser.add_argument("--base", help="the base of adapter folders (default: the one each adapter_config names)")
    parser.add_argument("--system-prompt", default=QWEN_SYSTEM)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--limit", type=int, help="only the first N prompts (a quick look)")
    parser.add_argument("--n-boot", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0, help="seed of the bootstrap")
    parser.add_argument("--out", help="also write the report here (written whole, at the end)")
    args = parser.parse_args(argv)
    names = [n for n, _ in args.policy]
    if len(args.policy) > 2 or len(set(names)) != len(names):
        parser.error(f"--policy takes one or two policies with distinct names, got {names}")
    for name in ("--max-new-tokens", "--batch-size", "--limit"):
        if (v := getattr(args, name[2:].replace("-", "_"))) is not None and v < 1:
            parser.error(f"{name} must be at least 1, got {v}")
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        parser.error(f"--out: the folder of {args.out!r} does not exist")
    rows = read_ifeval(args.data)[: args.limit]  # every row checked before any generation
    prompts = [r["prompt"] for r in rows]
    base = base_identity(args.base) if args.base else None
    records = describe_models([folder for _, folder in args.policy], base, "--policy")  # duplicates, other bases
    settings = {"base": args.base, "base_identity": base, "system_prompt": args.system_prompt}
    settings |= {"max_new_tokens": args.max_new_tokens, "decoding": "greedy"}
    report: dict[str, Any] = {"data": args.data, "settings": settings, "policies": {}}
    for (name, folder), record in zip(args.policy, records):
        model, tokenizer = load_policy(folder, args.base)
        replies = greedy_replies(model, tokenizer, prompts, args.system_prompt, args.max_new_tokens, args.batch_size)
        report["policies"][name] = {"folder": folder, **record, **score_responses(rows, replies)}
        del model
    if len(names) == 2:
        difference = paired_difference(*(report["policies"][n] for n in names), args.n_boot, args.seed)
        report["comparison"] = {"first": names[0], "second": names[1]} | difference
    inputs: dict[str, Any] = {"--data": args.data, "--base": args.base}
    for (name, folder), record in zip(args.policy, records):
        inputs[name] = folder
        adapter_base = (record["base_identity"] or {}).get("name_or_path")  # loaded when --base is not given
        if args.base is None and os.path.isfile(os.path.join(folder, "adapter_config.json")) and adapter_base:
            inputs[f"{name} base"] = adapter_base
    report["provenance"] = provenance(inputs)
    text = json.dumps(report, indent=2)
    print(json.dumps({n: p["accuracy"] for n, p in report["policies"].items()}, indent=2))
    if args.out:  # whole or not at all: a kill mid-write leaves any earlier report as it was
        atomic_write_text(args.out, text + "\n")
    return report


if __name__ == "__main__":
    main()
