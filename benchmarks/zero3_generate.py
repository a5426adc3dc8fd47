"""Generation under DeepSpeed ZeRO-3: the policy gathered once per ``generate`` call against DeepSpeed's own per-module
fetching, in the same run.

Two processes (gloo, DeepSpeed's CPU accelerator) wrap the same LoRA policy (:class:`PolicyBank`) in a ZeRO-3 engine
with every parameter partitioned (no persistence threshold), then time the same batched ``generate`` call three ways,
the order alternating between rounds:

* ``per_module``: no gathering context. DeepSpeed's hooks fetch each submodule's shards before its forward and
  partition them again after it, so every decoded token gathers every layer again;
* ``gathered``: ``deepspeed.zero.GatheredParameters`` over the policy around the call, DeepSpeed's hooks left on (what
  the suite did before): the hooks still partition each submodule after its forward, so this gathers per token too;
* ``once``: :func:`~modules.distributed.sharding.parameter_gathering`, as the families use it under ZeRO-3
  (prefetches released, DeepSpeed's hooks held off the policy, one gather, one partition at the end).

Both must give the same tokens (greedy decoding, compared). Printed per mode: seconds per call (median) and the
parameter re-partitions per call (DeepSpeed's ``free_param`` calls, counted); the last line is
``speedup_once_vs_per_module=<median per_module time / median once time>``.

    python benchmarks/zero3_generate.py                       # tiny Qwen2 policy built locally, 2 CPU processes
    python benchmarks/zero3_generate.py --tokens 64 --rows 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from contextlib import nullcontext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from _sharded_generate import POLICY, parse_args, run_on_two_processes  # noqa: E402 - after the path set-up


def worker(rank: int, world: int, args, policy_dir: str, port: int, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    import deepspeed
    import deepspeed.runtime.zero.partition_parameters as zero_params
    import torch

    from alignment_games.modules.distributed.sharding import parameter_gathering
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.policy_bank import PolicyBank
    from alignment_games.modules.lm.sampling import Sampling

    torch.set_num_threads(args.threads)
    deepspeed.init_distributed("gloo")
    torch.manual_seed(0)
    bank = PolicyBank(ModelConfig(policy_dir, lora_r=8, lora_alpha=16), players=["policy"])
    with torch.no_grad():  # a trained-looking adapter, the same on both ranks
        for p in bank.player_parameters("policy"):
            p.add_(0.05 * torch.randn_like(p))
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
    }
    optimizer = torch.optim.AdamW(bank.player_parameters("policy"), lr=1e-4)
    engine, *_ = deepspeed.initialize(
        args=argparse.Namespace(device_rank=rank), model=bank, optimizer=optimizer, config=config
    )

    # what parameter_gathering reads of Lightning's DeepSpeedStrategy: its class name, .model and .config
    strategy = type("DeepSpeedStrategy", (), {"model": engine, "config": config})()
    releases = {"n": 0}
    free = zero_params.free_param

    def counted(param):
        releases["n"] += 1
        return free(param)

    zero_params.free_param = counted
    prompts = [f"Question {i}: what is {i} plus {2 * i}?" for i in range(args.rows)]
    modes = {
        "per_module": nullcontext,
        "gathered": lambda: deepspeed.zero.GatheredParameters(list(bank.parameters())),
        "once": parameter_gathering(strategy, bank),
    }
    times: dict[str, list[float]] = {m: [] for m in modes}
    counts: dict[str, list[int]] = {m: [] for m in modes}
    tokens: dict[str, torch.Tensor] = {}
    for rep in range(args.repeats + 1):
        for mode in modes if rep % 2 == 0 else reversed(list(modes)):
            bank.gather_for_generation = modes[mode]
            bank.merge_for_generation = False
            before = releases["n"]
            t0 = time.perf_counter()
            out = bank.generate("policy", prompts, 1, Sampling(max_new_tokens=args.tokens), greedy=True)
            elapsed = time.perf_counter() - t0
            if rep > 0:  # the first round warms up
                times[mode].append(elapsed)
                counts[mode].append(releases["n"] - before)
            tokens[mode] = out.sequences
    if rank == 0:
        queue.put(
            {
                "seconds": {m: statistics.median(v) for m, v in times.items()},
                "releases": {m: statistics.median(v) for m, v in counts.items()},
                "same_tokens": all(torch.equal(tokens["per_module"], t) for t in tokens.values()),
                "params": sum(1 for _ in bank.parameters()),
            }
        )


def main() -> None:
    args = parse_args(__doc__, "ag_zero3_generate")
    result = run_on_two_processes(worker, args)
    print(f"policy {POLICY}, LoRA r=8, {args.rows} rows x {args.tokens} greedy tokens, 2 CPU processes (gloo)")
    print(f"{'mode':12s} {'s/call':>8s} {'re-partitions/call':>20s}")
    for mode in ("per_module", "gathered", "once"):
        print(f"{mode:12s} {result['seconds'][mode]:8.3f} {result['releases'][mode]:20.0f}")
    print(f"parameters: {result['params']}; same tokens: {result['same_tokens']}")
    print(json.dumps(result))
    ratio = result["seconds"]["per_module"] / result["seconds"]["once"]
    print(f"speedup_once_vs_per_module={ratio:.2f}")


if __name__ == "__main__":
    main()
