"""Command line of :mod:`alignment_games.modules.evaluation.round_robin` (``python -m`` this module)."""

from __future__ import annotations

import argparse
import itertools
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

from alignment_games.modules.evaluation import round_robin as library
from alignment_games.modules.evaluation.audit import describe_models, problem_rows, write_report
from alignment_games.modules.evaluation.round_robin import (
    PLAYER_OF_FAMILY,
    REFERENCE,
    adapter_tensors,
    markdown_table,
    round_robin_table,
)
from alignment_games.modules.lm.base_identity import base_identity
from alignment_games.modules.lm.sampling import Sampling

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


def _parse_runs(specs: Sequence[str]) -> list[tuple[str, str, str | None]]:
    runs = []
    for spec in specs:
        name, sep, rest = spec.partition("=")
        if not sep or not rest:
            raise ValueError(f"--runs entry {spec!r} must be NAME=CHECKPOINT[:PLAYER]")
        if not _NAME.match(name) or name == REFERENCE:
            raise ValueError(f"--runs name {name!r} must be a letter then letters, digits or _, and not {REFERENCE!r}")
        path, player = rest, None
        if ":" in rest and not os.path.exists(rest):
            path, player = rest.rsplit(":", 1)
        runs.append((name, path, player))
    if len({r[0] for r in runs}) != len(runs):
        raise ValueError(f"--runs names must be distinct, got {[r[0] for r in runs]}")
    return runs


def _load_runs(bank: Any, runs: list[tuple[str, str, str | None]]) -> dict[str, str]:
    """Load each run's adapter into ``bank`` (tensors only); the player each came from."""
    from alignment_games.modules.checkpoints.trust import checkpoint_family, read_checkpoint

    own = bank.state_dict()
    players = {}
    for name, path, player in runs:
        ckpt, where = read_checkpoint(path), f"checkpoint {path!r} of run {name!r}"
        family = checkpoint_family(ckpt)
        if player is None and family not in PLAYER_OF_FAMILY:
            raise ValueError(
                f"{where} was written by {family!r}; give its player as {name}={path}:PLAYER "
                f"(known families: {sorted(PLAYER_OF_FAMILY)})"
            )
        player = PLAYER_OF_FAMILY[family] if player is None else player
        if not isinstance(state := ckpt.get("state_dict"), dict):
            raise ValueError(f"{where} holds no state_dict")
        tensors = adapter_tensors(state, player, name, where)
        expected = {k for k in own if f".{name}." in k and ".lora_" in k}
        if set(tensors) != expected:
            missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
            raise ValueError(
                f"{where} does not fit --lm/--lora-* (--lora-target-modules must be the run's lm.lora_target_modules): "
                f"missing {missing[:3]}, unexpected {extra[:3]}"
            )
        if (bad := next((k for k, v in tensors.items() if v.shape != own[k].shape), None)) is not None:
            shapes = f"{list(tensors[bad].shape)} but {list(own[bad].shape)}"
            raise ValueError(f"{where}: {bad!r} has shape {shapes} here (--lora-r must be the run's lora_r)")
        bank.load_state_dict(tensors, strict=False)
        players[name] = player
    return players


def _sample_all(bank: Any, policies: list[str], prompts: list[str], args: argparse.Namespace) -> dict[str, list[str]]:
    chats = [bank.chat(args.system_prompt, x) for x in prompts]
    sampling = Sampling(args.temperature, args.top_p, args.max_new_tokens)
    texts: dict[str, list[str]] = {p: [] for p in policies}
    for i in range(0, len(chats), args.batch_size):
        chunk = chats[i : i + args.batch_size]
        for p in policies:
            texts[p] += bank.generate(None if p == REFERENCE else p, chunk, args.pairs, sampling).texts
    return texts


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m alignment_games.commands.round_robin", description=library.__doc__.split("\n")[0]
    )
    p.add_argument("--runs", nargs="+", required=True, help="NAME=CHECKPOINT[:PLAYER], e.g. smida=runs/.../last.ckpt")
    p.add_argument("--lm", required=True, help="the frozen base every run was trained from (artifacts/tiny_policy)")
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-alpha", type=int, default=16)
    p.add_argument("--lora-target-modules", nargs="+", help="the runs' lm.lora_target_modules (default: peft's)")
    p.add_argument("--no-reference", action="store_true", help="leave the reference policy out of the table")
    p.add_argument("--num-prompts", type=int, default=1000, help="generated problems (PromptDataModule)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="held-out share; the table uses these prompts")
    p.add_argument("--data-seed", type=int, default=0, help="the training configs' seed keeps the same held-out set")
    p.add_argument("--max-prompts", type=int, default=0, help="use the first N held-out prompts (0: all)")
    p.add_argument("--pairs", type=int, default=1, help="answers per prompt and policy (pairs compared per prompt)")
    p.add_argument("--oracle-queries", type=int, default=11, help="oracle queries per pair (the paper's 11)")
    p.add_argument("--oracle-beta", type=float, default=10.0, help="ProgrammaticOracle's beta")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--system-prompt", default="You are a helpful assistant.")
    p.add_argument("--batch-size", type=int, default=16, help="prompts per generate call")
    p.add_argument("--n-boot", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0, help="sampling, oracle and bootstrap seed")
    p.add_argument("--out", default="runs/round_robin", help="folder for round_robin.json and round_robin.md")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the round robin from command-line arguments; returns what ``round_robin.json`` holds.

    Raises:
        ValueError: for a malformed ``--runs`` entry, a checkpoint that does not fit, or bad counts.
    """
    import lightning as L

    from alignment_games.datamodules.prompts import PromptDataModule
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.policy_bank import PolicyBank
    from alignment_games.modules.scorers.oracle import ProgrammaticOracle

    args = _parser().parse_args(argv)
    for field in ("pairs", "oracle_queries", "batch_size", "n_boot"):
        if getattr(args, field) < 1:
            raise ValueError(f"--{field.replace('_', '-')} must be at least 1, got {getattr(args, field)}")
    runs = _parse_runs(args.runs)
    base = base_identity(args.lm)
    records = describe_models([path for _, path, _ in runs], base, "--runs")  # duplicates, other bases
    start = time.perf_counter()
    L.seed_everything(args.seed, verbose=False)
    lora = {k: getattr(args, k) for k in ("lora_r", "lora_alpha", "lora_target_modules")}
    bank = PolicyBank(ModelConfig(args.lm, players="lora", **lora), players=[r[0] for r in runs])
    bank.eval().requires_grad_(False)
    players = _load_runs(bank, runs)
    dm = PromptDataModule(num_prompts=args.num_prompts, val_fraction=args.val_fraction, seed=args.data_seed)
    dm.setup("validate")
    rows = dm.splits["val"][: args.max_prompts or None]
    if not rows:
        raise ValueError("no held-out prompts: raise --num-prompts or --val-fraction")
    prompts, refs = [r["prompt"] for r in rows], [r["reference"] for r in rows]
    policies = [r[0] for r in runs] + ([] if args.no_reference else [REFERENCE])
    texts = _sample_all(bank, policies, prompts, args)
    oracle = ProgrammaticOracle(beta=args.oracle_beta, num_queries=args.oracle_queries, seed=args.seed)
    xs = [x for x in prompts for _ in range(args.pairs)]
    rs = [x for x in refs for _ in range(args.pairs)]
    labels = {
        (a, b): oracle.label(xs, texts[a], texts[b], rs).view(len(prompts), args.pairs)
        for a, b in itertools.combinations(policies, 2)
    }
    table = round_robin_table(labels, policies, n_boot=args.n_boot, seed=args.seed)
    table.update(
        runs={
            name: {"checkpoint": r.pop("path"), "player": players[name], **r} for (name, _, _), r in zip(runs, records)
        },
        lm=args.lm,
        lm_identity=base,
        data={"num_prompts": args.num_prompts, "val_fraction": args.val_fraction, "seed": args.data_seed},
        oracle={
            "class": "ProgrammaticOracle",
            "num_queries": args.oracle_queries,
            "beta": args.oracle_beta,
            "unlabelled_rows": oracle.unlabelled_rows,
        },
        sampling={"temperature": args.temperature, "top_p": args.top_p, "max_new_tokens": args.max_new_tokens},
        seed=args.seed,
        wall_s=round(time.perf_counter() - start, 1),
    )
    os.makedirs(args.out, exist_ok=True)
    rates = {f"{a}>{b}": lab.nanmean(dim=1).tolist() for (a, b), lab in labels.items()}  # each prompt's pairs
    rows = problem_rows(prompts, refs, rates, "preferred")
    inputs = {"--lm": args.lm, "--runs": [path for _, path, _ in runs]}
    write_report(table, os.path.join(args.out, "round_robin.json"), rows, inputs)
    with open(os.path.join(args.out, "round_robin.md"), "w") as f:
        f.write(markdown_table(table))
    print(markdown_table(table))
    return table


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"round_robin: {e}")
