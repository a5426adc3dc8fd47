"""Memory of a pool of m followers: one frozen base with m LoRA adapters against m separate models (each with its own
adapter), both built by :class:`modules.pool.StackelbergPool` exactly as training builds them.

Each layout is measured in its own process:

* ``weights_bytes``: bytes of the distinct tensor storages of parameters and buffers (exact, no allocator noise);
* ``rss_delta_bytes``: growth of the process's resident memory from just before to just after building the pool,
  after a warm-up build has paid the one-off costs (imports); includes tokenizers, peft wrappers and allocator
  overhead, so for tiny models it is dominated by per-model overhead rather than weights;
* ``cuda_bytes`` (with ``--device cuda``): ``torch.cuda.memory_allocated`` after moving the pool to the GPU.

    python benchmarks/pool_memory.py                      # m = 4 tiny Qwen2 followers (built locally, no download)
    python benchmarks/pool_memory.py --model Qwen/Qwen2.5-0.5B-Instruct --device cuda   # on a GPU

The last line is ``separate_vs_shared=<weights ratio>`` (and the RSS ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = {"hidden_size": 96, "intermediate_size": 256, "num_hidden_layers": 3}  # the size of configs/sft_tiny.yaml


def worker(args) -> dict:
    import gc

    import psutil
    import torch

    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.models import load_model, load_tokenizer
    from alignment_games.modules.pool import StackelbergPool

    lm = ModelConfig(name_or_path=args.model, lora_r=args.lora_r, lora_alpha=2 * args.lora_r, dtype=args.dtype)
    # pay the one-off costs (lazy imports, kernels, tokenizer code) before measuring, then drop the warm-up model
    warm = StackelbergPool(lm=lm, num_players=1)
    load_tokenizer(args.model), load_model(args.model, task="causal_lm")
    del warm
    gc.collect()
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    if args.layout == "shared":
        pool = StackelbergPool(lm=lm, num_players=args.m)
    else:
        pool = StackelbergPool(lm=lm, models=[args.model] * args.m)  # each member its own base, over the same lm
    gc.collect()
    rss1 = proc.memory_info().rss
    seen, total, trainable = set(), 0, 0
    for t in list(pool.parameters()) + list(pool.buffers()):
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes()
    trainable = sum(p.numel() * p.element_size() for p in pool.parameters() if p.requires_grad)
    out = {
        "layout": args.layout,
        "m": args.m,
        "weights_bytes": total,
        "trainable_bytes": trainable,
        "rss_delta_bytes": rss1 - rss0,
    }
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        pool.to("cuda")
        torch.cuda.synchronize()
        out["cuda_bytes"] = torch.cuda.memory_allocated() - before
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF name or path; default: a tiny Qwen2 built locally")
    parser.add_argument("--m", type=int, default=4)
    parser.add_argument("--lora_r", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--layout", default=None, choices=["shared", "separate"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.layout is not None:  # worker process
        print(json.dumps(worker(args)))
        return
    if args.model is None:
        from alignment_games.modules.lm.models import build_tiny_causal_lm

        args.model = build_tiny_causal_lm(os.path.join(tempfile.gettempdir(), "ag_pool_mem_tiny"), config=TINY)
    results = {}
    for layout in ("shared", "separate"):
        cmd = [sys.executable, __file__, "--layout", layout, "--model", args.model, "--m", str(args.m)]
        cmd += ["--lora_r", str(args.lora_r), "--dtype", args.dtype, "--device", args.device]
        env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        results[layout] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(json.dumps(results[layout]))
    s, p = results["shared"], results["separate"]
    line = (
        f"separate_vs_shared={p['weights_bytes'] / s['weights_bytes']:.3f} (weights), "
        f"{p['rss_delta_bytes'] / max(1, s['rss_delta_bytes']):.3f} (RSS growth)"
    )
    if "cuda_bytes" in s:
        line += f", {p['cuda_bytes'] / max(1, s['cuda_bytes']):.3f} (CUDA)"
    print(line)


if __name__ == "__main__":
    main()
