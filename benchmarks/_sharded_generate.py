"""What the sharded-generation benchmarks share (``zero3_generate.py``, ``fsdp2_generate.py``): the policy, the
command line, and running a worker on two CPU processes that hands rank 0's result back."""

from __future__ import annotations

import argparse
import os
import sys
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
