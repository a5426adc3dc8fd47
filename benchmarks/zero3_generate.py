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
import os
from contextlib import nullcontext

# benchmarks/ is the script's folder
from _sharded_generate import lora_bank, parse_args, report, run_on_two_processes, time_modes

#: the printed table's counted column and its header, the mode ``once`` is compared with, the size line's label and key
TABLE = ("releases", "re-partitions/call", "per_module", ("parameters", "params"))


def worker(rank: int, world: int, args, policy_dir: str, port: int, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    import deepspeed
    import deepspeed.runtime.zero.partition_parameters as zero_params
    import torch

    from alignment_games.modules.distributed.sharding import parameter_gathering

    torch.set_num_threads(args.threads)
    deepspeed.init_distributed("gloo")
    bank = lora_bank(policy_dir)
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
    modes = {
        "per_module": nullcontext,
        "gathered": lambda: deepspeed.zero.GatheredParameters(list(bank.parameters())),
        "once": parameter_gathering(strategy, bank),
    }
    bank.merge_for_generation = False
    timed, tokens = time_modes(bank, modes, releases, args)
    if rank == 0:
        queue.put(
            {
                "seconds": timed["seconds"],
                "releases": timed["counts"],
                "same_tokens": all(torch.equal(tokens["per_module"], t) for t in tokens.values()),
                "params": sum(1 for _ in bank.parameters()),
            }
        )


def main() -> None:
    args = parse_args(__doc__, "ag_zero3_generate")
    report(args, run_on_two_processes(worker, args), *TABLE)


if __name__ == "__main__":
    main()
