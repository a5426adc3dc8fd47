"""What a 4-bit (NF4, bitsandbytes) frozen base costs against the fp32 base on CPU, in one run.

Two policy banks of the same model, one LoRA adapter each (r = 16, the default targets), one loaded with
``lm.load_in_4bit: true`` and one in fp32, are timed alternately on the same inputs:

- ``forward``: the adapter's logits of ``--rows`` sequences of ``--tokens`` tokens, without gradients;
- ``step``: the same forward with gradients, a mean log-probability loss, its backward and one AdamW step on the
  adapter;
- ``decode``: ``PolicyBank.generate`` of ``--new_tokens`` greedy tokens for ``--rows`` prompts (the CPU default
  decoder: the fp32 bank runs its merged lean step, the 4-bit bank ``generate`` over the model's forward).

Prints the host, the load average before and after, each phase's median seconds and the 4-bit / fp32 ratio, the
weights' footprints, then one JSON line and the step ratio as the last line.

    python benchmarks/qlora_cpu.py                   # builtin:smollm2-135m-instruct, 4 rows x 128 tokens, 3 repeats
    python benchmarks/qlora_cpu.py --tiny            # the tiny random Qwen2 (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from _host import host, host_line  # benchmarks/ is the script's folder


def _banks(path: str) -> dict:
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.policy_bank import PolicyBank

    return {
        bits: PolicyBank(ModelConfig(path, load_in_4bit=bits == "nf4", dtype="float32"), ["policy"])
        for bits in ("fp32", "nf4")
    }


def _weights_mib(bank) -> float:
    """Bytes of the base's parameters and quantisation constants (not the adapter), in MiB."""
    return bank.model.get_base_model().get_memory_footprint() / 2**20


def run(path: str, args) -> dict:
    import torch

    from alignment_games.modules.lm.sampling import Sampling

    banks = _banks(path)
    tok = banks["fp32"].tokenizer
    words = " ".join(f"word{i}" for i in range(4 * args.tokens))
    ids = tok([words] * args.rows, add_special_tokens=False, return_tensors="pt")["input_ids"][:, : args.tokens]
    ids = ids + torch.arange(args.rows)[:, None]  # distinct rows
    ids = ids.clamp_max(len(tok) - 1)
    mask = torch.ones_like(ids)
    prompts = [f"Question {i}: what is {i} + {i + 1}?" for i in range(args.rows)]
    sampling = Sampling(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)  # fixed work
    optimizers = {k: torch.optim.AdamW(b.player_parameters("policy"), lr=1e-4) for k, b in banks.items()}

    def forward(bits: str) -> None:
        with torch.no_grad(), banks[bits].using("policy") as model:
            model(input_ids=ids, attention_mask=mask)

    def step(bits: str) -> None:
        with banks[bits].using("policy") as model:
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
            loss = -logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).mean()
        loss.backward()
        optimizers[bits].step()
        optimizers[bits].zero_grad()

    def decode(bits: str) -> None:
        banks[bits].generate("policy", prompts, 1, sampling, greedy=True)

    phases = {"forward": forward, "step": step, "decode": decode}
    times = {p: {b: [] for b in banks} for p in phases}
    for _ in range(args.repeats):
        for name, fn in phases.items():
            for bits in ("fp32", "nf4"):
                start = time.perf_counter()
                fn(bits)
                times[name][bits].append(time.perf_counter() - start)
    out = {"model": args.model if not args.tiny else "tiny", "rows": args.rows, "tokens": args.tokens}
    out["new_tokens"] = args.new_tokens
    for name in phases:
        fp32, nf4 = statistics.median(times[name]["fp32"]), statistics.median(times[name]["nf4"])
        out[name] = {"fp32_s": round(fp32, 3), "nf4_s": round(nf4, 3), "ratio": round(nf4 / fp32, 2)}
    out["weights_mib"] = {b: round(_weights_mib(bank), 1) for b, bank in banks.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--tiny", action="store_true", help="the tiny random Qwen2, 2 rows x 16 tokens, 1 repeat")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--new_tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model
    if args.tiny:
        from alignment_games.modules.lm.models import build_tiny_causal_lm

        path = build_tiny_causal_lm(os.path.join(tempfile.gettempdir(), "ag_bench_qlora_tiny"))
        args.rows, args.tokens, args.new_tokens, args.repeats = 2, 16, 4, 1
    info = host()
    print(host_line(info))
    load_before = os.getloadavg()[0]
    r = run(path, args)
    r["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(f"load average (1 min): {r['load_average'][0]} before, {r['load_average'][1]} after")
    print(f"{r['model']}: {r['rows']} rows x {r['tokens']} tokens, decode {r['new_tokens']} new tokens")
    for name in ("forward", "step", "decode"):
        p = r[name]
        print(f"{name}: fp32 {p['fp32_s']} s, nf4 {p['nf4_s']} s, nf4/fp32 {p['ratio']}x")
    print(f"base weights: fp32 {r['weights_mib']['fp32']} MiB, nf4 {r['weights_mib']['nf4']} MiB")
    print(json.dumps({"host": info, "result": r}))
    print(f"nf4_step_ratio_vs_fp32={r['step']['ratio']}")


if __name__ == "__main__":
    main()
