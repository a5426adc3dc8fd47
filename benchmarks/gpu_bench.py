"""GPU measurements for a lent machine, each section in its own process with its own deadline.

``bash benchmarks/gpu.sh`` runs this driver (which imports only the standard library). It runs each section as
``python3 benchmarks/gpu_bench.py --section NAME`` with a deadline (``SECTIONS``; never past the overall limit), so a
crash, a hung compile or an out-of-memory error in one section loses only that section; a section saves its partial
results after each measurement, and ``gpu_results.json`` is rewritten after every section. Sections need only
PyTorch, transformers, Lightning and peft (deep-SMIDA's utility is an ensemble over the policy's own base).

* ``env``: device, library versions, a measured bf16 matmul TFLOP/s and HBM copy TB/s.
* ``decode_eager`` / ``decode_static`` / ``decode_compiled``: ``generate`` of a random Qwen2.5-1.5B-shaped model in
  bf16 at batch 1, 16 and 64 (``--new_tokens`` after a ``--prompt_len`` prompt, every row decoding all of them), with
  the dynamic cache, the static cache, and the static cache with the decode step compiled; decode steps/s against
  the HBM bound, which counts the weights and the KV cache read at every step (:func:`decode_bound_steps_per_s`).
* ``training``: forward + backward + AdamW of a LoRA step and of a full-parameter step; MFU (:func:`mfu`).
* ``deep_smida``: one :class:`modules.deep_smida.DeepSMIDA` step by phase at the 1.5B shape.
* ``real_shape``: ``benchmarks/real_shape.py``'s families at the full Qwen2.5-0.5B shape, peak memory per phase.
* ``grouped_decode``: ``PolicyBank.generate`` with the prompt's KV cache copied to each of G = 4 rows against the
  grouped decode (one copy per group), at the 1.5B shape.

Derived figures are computed by the driver against three sets of constants, all recorded: the H200 datasheet
(989 TFLOP/s dense bf16, 4.8 TB/s), the references used so far (790 TFLOP/s, 4.3 TB/s: what such a machine
attains), and what ``env`` measured in this run.

    bash benchmarks/gpu.sh                               # everything, under 8 minutes on one H200
    python3 benchmarks/gpu_bench.py --tiny --out r.json  # the same code at a tiny size, on any device
"""

from __future__ import annotations

import argparse
import atexit
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, deadline in seconds on an H200; see the RESULTS section for what each is expected to take)
SECTIONS = (
    ("env", 25),
    ("decode_eager", 60),
    ("training", 45),
    ("deep_smida", 80),
    ("real_shape", 90),
    ("decode_static", 45),
    ("grouped_decode", 40),
    ("decode_compiled", 75),
)
DATASHEET = {"bf16_dense_tflops": 989.0, "hbm_tb_s": 4.8}  # H200 SXM datasheet
REFERENCE = {"bf16_dense_tflops": 790.0, "hbm_tb_s": 4.3}  # attained on such a machine: the constants used so far
LIBRARIES = ("torch", "transformers", "lightning", "peft")

QWEN25_15B = {
    "vocab_size": 151936,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
}
TINY = {
    "vocab_size": 260,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}


# ---------------------------------------------------------------------- pure arithmetic (tested by hand values)


def kv_bytes_per_token(cfg: dict, dtype_bytes: int) -> int:
    """Bytes of K and V one token adds to the cache: 2 x layers x KV heads x head dim x element size."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes


def decode_bound_steps_per_s(
    weight_bytes: int, kv_token_bytes: int, batch: int, prompt_len: int, new_tokens: int, hbm_tb_s: float
) -> float:
    """Decode steps per second if every step only read the weights and the KV cache at HBM bandwidth.

    A step reads every weight once and the cache of every row; a row's context grows from ``prompt_len`` to
    ``prompt_len + new_tokens``, ``prompt_len + new_tokens / 2`` on average over the run.
    """
    per_step = weight_bytes + batch * (prompt_len + new_tokens / 2) * kv_token_bytes
    return hbm_tb_s * 1e12 / per_step


def mfu(flops_per_token: float, tokens_per_s: float, peak_tflops: float) -> float:
    """Model FLOP utilisation: achieved FLOP/s over the peak."""
    return flops_per_token * tokens_per_s / (peak_tflops * 1e12)


# ---------------------------------------------------------------------- section helpers
def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _build(cfg: dict, device, dtype):
    import torch
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


class _Partial:
    """A section's results, saved to its file after every measurement (a deadline kill keeps what was done)."""

    def __init__(self, path: str) -> None:
        self.path, self.data = path, {}

    def __setitem__(self, key, value) -> None:
        self.data[key] = value
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.data, f)
        os.replace(self.path + ".tmp", self.path)

    def __getitem__(self, key):
        return self.data[key]


def _setup(args):
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    return torch, device, dtype


def section_env(args, out: _Partial) -> None:
    torch, device, dtype = _setup(args)
    out["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out["cuda"] = torch.version.cuda
    out["capability"] = list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None
    n = 256 if args.tiny else 8192
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    reps, t = (2 if args.tiny else 50), time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    out["measured_bf16_dense_tflops"] = 2 * n**3 * reps / (time.perf_counter() - t) / 1e12
    del a, b
    numel = (1 << 20) if args.tiny else (1 << 30)  # 2 GiB of bf16 per copy on the GPU
    src = torch.empty(numel, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    reps, t = (2 if args.tiny else 20), time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    _sync(device)
    out["measured_hbm_tb_s"] = 2 * src.numel() * src.element_size() * reps / (time.perf_counter() - t) / 1e12


# Decode variants: generate keyword arguments, and whether the decode step is compiled. HOOK: when modules/lm
# (ModelConfig, decoding) gains its own static-cache / compiled decode options, add a variant here that calls it
# and a "decode_<variant>" entry to SECTIONS; the timing, bound and compile counting below stay as they are.
DECODE_VARIANTS = {
    "eager": ({}, False),
    "static": ({"cache_implementation": "static", "disable_compile": True}, False),
    "compiled": ({"cache_implementation": "static", "disable_compile": True}, True),
}


def section_decode(args, out: _Partial, variant: str) -> None:
    import functools

    torch, device, dtype = _setup(args)
    from transformers import StoppingCriteria, StoppingCriteriaList

    cfg = TINY if args.tiny else QWEN25_15B
    model = _build(cfg, device, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out["weight_bytes"] = weight_bytes
    out["kv_bytes_per_token"] = kv_bytes_per_token(cfg, torch.finfo(dtype).bits // 8)
    extra, compiled = DECODE_VARIANTS[variant]
    counters = None
    if compiled:
        from torch._dynamo.utils import counters

        eager_forward = model.forward
        # the decode step (one new token per row) compiled; the prefill stays eager, as transformers does itself
        step = torch.compile(
            eager_forward,
            backend="eager" if args.tiny else "inductor",
            mode=None if args.tiny else "reduce-overhead",
            fullgraph=not args.tiny,
            dynamic=False,
        )

        @functools.wraps(eager_forward)
        def forward(*a, **k):
            ids = k.get("input_ids", a[0] if a else None)
            return step(*a, **k) if ids is not None and ids.shape[1] == 1 else eager_forward(*a, **k)

        model.forward = forward

    class StopAfter(StoppingCriteria):
        """Ends the warm-up after a few steps while the cache keeps the timed run's length (one compile, not two)."""

        def __init__(self, length: int) -> None:
            self.length = length

        def __call__(self, input_ids, scores, **kw):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, device=input_ids.device)

    runs = []
    for batch in args.batches:
        ids = torch.randint(3, cfg["vocab_size"], (batch, args.prompt_len), device=device)
        kw = dict(
            do_sample=False,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            pad_token_id=0,
            eos_token_id=None,
            **extra,
        )
        graphs = lambda: int(counters["stats"]["unique_graphs"]) if counters is not None else 0  # noqa: E731
        before = graphs()
        with torch.inference_mode():
            warm = StoppingCriteriaList([StopAfter(args.prompt_len + 8)])
            model.generate(ids, **kw, stopping_criteria=warm)  # warm-up (and the compile) at the timed shapes
            if compiled:
                model.generate(ids, **kw, stopping_criteria=warm)  # reduce-overhead records its graph on a rerun
            after_warmup = graphs()
            _sync(device)
            t = time.perf_counter()
            seq = model.generate(ids, **kw)
            _sync(device)
            dt = time.perf_counter() - t
        if seq.shape[1] != args.prompt_len + args.new_tokens:
            raise RuntimeError(f"generated {seq.shape[1] - args.prompt_len} tokens, expected {args.new_tokens}")
        run = {
            "batch": batch,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "seconds": dt,
            "decode_steps_per_s": args.new_tokens / dt,
            "tokens_per_s": batch * args.new_tokens / dt,
        }
        if compiled:
            run["graphs_compiled_in_warmup"] = after_warmup - before
            run["graphs_compiled_in_timed_run"] = graphs() - after_warmup  # 0: the warm-up compiled the right shape
        runs.append(run)
        out["runs"] = runs


def section_training(args, out: _Partial) -> None:
    torch, device, dtype = _setup(args)
    cfg = TINY if args.tiny else QWEN25_15B
    batch, seq, steps = (2, 32, 3) if args.tiny else (8, 2048, 5)

    def measure(model, params) -> dict:
        opt = torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda")
        ids = torch.randint(3, cfg["vocab_size"], (batch, seq), device=device)
        times = []
        for _ in range(steps):
            _sync(device)
            t = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            times.append(time.perf_counter() - t)
        kept = sorted(times[1:])
        dt = kept[len(kept) // 2]
        return {"batch": batch, "seq_len": seq, "step_seconds": dt, "tokens_per_s": batch * seq / dt}

    model = _build(cfg, device, dtype).train()
    n = sum(p.numel() for p in model.parameters())
    out["params"] = n
    full = measure(model, list(model.parameters()))
    full["flops_per_token"] = 6 * n  # forward 2N, backward 4N (activation and weight gradients)
    out["full"] = full
    from peft import LoraConfig, get_peft_model

    model.zero_grad(set_to_none=True)
    lora = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM"))
    step = measure(lora, [p for p in lora.parameters() if p.requires_grad])
    step["flops_per_token"] = 4 * n  # no weight gradients for the frozen base: forward 2N + activation grads 2N
    out["lora"] = step


def _policy_folder(cfg: dict, dtype) -> str:
    """A random model of ``cfg``'s shape with the suite's byte tokenizer, saved in bf16 (a 1.5B model: 3 GB)."""
    import torch

    from alignment_games.modules.lm.models import build_byte_tokenizer

    tok = build_byte_tokenizer()
    folder = tempfile.mkdtemp(prefix="ag_gpu_policy_")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # fixed weights, whatever the sections before drew from the global generator: unseeded, one clean-clone run in
    # three met a sampling near-tie where the grouped and copied decodes parted (token agreement 0.998)
    torch.manual_seed(0)
    model = _build({**cfg, "vocab_size": len(tok)}, device, dtype)
    model.config.eos_token_id = model.config.bos_token_id = tok.eos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def section_deep_smida(args, out: _Partial) -> None:
    torch, device, dtype = _setup(args)
    import lightning as L

    from alignment_games.datamodules.prompts import PromptDataModule
    from alignment_games.modules.deep_smida import DeepSMIDA
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.sampling import Sampling
    from alignment_games.modules.scorers.utility import EnsembleUtility

    # The Qwen tokenizer is not on the machine: the same architecture with the byte tokenizer (vocabulary 260), so
    # that sampled ids decode to text the utility reads; the 151,936-entry projection is measured by real_shape.
    folder = _policy_folder(TINY if args.tiny else QWEN25_15B, dtype)
    b, d, m, new = (2, 2, 2, 8) if args.tiny else (4, 4, 4, 256)
    batches = 2  # the first includes the warm-up; both are kept
    out["shape"] = {"B": b, "D": d, "M": m, "max_new_tokens": new, "vocab": 260}
    L.seed_everything(0)
    lm = ModelConfig(folder, dtype=args.dtype)
    # the paper's utility: an ensemble whose members share the policy's own base (no encoder package)
    utility = EnsembleUtility(
        checkpoint=None, backbone=folder, backbone_task="causal_lm", ensemble={"lm": lm}, allow_untrained=True
    )  # timing only: the heads need no training
    model = DeepSMIDA(
        lm=lm,
        utility=utility,
        samples_per_prompt=d,
        follower_samples=m,
        sampling=Sampling(temperature=0.6, max_new_tokens=new, min_new_tokens=new),
        leader_lr=8e-6,
        follower_lr=2e-5,
    )
    steps = []

    class Collect(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *a):
            steps.append(dict(pl_module.phase_times))
            out["steps"] = steps  # the first includes warm-up; a deadline kill keeps the steps done

    trainer = L.Trainer(
        max_steps=2 * batches,  # two optimizers: Lightning counts two steps per batch
        logger=False,
        default_root_dir=folder,  # artifacts written at the end of fit land beside the policy, not in cwd
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[Collect()],
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=1,
    )
    trainer.fit(model, PromptDataModule(num_prompts=64, batch_size=b))


def section_real_shape(args, out: _Partial) -> None:
    """benchmarks/real_shape.py's families (not TRL: not installed on the GPU machine) at the full 0.5B depth."""
    import torch

    from benchmarks import real_shape

    cuda = torch.cuda.is_available()
    argv = ["--families", "grpo,deep_smida,debate,pool", "--workdir", tempfile.mkdtemp(prefix="ag_rs_")]
    argv += ["--tiny", "--layers", "2"] if args.tiny else ["--layers", "24", "--utility_backbone", "policy"]
    if cuda:
        argv += ["--device", "cuda", "--dtype", args.dtype]
    argv += ["--no_logprob"] if args.tiny else []
    out["argv"] = argv
    out["result"] = real_shape.main(argv)


def section_grouped_decode(args, out: _Partial) -> None:
    """PolicyBank.generate of G = 4 samples per prompt, the prompt's cache copied to every row against the grouped
    decode (one copy per group; the CPU default, opt-in on GPU until measured here): seconds per call and whether the
    tokens agree (same seed; GPU kernels may round differently, so agreement is recorded, not required)."""
    torch, device, dtype = _setup(args)
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.policy_bank import PolicyBank

    folder = _policy_folder(TINY if args.tiny else QWEN25_15B, dtype)
    bank = PolicyBank(ModelConfig(folder, lora_r=8, lora_alpha=16, dtype=args.dtype), players=["policy"]).to(device)
    b, new = (2, 8) if args.tiny else (16, 128)
    prompts = [f"Problem {i}: a shop sells {i + 3} boxes of {i % 7 + 2} pens each. How many pens?" for i in range(b)]
    out["shape"] = {"prompts": b, "samples": 4, "new_tokens": new}
    sequences = {}
    for grouped in (False, True):
        bank.grouped_decode = grouped
        key = "grouped" if grouped else "copied"
        torch.manual_seed(0)
        bank.generate("policy", prompts, 4, temperature=1.0, max_new_tokens=8, min_new_tokens=8)  # warm-up
        torch.manual_seed(1)
        _sync(device)
        t = time.perf_counter()
        roll = bank.generate("policy", prompts, 4, temperature=1.0, max_new_tokens=new, min_new_tokens=new)
        _sync(device)
        out[f"{key}_seconds"] = time.perf_counter() - t
        sequences[key] = roll.sequences
    out["speedup_grouped"] = out["copied_seconds"] / out["grouped_seconds"]
    out["tokens_equal_share"] = float((sequences["copied"] == sequences["grouped"]).float().mean())


SECTION_FUNCS = {
    "grouped_decode": section_grouped_decode,
    "env": section_env,
    "decode_eager": lambda a, o: section_decode(a, o, "eager"),
    "decode_static": lambda a, o: section_decode(a, o, "static"),
    "decode_compiled": lambda a, o: section_decode(a, o, "compiled"),
    "training": section_training,
    "deep_smida": section_deep_smida,
    "real_shape": section_real_shape,
}


# ---------------------------------------------------------------------- driver (standard library only)
def derive(results: dict) -> None:
    """Bounds, fractions of them and MFU against the datasheet, the reference and the measured constants."""
    sets = {"datasheet": DATASHEET, "reference": REFERENCE}
    env = results["sections"].get("env", {}).get("result", {})
    if "measured_hbm_tb_s" in env:
        sets["measured"] = {
            "bf16_dense_tflops": env["measured_bf16_dense_tflops"],
            "hbm_tb_s": env["measured_hbm_tb_s"],
        }
    results["constants"] = sets
    for variant in ("eager", "static", "compiled"):
        sec = results["sections"].get(f"decode_{variant}", {}).get("result", {})
        for run in sec.get("runs", []):
            for name, c in sets.items():
                bound = decode_bound_steps_per_s(
                    sec["weight_bytes"], sec["kv_bytes_per_token"], run["batch"], run["prompt_len"],
                    run["new_tokens"], c["hbm_tb_s"],
                )  # fmt: skip
                run[f"bound_steps_per_s_{name}"] = bound
                run[f"fraction_of_bound_{name}"] = run["decode_steps_per_s"] / bound
    training = results["sections"].get("training", {}).get("result", {})
    for kind in ("full", "lora"):
        if kind in training:
            for name, c in sets.items():
                t = training[kind]
                t[f"mfu_{name}"] = mfu(t["flops_per_token"], t["tokens_per_s"], c["bf16_dense_tflops"])


def drive(args) -> int:
    start = time.monotonic()
    out_path = os.path.abspath(args.out)
    log_path = os.path.abspath(args.log or os.path.join(os.path.dirname(out_path), "gpu_bench.log"))
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    versions = {}
    for lib in LIBRARIES:
        try:
            versions[lib] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            versions[lib] = None
    results = {
        "config": "tiny" if args.tiny else "Qwen2.5-1.5B shape (random init), bf16",
        "python": platform.python_version(),
        "versions": versions,
        "limit_seconds": args.limit,
        "sections": {},
    }
    skip = set(filter(None, args.skip.split(",")))
    unknown = skip - set(SECTION_FUNCS)
    if unknown:
        sys.exit(f"--skip: unknown sections {sorted(unknown)}; known: {', '.join(SECTION_FUNCS)}")

    def save() -> None:
        derive(results)
        with open(out_path + ".tmp", "w") as f:
            json.dump(results, f, indent=2)
        os.replace(out_path + ".tmp", out_path)

    # the sections import the suite as alignment_games.* (the installed name of this checkout's folders); the GPU
    # machine has only the four packages, so a link named alignment_games to the checkout stands in for the install
    suite = tempfile.mkdtemp(prefix="gpu_bench_suite_")
    atexit.register(shutil.rmtree, suite, True)
    os.symlink(ROOT, os.path.join(suite, "alignment_games"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, suite])}  # ROOT: the benchmarks package
    with open(log_path, "a") as log:
        for name, deadline in SECTIONS:
            if name in skip:
                results["sections"][name] = {"status": "skipped"}
                continue
            left = args.limit - args.margin - (time.monotonic() - start)
            timeout = min(deadline * args.deadline_scale, left)
            if timeout < 5:
                results["sections"][name] = {"status": "not run: overall limit reached"}
                save()
                continue
            part = os.path.join(tempfile.gettempdir(), f"gpu_bench_{os.getpid()}_{name}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--section", name, "--part", part, "--dtype", args.dtype]
            cmd += ["--tiny"] if args.tiny else []
            log.write(f"\n===== {name} (deadline {timeout:.0f} s) =====\n")
            log.flush()
            t = time.monotonic()
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
            )
            try:
                rc = proc.wait(timeout=timeout)
                status = "ok" if rc == 0 else f"error: exit {rc} (see the log)"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)  # the section and anything it started (compile workers)
                proc.wait()
                status = f"deadline: killed after {timeout:.0f} s"
            entry = {"status": status, "seconds": round(time.monotonic() - t, 1)}
            if os.path.exists(part):
                with open(part) as f:
                    entry["result"] = json.load(f)
                os.remove(part)
            results["sections"][name] = entry
            results["elapsed_seconds"] = round(time.monotonic() - start, 1)
            save()
            print(f"[gpu_bench] {name}: {status} in {entry['seconds']} s", file=sys.stderr, flush=True)
    save()
    print(json.dumps(results, indent=2), flush=True)
    return 0 if all(s["status"] in ("ok", "skipped") for s in results["sections"].values()) else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny model, short runs: a smoke test on any device")
    ap.add_argument("--out", default="gpu_results.json")
    ap.add_argument("--log", default=None, help="default: gpu_bench.log beside --out")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--limit", type=float, default=470.0, help="overall seconds, imports included")
    ap.add_argument("--margin", type=float, default=8.0, help="seconds kept to write the results at the end")
    ap.add_argument("--deadline_scale", type=float, default=1.0, help="multiplies every section's deadline")
    ap.add_argument("--skip", default="", help=f"comma list of sections to skip: {', '.join(SECTION_FUNCS)}")
    ap.add_argument("--section", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.section is None:
        sys.exit(drive(args))
    args.batches = (1, 2) if args.tiny else (1, 16, 64)
    args.prompt_len, args.new_tokens = (8, 12) if args.tiny else (64, 256)
    SECTION_FUNCS[args.section](args, _Partial(args.part))


if __name__ == "__main__":
    main()
