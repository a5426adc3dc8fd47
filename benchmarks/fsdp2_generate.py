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

import json
import os
import statistics
import time
from contextlib import nullcontext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from _sharded_generate import POLICY, parse_args, run_on_two_processes  # noqa: E402 - after the path set-up


def worker(rank: int, world: int, args, policy_dir: str, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.device_mesh import init_device_mesh

    from alignment_games.modules.distributed.sharding import parameter_gathering
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.policy_bank import PolicyBank
    from alignment_games.modules.lm.sampling import Sampling

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    bank = PolicyBank(ModelConfig(policy_dir, lora_r=8, lora_alpha=16), players=["policy"])
    with torch.no_grad():  # a trained-looking adapter, the same on both ranks
        for p in bank.player_parameters("policy"):
            p.add_(0.05 * torch.randn_like(p))
    bank.shard(init_device_mesh("cpu", (world,)))
    gathers = {"n": 0}
    real = dist.all_gather_single

    def counted(*a, **k):
        gathers["n"] += 1
        return real(*a, **k)

    dist.all_gather_single = counted  # what FSDP2's default all-gather calls
    prompts = [f"Question {i}: what is {i} plus {2 * i}?" for i in range(args.rows)]
    # parameter_gathering reads only the strategy's class hierarchy: Lightning's FSDP2 strategy
    modes = {"per_unit": nullcontext, "once": parameter_gathering(ModelParallelStrategy(), bank)}
    times: dict[str, list[float]] = {m: [] for m in modes}
    counts: dict[str, list[int]] = {m: [] for m in modes}
    tokens: dict[str, torch.Tensor] = {}
    for rep in range(args.repeats + 1):
        for mode in modes if rep % 2 == 0 else reversed(list(modes)):
            bank.gather_for_generation = modes[mode]
            before = gathers["n"]
            t0 = time.perf_counter()
            out = bank.generate("policy", prompts, 1, Sampling(max_new_tokens=args.tokens), greedy=True)
            elapsed = time.perf_counter() - t0
            if rep > 0:  # the first round warms up
                times[mode].append(elapsed)
                counts[mode].append(gathers["n"] - before)
            tokens[mode] = out.sequences
    if rank == 0:
        queue.put(
            {
                "seconds": {m: statistics.median(v) for m, v in times.items()},
                "all_gathers": {m: statistics.median(v) for m, v in counts.items()},
                "same_tokens": torch.equal(tokens["per_unit"], tokens["once"]),
                "units": 1 + len(bank.model.get_base_model().model.layers),
            }
        )
    dist.barrier()  # both ranks done with the group before either tears it down
    dist.destroy_process_group()


def main() -> None:
    args = parse_args(__doc__, "ag_fsdp2_generate")
    result = run_on_two_processes(worker, args)
    print(f"policy {POLICY}, LoRA r=8, {args.rows} rows x {args.tokens} greedy tokens, 2 CPU processes (gloo)")
    print(f"{'mode':12s} {'s/call':>8s} {'all-gathers/call':>18s}")
    for mode in ("per_unit", "once"):
        print(f"{mode:12s} {result['seconds'][mode]:8.3f} {result['all_gathers'][mode]:18.0f}")
    print(f"fully_shard units: {result['units']}; same tokens: {result['same_tokens']}")
    print(json.dumps(result))
    ratio = result["seconds"]["per_unit"] / result["seconds"]["once"]
    print(f"speedup_once_vs_per_unit={ratio:.2f}")


if __name__ == "__main__":
    main()
