"""What a checkpoint's ``.sha256`` sidecar costs: save and load of a SmolLM2-135M LoRA checkpoint with and without it.

    python benchmarks/checkpoint_digest.py                  # LoRA r=16 on every linear layer, Adam moments
    python benchmarks/checkpoint_digest.py --targets q_proj v_proj --rank 8

The checkpoint holds what a LoRA run's does: the adapters (shapes from SmolLM2-135M's config) and Adam's two moments
per adapter, fp32. It is written by ``atomic_torch_save`` without and with ``sidecar=True`` and read by ``torch.load``
without and with ``verify_sidecar`` first (the in-process memo cleared, so every load hashes). Prints the size, the
median seconds of each (``--repeats``), the ratios and the hashing rate, then the host and load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from _host import host  # benchmarks/ is the script's folder

from alignment_games.callbacks.fault_tolerance import atomic_torch_save
from alignment_games.callbacks.functional import digests

#: SmolLM2-135M-Instruct's shapes (its config.json): hidden 576, MLP 1536, 30 layers, 3 of 9 heads for keys/values
SMOLLM2 = {"hidden": 576, "mlp": 1536, "layers": 30, "kv": 192}
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_checkpoint(rank: int, targets: list[str]) -> dict:
    """A checkpoint of LoRA adapters on ``targets`` of every layer, with Adam's moments, random fp32."""
    h, m, kv = SMOLLM2["hidden"], SMOLLM2["mlp"], SMOLLM2["kv"]
    shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h)}
    shapes.update({"gate_proj": (h, m), "up_proj": (h, m), "down_proj": (m, h)})
    gen = torch.Generator().manual_seed(0)
    state, moments = {}, {}
    for layer in range(SMOLLM2["layers"]):
        for name in targets:
            fan_in, fan_out = shapes[name]
            for part, shape in (("lora_A", (rank, fan_in)), ("lora_B", (fan_out, rank))):
                key = f"model.layers.{layer}.{name}.{part}.weight"
                state[key] = torch.randn(shape, generator=gen)
                moments[len(moments)] = {"step": torch.tensor(10.0), "exp_avg": torch.randn(shape, generator=gen)}
                moments[len(moments) - 1]["exp_avg_sq"] = torch.rand(shape, generator=gen)
    return {"state_dict": state, "optimizer_states": [{"state": moments}], "global_step": 10}


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", nargs="+", default=ALL_LINEAR)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    ckpt = lora_checkpoint(args.rank, args.targets)
    with tempfile.TemporaryDirectory() as tmp:
        plain, sealed = os.path.join(tmp, "plain.ckpt"), os.path.join(tmp, "sealed.ckpt")
        save_plain = _median(lambda: atomic_torch_save(ckpt, plain), args.repeats)
        save_sealed = _median(lambda: atomic_torch_save(ckpt, sealed, sidecar=True), args.repeats)
        size = os.path.getsize(sealed)

        def verified_load():
            digests._verified.clear()  # no memo: every load hashes, as the first load of a process does
            digests.verify_sidecar(sealed)
            torch.load(sealed, weights_only=True)

        load_plain = _median(lambda: torch.load(plain, weights_only=True), args.repeats)
        load_sealed = _median(verified_load, args.repeats)
        hash_only = _median(lambda: digests.sha256_file(sealed), args.repeats)
    result = {
        "checkpoint_mb": round(size / 1e6, 1),
        "rank": args.rank,
        "targets": args.targets,
        "save_s": round(save_plain, 4),
        "save_with_sidecar_s": round(save_sealed, 4),
        "load_s": round(load_plain, 4),
        "load_verified_s": round(load_sealed, 4),
        "sha256_s": round(hash_only, 4),
        "sha256_mb_per_s": round(size / 1e6 / hash_only),
        "save_ratio": round(save_sealed / save_plain, 2),
        "load_ratio": round(load_sealed / load_plain, 2),
        "host": host(),
        "loadavg": os.getloadavg(),
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
