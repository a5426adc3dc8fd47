"""GPU measurements in one process: generation against the HBM bound, training MFU, one deep-SMIDA step by phase.

Meant for a single H200 with PyTorch, transformers and Lightning installed and no internet (``bash
benchmarks/gpu.sh``); ``--tiny`` runs the same code on a tiny model on any device as a smoke test. Writes
``gpu_results.json``.

* Generation: a random-initialised model of the Qwen2.5-1.5B architecture in bf16, batch 16 and 64, 512 new tokens
  (``min_new_tokens`` = ``max_new_tokens`` so every run decodes the same number of steps), eager with the dynamic KV
  cache, and static cache with ``torch.compile``. Decode steps/s are compared with the bandwidth bound
  ``HBM bandwidth / weight bytes`` (about 1,390 steps/s for 3.09 GB at 4.3 TB/s).
* Training: forward + backward + AdamW on ``train_batch × train_len`` tokens in bf16; MFU = 6·N·tokens/s / peak.
* Deep-SMIDA: three steps of :class:`modules.deep_smida.DeepSMIDA` (LoRA players over the same random architecture,
  an untrained 5-head ensemble over a frozen copy of it as utility), wall time per phase, first step dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

QWEN25_15B = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
)
TINY = dict(
    vocab_size=260,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(cfg: dict, device: torch.device, dtype: torch.dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**cfg, attn_implementation="sdpa")
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def bench_generation(model, batch: int, new_tokens: int, prompt_len: int, compiled: bool, device) -> dict:
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (batch, prompt_len), device=device)
    kw = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None)
    if compiled:
        # transformers compiles the decoding forward itself when the cache is static (on CUDA)
        kw["cache_implementation"] = "static"
    gen = model.generate
    with torch.inference_mode():
        gen(ids, **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})  # warm-up (and compilation)
        if compiled:
            gen(ids, **kw)
        _sync(device)
        t = time.perf_counter()
        out = gen(ids, **kw)
        _sync(device)
        dt = time.perf_counter() - t
    assert out.shape[1] == prompt_len + new_tokens
    result = {
        "batch": batch,
        "new_tokens": new_tokens,
        "seconds": dt,
        "tokens_per_s": batch * new_tokens / dt,
        "decode_steps_per_s": new_tokens / dt,
    }
    if compiled:
        # evidence that the static-cache run was really compiled (0 graphs: transformers fell back to eager)
        from torch._dynamo.utils import counters

        result["dynamo_unique_graphs"] = int(counters["stats"]["unique_graphs"])
    return result


def bench_training(model, batch: int, seq: int, steps: int, device) -> dict:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    ids = torch.randint(3, model.config.vocab_size, (batch, seq), device=device)
    times = []
    for _ in range(steps):
        _sync(device)
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - t)
    model.eval()
    del opt
    dt = sorted(times[1:])[len(times[1:]) // 2]
    return {"batch": batch, "seq_len": seq, "step_seconds": dt, "tokens_per_s": batch * seq / dt}


def bench_deep_smida(policy_dir: str, args, device) -> dict:
    import lightning as L

    from datamodules.prompts import PromptDataModule
    from modules.deep_smida import DeepSMIDA
    from modules.lm.model_config import ModelConfig
    from modules.lm.sampling import Sampling
    from modules.scorers.utility import EnsembleUtility

    L.seed_everything(0)
    model = DeepSMIDA(
        lm=ModelConfig(policy_dir, dtype=args.dtype),
        utility=EnsembleUtility(allow_untrained=True),  # timing only: the heads need no training
        samples_per_prompt=args.smida_d,
        follower_samples=args.smida_m,
        sampling=Sampling(temperature=0.6, max_new_tokens=args.smida_tokens),
        leader_lr=8e-6,
        follower_lr=2e-5,
    )
    times = []

    class Collect(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *a):
            times.append(dict(pl_module.phase_times))

    trainer = L.Trainer(
        max_steps=2 * args.smida_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        callbacks=[Collect()],
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=1,
    )
    trainer.fit(model, PromptDataModule(num_prompts=64, batch_size=args.smida_b))
    kept = times[1:] or times
    phases = ["generate", "score", "logprob", "backward", "optimizer"]
    out = {p: sum(t[p] for t in kept) / len(kept) for p in phases}
    out["step"] = sum(out[p] for p in phases)
    out["generated_tokens_per_s"] = sum(t["generated_tokens"] for t in kept) / sum(t["generate"] for t in kept)
    out["shape"] = {"B": args.smida_b, "D": args.smida_d, "M": args.smida_m, "max_new_tokens": args.smida_tokens}
    return out


def bench_grouped_decode(policy_dir: str, dtype: str, device, tiny: bool) -> dict:
    """PolicyBank.generate of G = 4 samples per prompt, the prompt's cache copied to every row against the grouped
    decode (one copy per group; the CPU default, opt-in on GPU until measured here): seconds per call and whether the
    tokens agree (same seed; GPU kernels may round differently, so agreement is recorded, not required)."""
    from modules.lm.model_config import ModelConfig
    from modules.lm.policy_bank import PolicyBank

    bank = PolicyBank(ModelConfig(policy_dir, lora_r=8, lora_alpha=16, dtype=dtype), players=["policy"]).to(device)
    b, new, reps = (2, 8, 2) if tiny else (16, 128, 3)
    prompts = [f"Problem {i}: a shop sells {i + 3} boxes of {i % 7 + 2} pens each. How many pens?" for i in range(b)]
    out: dict = {"prompts": b, "samples": 4, "new_tokens": new}
    sequences = {}
    for grouped in (False, True):
        bank.grouped_decode = grouped
        key = "grouped" if grouped else "copied"
        torch.manual_seed(0)
        bank.generate("policy", prompts, 4, temperature=1.0, max_new_tokens=new, min_new_tokens=new)  # warm-up
        times = []
        for _ in range(reps):
            torch.manual_seed(1)
            _sync(device)
            t = time.perf_counter()
            roll = bank.generate("policy", prompts, 4, temperature=1.0, max_new_tokens=new, min_new_tokens=new)
            _sync(device)
            times.append(time.perf_counter() - t)
        sequences[key] = roll.sequences
        out[f"{key}_seconds"] = min(times)
    out["speedup_grouped"] = out["copied_seconds"] / out["grouped_seconds"]
    out["tokens_equal_share"] = float((sequences["copied"] == sequences["grouped"]).float().mean())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny model, short runs: a smoke test on any device")
    ap.add_argument("--out", default="gpu_results.json")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--hbm_tb_s", type=float, default=4.3, help="HBM bandwidth, TB/s (H200: 4.8 spec, 4.3 used)")
    ap.add_argument("--peak_tflops", type=float, default=790.0, help="dense bf16 peak TFLOP/s for MFU")
    ap.add_argument("--smida_b", type=int, default=4)
    ap.add_argument("--smida_d", type=int, default=4)
    ap.add_argument("--smida_m", type=int, default=4)
    ap.add_argument("--smida_tokens", type=int, default=256)
    ap.add_argument("--smida_steps", type=int, default=3)
    ap.add_argument(
        "--skip", default="", help="comma list of parts to skip: generation,compiled,training,smida,grouped"
    )
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    cfg = TINY if args.tiny else QWEN25_15B
    new_tokens, prompt_len = (16, 8) if args.tiny else (512, 64)
    batches = (2, 4) if args.tiny else (16, 64)
    results: dict = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "config": "tiny" if args.tiny else "Qwen2.5-1.5B (random init)",
        "dtype": args.dtype,
    }

    def save() -> None:
        with open(args.out + ".tmp", "w") as f:
            json.dump(results, f, indent=2)
        os.replace(args.out + ".tmp", args.out)
        print(json.dumps(results, indent=2), flush=True)

    t0 = time.perf_counter()
    model = build(cfg, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bound = args.hbm_tb_s * 1e12 / weight_bytes
    results.update(
        params=n_params,
        weight_gb=weight_bytes / 1e9,
        bandwidth_bound_steps_per_s=bound,
        build_seconds=time.perf_counter() - t0,
    )
    save()
    if "generation" not in skip:
        results["generation_eager"] = [
            bench_generation(model, b, new_tokens, prompt_len, False, device) for b in batches
        ]
        for r in results["generation_eager"]:
            r["fraction_of_bound"] = r["decode_steps_per_s"] / bound
        save()
    if "compiled" not in skip:
        try:
            results["generation_static_compiled"] = [
                bench_generation(model, b, new_tokens, prompt_len, True, device) for b in batches
            ]
            for r in results["generation_static_compiled"]:
                r["fraction_of_bound"] = r["decode_steps_per_s"] / bound
        except Exception as err:  # noqa: BLE001 - a failed compile is a result to record, not a crash
            results["generation_static_compiled"] = {"error": f"{type(err).__name__}: {err}"[:500]}
        save()
    if "training" not in skip:
        tb, ts = (2, 32) if args.tiny else (8, 2048)
        tr = bench_training(model, tb, ts, 4 if args.tiny else 6, device)
        tr["mfu"] = 6 * n_params * tr["tokens_per_s"] / (args.peak_tflops * 1e12)
        results["training"] = tr
        save()
    if "smida" not in skip:
        from modules.lm.models import build_byte_tokenizer

        folder = tempfile.mkdtemp(prefix="ag_gpu_policy_")
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        # The Qwen tokenizer is not available offline: the policy is the same architecture with the project's
        # byte-level tokenizer, so its vocabulary (and lm head) is that tokenizer's; recorded in the results.
        tok = build_byte_tokenizer()
        policy = build({**cfg, "vocab_size": len(tok)}, torch.device("cpu"), dtype)
        policy.config.eos_token_id = tok.eos_token_id
        policy.config.pad_token_id = tok.pad_token_id
        policy.save_pretrained(folder)
        tok.save_pretrained(folder)
        del policy
        results["deep_smida_policy_vocab"] = len(tok)
        results["deep_smida_step"] = bench_deep_smida(folder, args, device)
        save()
        if "grouped" not in skip:
            try:
                results["grouped_decode"] = bench_grouped_decode(folder, args.dtype, device, args.tiny)
            except Exception as err:  # noqa: BLE001 - a failure on another transformers version is a result
                results["grouped_decode"] = {"error": f"{type(err).__name__}: {err}"[:500]}
            save()
    results["total_seconds"] = time.perf_counter() - t0
    save()


if __name__ == "__main__":
    main()
