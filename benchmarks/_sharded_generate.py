"""What the sharded-generation benchmarks share (``zero3_generate.py``, ``fsdp2_generate.py``): the policy, the
command line, running a worker on two CPU processes that hands rank 0's result back, timing ``generate`` under each
gathering mode, and the printed table."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

POLICY = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4}


def parse_args(doc: str, workdir: str) -> argparse.Namespace:
    """``--rows``, ``--tokens``, ``--repeats``, ``--threads``, ``--workdir`` (default ``/tmp/<workdir>``)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8, help="prompts per generate call")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per reply (greedy)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="threads per process")
    ap.add_argument("--workdir", default=os.path.join("/tmp", workdir))
    return ap.parse_args()


def run_on_two_processes(worker: Callable[..., None], args: argparse.Namespace) -> dict[str, Any]:
    """Build the tiny policy under ``args.workdir``, run ``worker(rank, 2, args, policy_dir, port, queue)`` on two
    spawned processes, and return what rank 0 put on the queue; exit naming the exit codes if a worker failed."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch.multiprocessing as mp

    from alignment_games.modules.lm.models import build_tiny_causal_lm

    policy = build_tiny_causal_lm(os.path.join(args.workdir, "policy"), config=POLICY, seed=0)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=worker, args=(r, 2, args, policy, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=1800)
    for p in procs:
        p.join(timeout=60)
    if any(p.exitcode != 0 for p in procs):
        sys.exit(f"a worker failed: exit codes {[p.exitcode for p in procs]}")
    return result


def lora_bank(policy_dir: str):
    """The policy as a :class:`PolicyBank` LoRA player, its adapter moved off its zero init (the same on every rank:
    seeded) so that it looks trained."""
    import torch

    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.policy_bank import PolicyBank

    torch.manual_seed(0)
    bank = PolicyBank(ModelConfig(policy_dir, lora_r=8, lora_alpha=16), players=["policy"])
    with torch.no_grad():
        for p in bank.player_parameters("policy"):
            p.add_(0.05 * torch.randn_like(p))
    return bank


def time_modes(bank, modes: dict[str, Callable], counter: dict[str, int], args) -> tuple[dict, dict]:
    """The same batched greedy ``generate`` call under each gathering context of ``modes``, the order alternating
    between rounds, the first round a warm-up: ``{"seconds": {mode: median}, "counts": {mode: median increase of
    counter["n"]}}`` and each mode's last token ids."""
    from alignment_games.modules.lm.sampling import Sampling

    prompts = [f"Question {i}: what is {i} plus {2 * i}?" for i in range(args.rows)]
    times: dict[str, list[float]] = {m: [] for m in modes}
    counts: dict[str, list[int]] = {m: [] for m in modes}
    tokens = {}
    for rep in range(args.repeats + 1):
        for mode in modes if rep % 2 == 0 else reversed(list(modes)):
            bank.gather_for_generation = modes[mode]
            before = counter["n"]
            t0 = time.perf_counter()
            out = bank.generate("policy", prompts, 1, Sampling(max_new_tokens=args.tokens), greedy=True)
            elapsed = time.perf_counter() - t0
            if rep > 0:
                times[mode].append(elapsed)
                counts[mode].append(counter["n"] - before)
            tokens[mode] = out.sequences
    medians = {m: statistics.median(v) for m, v in times.items()}
    return {"seconds": medians, "counts": {m: statistics.median(v) for m, v in counts.items()}}, tokens


def report(args, result: dict, counted: str, header: str, baseline: str, size: tuple[str, str]) -> None:
    """The table (seconds and ``result[counted]`` per call of each mode, under ``header``), ``<size[0]>:
    result[size[1]]`` and whether the modes' tokens agree, the JSON line, and last
    ``speedup_once_vs_<baseline>=<its median time / once's>``."""
    width = len(header) + 2  # the header right-aligned two spaces in
    print(f"policy {POLICY}, LoRA r=8, {args.rows} rows x {args.tokens} greedy tokens, 2 CPU processes (gloo)")
    print(f"{'mode':12s} {'s/call':>8s} {header:>{width}s}")
    for mode, seconds in result["seconds"].items():
        print(f"{mode:12s} {seconds:8.3f} {result[counted][mode]:{width}.0f}")
    print(f"{size[0]}: {result[size[1]]}; same tokens: {result['same_tokens']}")
    print(json.dumps(result))
    ratio = result["seconds"][baseline] / result["seconds"]["once"]
    print(f"speedup_once_vs_{baseline}={ratio:.2f}")
