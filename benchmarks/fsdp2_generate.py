"""Generation under FSDP2: the policy unsharded once per ``generate`` call against FSDP2's own per-unit gathering, in
the same run.

Two processes (gloo) shard the same LoRA policy (:class:`PolicyBank`, :meth:`PolicyBank.shard`: each decoder block a
``fully_shard`` unit, the causal LM the root unit) and time the same batched ``generate`` call two ways, the order
alternating between rounds:

* ``per_unit``: no gathering context. Each block all-gathers its shards before its forward and frees them after
  (``reshard_after_forward``), so every decoded token gathers every block again;
* ``once``: :func:`~modules.distributed.sharding.parameter_gathering`, as the families use it under FSDP2 (every
  unit unsharded once, kept whole for the call, resharded at the end).

Both must give the same tokens (greedy decoding, compared). Printed per mode: seconds per call (median) and the
all-gathers per call (``torch.distributed.all_gather_single``, FSDP2's default all-gather, counted); the last line is
``speedup_once_vs_per_unit=<median per_unit time / median once time>``.

    python benchmarks/fsdp2_generate.py                       # tiny Qwen2 policy built locally, 2 CPU processes
    python benchmarks/fsdp2_generate.py --tokens 64 --rows 16
"""

from __future__ import annotations

import os
from contextlib import nullcontext

# benchmarks/ is the script's folder
from _sharded_generate import lora_bank, parse_args, report, run_on_two_processes, time_modes

#: the printed table's counted column and its header, the mode ``once`` is compared with, the size line's label and key
TABLE = ("all_gathers", "all-gathers/call", "per_unit", ("fully_shard units", "units"))


def worker(rank: int, world: int, args, policy_dir: str, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.device_mesh import init_device_mesh

    from alignment_games.modules.distributed.sharding import parameter_gathering

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    bank = lora_bank(policy_dir)
    bank.shard(init_device_mesh("cpu", (world,)))
    gathers = {"n": 0}
    real = dist.all_gather_single

    def counted(*a, **k):
        gathers["n"] += 1
        return real(*a, **k)

    dist.all_gather_single = counted  # what FSDP2's default all-gather calls
    # parameter_gathering reads only the strategy's class hierarchy: Lightning's FSDP2 strategy
    modes = {"per_unit": nullcontext, "once": parameter_gathering(ModelParallelStrategy(), bank)}
    timed, tokens = time_modes(bank, modes, gathers, args)
    if rank == 0:
        queue.put(
            {
                "seconds": timed["seconds"],
                "all_gathers": timed["counts"],
                "same_tokens": torch.equal(tokens["per_unit"], tokens["once"]),
                "units": 1 + len(bank.model.get_base_model().model.layers),
            }
        )
    dist.barrier()  # both ranks done with the group before either tears it down
    dist.destroy_process_group()


def main() -> None:
    args = parse_args(__doc__, "ag_fsdp2_generate")
    report(args, run_on_two_processes(worker, args), *TABLE)


if __name__ == "__main__":
    main()
