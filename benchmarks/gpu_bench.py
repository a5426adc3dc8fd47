"""GPU measurements for a lent H200, in the order that matters, each section in its own process with its own deadline.

``bash benchmarks/gpu.sh`` runs this driver (which imports only the standard library). It runs each section as
``python3 benchmarks/gpu_bench.py --section NAME`` with a deadline (``SECTIONS``, 405 s in all, inside the 420 s
limit with the results' margin and a startup allowance), so a crash, a hung compile or an out-of-memory error in one
section loses only that section; a section saves its partial results after each measurement, and
``gpu_results.json`` is rewritten after every section. Sections need only PyTorch, transformers, Lightning and peft.

* ``env``: device, library versions, a measured bf16 matmul TFLOP/s and HBM copy TB/s.
* ``decode_static`` / ``decode_compiled``: the suite's own decode, ``PolicyBank.generate`` with ``lm.decode:
  static`` (and ``lm.compile_decode``), of a random Qwen2.5-1.5B-shaped policy in bf16 with a LoRA adapter, at 16
  and 64 prompts x G = 4 samples, a 64-token prompt and 512 new tokens (every row decodes them all); decode steps/s
  against the HBM bound of what the static cascade reads at every step (the weights, each prompt's cache once per
  group, every row's whole preallocated own cache: :func:`gpu_arithmetic.decode_bound_steps_per_s`).
* ``grpo``: two whole :class:`modules.grpo.GRPO` steps (LoRA r 16 over a bf16 base, 16 prompts x G = 4, 256 tokens,
  answer reward, KL 0.04, the second step reported) at the Qwen2.5-0.5B and 1.5B shapes: rollout tokens/s, trained
  (completion) tokens/s of the update, and the update's MFU (gpu_arithmetic).
* ``engines``: every figure a ratio against a peer: the own static decode, transformers' ``generate`` and the vLLM
  engine (the official ``vllm``, where the image has it; else the section says so and skips it) at 16 prompts x
  G = 4, 256 tokens on the 1.5B shape; a whole GRPO step of ours against TRL's ``GRPOTrainer`` at the 0.5B shape
  (benchmarks/vs_trl.py's workers; skipped, saying so, where the image lacks TRL).
* ``deep_smida``: one :class:`modules.deep_smida.DeepSMIDA` step by phase at the 1.5B shape (byte vocabulary).

Every section records and prints its expected H200 figure from the arithmetic at the full sizes, even under
``--tiny`` (``expected_h200``: HBM bounds at the reference 4.3 TB/s, update times at ``ASSUMED_MFU`` of the reference
790 TFLOP/s), and the driver prints one line per section: measured (``tiny`` under ``--tiny``) against expected.
Derived figures are also computed against three sets of constants, all recorded: the H200 datasheet (989 TFLOP/s
dense bf16, 4.8 TB/s), the reference (790 TFLOP/s, 4.3 TB/s: what such a machine attains), and what ``env``
measured in this run.

    bash benchmarks/gpu.sh                               # everything, under 7 minutes on one H200
    python3 benchmarks/gpu_bench.py --tiny --out r.json  # the same code at a tiny size, on any device
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

# the arithmetic and the shared helpers beside this file: package modules for the tests, siblings when gpu.sh runs it
arith = importlib.import_module(f"{__package__}.gpu_arithmetic" if __package__ else "gpu_arithmetic")
common = importlib.import_module(f"{__package__}._common" if __package__ else "_common")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LIMIT = 420.0  # seconds for the whole run, imports included (gpu.sh's default)
MARGIN = 8.0  # kept inside the limit to write the results at the end
STARTUP = 5.0  # allowance for the driver's own start and the gaps between sections
# (name, deadline in seconds on an H200), in the order that matters; each estimate: benchmarks/results/speed.md
SECTIONS = (
    ("env", 15),
    ("decode_static", 55),
    ("decode_compiled", 80),
    ("grpo", 85),
    ("engines", 120),
    ("deep_smida", 50),
)
LIBRARIES = ("torch", "transformers", "lightning", "peft")


# ---------------------------------------------------------------------- section helpers
def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def _expect(out: _Partial, figures: dict, line: str) -> None:
    """Record (first, so that a killed section keeps it) and print the section's expected H200 figures."""
    out["expected_h200"] = figures
    out["expected_line"] = line
    print(f"expected on one H200: {line}", flush=True)


def _expect_decode(args, out: _Partial, run: dict, compiled: bool, who: str, tail: str):
    """Record and print a decode section's expected H200 bound per group shape of ``run`` (``<shape> rows: <who><=
    N steps/s``, then ``tail``); the section's torch, device and dtype."""
    full = arith.expected_decode(arith.QWEN25_15B, run, compiled)
    bounds = ", ".join(f"{k} rows: {who}<= {v['bound_steps_per_s']:,.0f} steps/s" for k, v in full.items())
    _expect(out, full, bounds + tail)
    return _setup(args)


def _policy_folder(args, shape: str, vocab: int | None = None) -> str:
    """A random policy of ``shape`` (``0.5b``/``1.5b``; tiny under ``--tiny``) with the suite's byte tokenizer, built
    on the device in the run's dtype and saved once into the run's work folder (sections share it)."""
    import torch

    from alignment_games.modules.lm.models import build_byte_tokenizer

    cfg = {**(arith.TINY_SHAPES if args.tiny else arith.SHAPES)[shape]}
    if vocab is not None:
        cfg["vocab_size"] = vocab
    folder = os.path.join(args.workdir, f"policy_{'tiny_' if args.tiny else ''}{shape}_{cfg['vocab_size']}")
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_byte_tokenizer()
    _, device, dtype = _setup(args)
    torch.manual_seed(0)  # fixed weights whatever ran before
    config = Qwen2Config(
        **cfg, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    tmp = folder + ".tmp"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, folder)  # whole or absent: a section killed while saving leaves no half folder behind
    return folder


def _prompts(n: int, width: int) -> tuple[list[str], list[str]]:
    """``n`` distinct ASCII prompts of exactly ``width`` characters (byte-tokenizer tokens) and their answers."""
    texts, answers = [], []
    for i in range(n):
        a, b = i % 9 + 2, i % 7 + 3
        text = f"Problem {i:03d}: what is {a} + {b}? Put the answer in \\boxed{{}}. " * 4
        texts.append(text[:width].ljust(width))
        answers.append(str(a + b))
    return texts, answers


def section_env(args, out: _Partial) -> None:
    _expect(
        out,
        {"reference": arith.REFERENCE, "datasheet": arith.DATASHEET},
        f"{arith.REFERENCE['bf16_dense_tflops']:.0f} TFLOP/s bf16 and {arith.REFERENCE['hbm_tb_s']} TB/s attainable "
        f"(datasheet {arith.DATASHEET['bf16_dense_tflops']:.0f}, {arith.DATASHEET['hbm_tb_s']})",
    )
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
    out["measured_line"] = f"{out['measured_bf16_dense_tflops']:.0f} TFLOP/s bf16, {out['measured_hbm_tb_s']:.2f} TB/s"


def section_decode(args, out: _Partial, compiled: bool) -> None:
    """``PolicyBank.generate`` through the static cascade (compiled or not) at each group shape of ``DECODE``."""
    tail = f" (HBM bound, {arith.REFERENCE['hbm_tb_s']} TB/s, {arith.DECODE['new_tokens']} tokens)"
    torch, device, dtype = _expect_decode(args, out, arith.DECODE, compiled, "", tail)
    from torch._dynamo.utils import counters

    from alignment_games.modules.lm import static_decode
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.policy_bank import PolicyBank
    from alignment_games.modules.lm.sampling import Sampling

    if args.tiny and compiled:
        # inductor's C++ build takes minutes on a shared CPU: dynamo still traces the suite's step (what version skew
        # breaks), the eager backend runs the traced graph
        static_decode.compile_options = lambda device: {"backend": "eager", "dynamic": False}
    run_cfg = arith.DECODE_TINY if args.tiny else arith.DECODE
    cfg = (arith.TINY_SHAPES if args.tiny else arith.SHAPES)["1.5b"]
    folder = _policy_folder(args, "1.5b")
    lm = ModelConfig(folder, dtype=args.dtype, attn_implementation="sdpa", decode="static", compile_decode=compiled)
    bank = PolicyBank(lm, players=["policy"]).to(device)
    dtype_bytes = torch.finfo(dtype).bits // 8
    out["weight_bytes"] = arith.param_count(cfg) * dtype_bytes
    out["kv_bytes_per_token"] = arith.kv_bytes_per_token(cfg, dtype_bytes)
    new = run_cfg["new_tokens"]
    runs, lines = [], []
    for b, g in run_cfg["groups"]:
        prompts, _ = _prompts(b, run_cfg["prompt_len"])
        before = int(counters["stats"]["unique_graphs"])
        torch.manual_seed(0)
        # compiled: the warm-up runs the timed shapes (own cache of max_new_tokens slots), so it holds the compile and
        # CUDA graphs' recording (~1 s of decode once compiled); uncompiled: a few tokens load the kernels
        warm = new if compiled else min(8, new)
        bank.generate("policy", prompts, g, Sampling(max_new_tokens=warm, min_new_tokens=warm))
        after_warmup = int(counters["stats"]["unique_graphs"])
        torch.manual_seed(1)
        _sync(device)
        t = time.perf_counter()
        roll = bank.generate("policy", prompts, g, Sampling(max_new_tokens=new, min_new_tokens=new))
        _sync(device)
        dt = time.perf_counter() - t
        if roll.sequences.shape != (b * g, roll.prompt_width + new) or int(roll.completion_mask.sum()) != b * g * new:
            raise RuntimeError(f"{b}x{g}: decoded {tuple(roll.sequences.shape)}, expected {b * g} rows of {new} tokens")
        run = {
            "prompts": b,
            "group": g,
            "rows": b * g,
            "prompt_width": roll.prompt_width,
            "prefix_slots": arith.prefix_slots(roll.prompt_width, arith.STATIC_BUCKET if compiled else 1),
            "new_tokens": new,
            "seconds": dt,
            "decode_steps_per_s": new / dt,
            "tokens_per_s": b * g * new / dt,
            "graphs_compiled_in_warmup": after_warmup - before,
            "graphs_compiled_in_timed_run": int(counters["stats"]["unique_graphs"]) - after_warmup,
        }
        runs.append(run)
        out["runs"] = runs
        bound = _run_bound(out.data, run, arith.REFERENCE)
        lines.append(f"{b}x{g} rows {run['decode_steps_per_s']:,.0f} steps/s ({run['decode_steps_per_s'] / bound:.0%})")
        out["measured_line"] = ", ".join(lines) + " of the HBM bound"


def _run_bound(section: dict, run: dict, constants: dict) -> float:
    """The static decode's HBM bound at the shapes a decode run measured."""
    return arith.decode_bound_steps_per_s(
        section["weight_bytes"],
        section["kv_bytes_per_token"],
        run["rows"],
        run["prefix_slots"],
        run["new_tokens"],
        constants["hbm_tb_s"],
        group=run["group"],
        own_slots=run["new_tokens"],
    )


def section_grpo(args, out: _Partial) -> None:
    """Whole GRPO steps (LoRA over a bf16 base) at the 0.5B and 1.5B shapes; the last step of each is reported."""
    full = {name: arith.expected_grpo(cfg, arith.GRPO_RUN) for name, cfg in arith.SHAPES.items()}
    _expect(
        out,
        full,
        "; ".join(
            f"{k}: rollout <= {v['rollout_tokens_per_s_bound']:,.0f} tok/s (HBM bound), trained "
            f"{v['trained_tokens_per_s']:,.0f} tok/s at {arith.ASSUMED_MFU:.0%} update MFU"
            for k, v in full.items()
        ),
    )
    torch, device, dtype = _setup(args)
    import lightning as L
    from torch.utils.data import DataLoader

    from alignment_games.modules.algorithms.rl_losses import PolicyGradient
    from alignment_games.modules.grpo import GRPO
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.sampling import Sampling

    run = arith.GRPO_TINY if args.tiny else arith.GRPO_RUN
    b, g, new = run["prompts"], run["group"], run["new_tokens"]
    prompts, answers = _prompts(b * run["steps"], run["prompt_len"])
    rows = [{"prompt": p, "reference": a} for p, a in zip(prompts, answers)]
    lines = []
    for name in arith.SHAPES:
        cfg = (arith.TINY_SHAPES if args.tiny else arith.SHAPES)[name]
        L.seed_everything(0)
        # lm.decode auto: the static cascade on a GPU (uncompiled, the default), the grouped decode on CPU
        lm = ModelConfig(
            _policy_folder(args, name), dtype=args.dtype, attn_implementation="sdpa", lora_r=16, lora_alpha=32
        )
        model = GRPO(
            lm=lm,
            answer_reward=True,
            policy_gradient=PolicyGradient(group_size=g, kl_coef=0.04),
            sampling=Sampling(temperature=1.0, max_new_tokens=new, min_new_tokens=new),
            chat_template=False,
            lr=1e-5,
        )
        loader = DataLoader(
            rows,
            batch_size=b,
            collate_fn=lambda r: {"prompt": [x["prompt"] for x in r], "reference": [x["reference"] for x in r]},
        )
        accelerator = "gpu" if device.type == "cuda" else "cpu"
        steps = common.fit_phases(model, loader, run["steps"], args.workdir, accelerator)
        last = steps[-1]
        if last["generated_tokens"] != b * g * new:
            raise RuntimeError(f"{name}: generated {last['generated_tokens']:.0f} tokens, expected {b * g * new}")
        params = arith.param_count(cfg)
        update = last["ref_logprobs"] + last["backward"] + last["optimizer"]
        seq_len = run["prompt_len"] + new
        res = {
            "steps": steps,
            "rows": b * g,
            "prompt_len": run["prompt_len"],
            "new_tokens": new,
            "params": params,
            "update_flops": arith.grpo_update_flops(params, b * g, seq_len),
            "update_seconds": update,
            "rollout_tokens_per_s": last["generated_tokens"] / last["generate"],
            "trained_tokens_per_s": b * g * new / update,
            "update_flop_per_s": arith.grpo_update_flops(params, b * g, seq_len) / update,
        }
        out[name] = res
        lines.append(
            f"{name}: rollout {res['rollout_tokens_per_s']:,.0f} tok/s, trained {res['trained_tokens_per_s']:,.0f} "
            f"tok/s, update MFU {res['update_flop_per_s'] / (arith.REFERENCE['bf16_dense_tflops'] * 1e12):.0%}"
        )
        out["measured_line"] = "; ".join(lines)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


def section_engines(args, out: _Partial) -> None:
    """Every figure a ratio against a peer: the own static decode, transformers' ``generate`` and the vLLM engine
    (``lm.decode: vllm``, where the image has ``vllm``) at the 1.5B shape, then a whole GRPO step of ours against TRL's
    ``GRPOTrainer`` at the 0.5B shape (benchmarks/vs_trl.py's workers on the GPU, where the image has TRL)."""
    tail = f" (HBM bound, {arith.ENGINES['new_tokens']} tokens); generate, vLLM and TRL measured beside it"
    torch, device, dtype = _expect_decode(args, out, arith.ENGINES, False, "own ", tail)
    from transformers import AutoModelForCausalLM

    from alignment_games.modules.lm.model_config import DECODES, ModelConfig
    from alignment_games.modules.lm.policy_bank import PolicyBank
    from alignment_games.modules.lm.sampling import Sampling

    run = arith.ENGINES_TINY if args.tiny else arith.ENGINES
    ((b, g),) = run["groups"]
    new, folder = run["new_tokens"], _policy_folder(args, "1.5b")
    prompts, _ = _prompts(b, run["prompt_len"])
    lm = {"dtype": args.dtype, "attn_implementation": "sdpa"}
    own = PolicyBank(ModelConfig(folder, decode="static", **lm), players=["policy"]).to(device)
    ids, mask = (v.to(device) for v in own.encode_prompts(prompts).values())
    # the player's adapter is zero at init: transformers' model of the base is the same policy
    peer = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    tok = own.tokenizer

    # the CPU benchmark's call of transformers' generate (a sibling script module: this section runs as a script)
    hf_generate = importlib.import_module("engines").hf_generate

    def generate(tokens: int) -> int:
        return hf_generate(peer, tok, ids, mask, g, tokens).numel()

    def bank_decode(bank):
        def decode(tokens: int) -> int:
            roll = bank.generate("policy", prompts, g, Sampling(1.0, 1.0, tokens, tokens))
            return int(roll.completion_mask.sum())

        return decode

    engines = {"own": bank_decode(own), "generate": generate}
    if "vllm" not in DECODES:
        out["vllm"] = "skipped: this checkout has no lm.decode: vllm"
    elif importlib.util.find_spec("vllm") is None:
        out["vllm"] = "skipped: vllm is not installed in this image"
    else:
        gib = 0.25 if args.tiny else 8.0
        lm_vllm = ModelConfig(folder, decode="vllm", vllm_kv_cache_gib=gib, **lm)
        engines["vllm"] = bank_decode(PolicyBank(lm_vllm, players=["policy"]))
    times: dict[str, float] = {}
    lines: list[str] = []
    for name, decode in engines.items():
        try:
            decode(min(8, new))  # warm-up: kernels loaded (vLLM: the engine built)
            torch.manual_seed(0)
            _sync(device)
            t = time.perf_counter()
            done = decode(new)
            _sync(device)
            times[name] = time.perf_counter() - t
        except Exception as err:
            out[name] = f"error: {type(err).__name__}: {err}"[:500]
            continue
        if done != b * g * new:
            raise RuntimeError(f"{name}: decoded {done} tokens, expected {b * g * new}")
        out["decode"] = {"rows": b * g, "new_tokens": new, "seconds": times}
        if "generate" in times:
            lines = [f"generate/{e} {times['generate'] / t:.2f}x" for e, t in times.items() if e != "generate"]
            out["measured_line"] = f"{b}x{g} rows x {new} tokens: " + ", ".join(lines)
    grpo = run["grpo"]
    if importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None:
        out["trl"] = "skipped: TRL (or datasets) is not installed in this image"
        return
    vs_trl = importlib.import_module(f"{__package__}.vs_trl" if __package__ else "vs_trl")
    steps, tokens = 3, grpo["prompts"] * grpo["group"] * grpo["tokens"]
    argv = [
        f"--workdir={os.path.join(args.workdir, 'vs_trl')}",
        f"--policy={_policy_folder(args, '0.5b')}",
        f"--b={grpo['prompts']}",
        f"--g={grpo['group']}",
        f"--tokens={grpo['tokens']}",
        "--rewards=1",
        f"--steps={steps}",
        "--discard=1",
        f"--device={device.type}",
    ]
    env = vs_trl.worker_env(2, device.type)
    medians = {}
    for who in ("ours", "trl"):
        run_steps = vs_trl.run_worker(who, sys.executable, ROOT, [*argv, f"--worker={who}"], env, steps, tokens)
        medians[who] = sorted(s["step"] for s in run_steps[1:])[(steps - 1) // 2]
        out["grpo_vs_trl"] = {**grpo, "step_seconds": medians}
    lines.append(f"GRPO step TRL/ours {medians['trl'] / medians['ours']:.2f}x")
    out["measured_line"] = f"{b}x{g} rows x {new} tokens: " + ", ".join(lines)


def section_deep_smida(args, out: _Partial) -> None:
    """One deep-SMIDA step by phase; its utility an untrained ensemble over the policy's own base."""
    full = arith.expected_deep_smida({**arith.QWEN25_15B, "vocab_size": 260}, arith.DEEP_SMIDA)
    _expect(out, full, f"generate >= {full['generate_seconds_bound']:.2f} s a step (HBM bound)")
    torch, device, dtype = _setup(args)
    import lightning as L

    from alignment_games.datamodules.prompts import PromptDataModule
    from alignment_games.modules.deep_smida import DeepSMIDA
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.sampling import Sampling
    from alignment_games.modules.preference import EnsembleUtility

    # the byte vocabulary, so that sampled ids decode to text the utility reads (the 151,936-entry projection is in
    # the decode and GRPO sections)
    folder = _policy_folder(args, "1.5b", vocab=260)
    run = arith.DEEP_SMIDA_TINY if args.tiny else arith.DEEP_SMIDA
    b, d, m, new = run["B"], run["D"], run["M"], run["new_tokens"]
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

    def keep(steps: list[dict]) -> None:
        out["steps"] = steps  # the first includes warm-up; a deadline kill keeps the steps done
        last = steps[-1]
        step = sum(v for k, v in last.items() if k != "generated_tokens")
        out["measured_line"] = f"generate {last['generate']:.2f} s of a {step:.2f} s step"

    data = PromptDataModule(num_prompts=64, batch_size=b)
    accelerator = "gpu" if device.type == "cuda" else "cpu"
    # two optimizers: Lightning counts two steps per batch
    common.fit_phases(model, data, 2 * run["batches"], args.workdir, accelerator, each=keep)


SECTION_FUNCS = {
    "env": section_env,
    "decode_static": lambda a, o: section_decode(a, o, compiled=False),
    "decode_compiled": lambda a, o: section_decode(a, o, compiled=True),
    "grpo": section_grpo,
    "engines": section_engines,
    "deep_smida": section_deep_smida,
}


# ---------------------------------------------------------------------- driver (standard library only)
def derive(results: dict) -> None:
    """Bounds, fractions of them and MFU against the datasheet, the reference and the measured constants."""
    sets = {"datasheet": arith.DATASHEET, "reference": arith.REFERENCE}
    env = results["sections"].get("env", {}).get("result", {})
    if "measured_hbm_tb_s" in env:
        sets["measured"] = {
            "bf16_dense_tflops": env["measured_bf16_dense_tflops"],
            "hbm_tb_s": env["measured_hbm_tb_s"],
        }
    results["constants"] = sets
    for variant in ("static", "compiled"):
        sec = results["sections"].get(f"decode_{variant}", {}).get("result", {})
        for run in sec.get("runs", []):
            for name, c in sets.items():
                bound = _run_bound(sec, run, c)
                run[f"bound_steps_per_s_{name}"] = bound
                run[f"fraction_of_bound_{name}"] = run["decode_steps_per_s"] / bound
    grpo = results["sections"].get("grpo", {}).get("result", {})
    for shape in arith.SHAPES:
        if shape in grpo:
            for name, c in sets.items():
                grpo[shape][f"update_mfu_{name}"] = grpo[shape]["update_flop_per_s"] / (c["bf16_dense_tflops"] * 1e12)


def summary_line(name: str, entry: dict, tiny: bool) -> str:
    """``name: status; measured ... (or tiny); expected on one H200: ...``."""
    res = entry.get("result", {})
    measured = "tiny" if tiny else res.get("measured_line", "nothing")
    return f"{name}: {entry['status']}; measured {measured}; expected on one H200: {res.get('expected_line', '?')}"


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
        "config": "tiny" if args.tiny else "Qwen2.5-0.5B/1.5B shapes (random init), bf16",
        "python": platform.python_version(),
        "versions": versions,
        "limit_seconds": args.limit,
        "sections": {},
        "summary": [],
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
    work = tempfile.mkdtemp(prefix="gpu_bench_work_")  # the policies the sections share, and their artifacts
    atexit.register(shutil.rmtree, work, True)
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
            cmd += ["--workdir", work] + (["--tiny"] if args.tiny else [])
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
            results["summary"].append(summary_line(name, entry, args.tiny))
            results["elapsed_seconds"] = round(time.monotonic() - start, 1)
            save()
            print(f"[gpu_bench] {results['summary'][-1]} ({entry['seconds']} s)", file=sys.stderr, flush=True)
    save()
    print(json.dumps(results, indent=2), flush=True)
    return 0 if all(s["status"] in ("ok", "skipped") for s in results["sections"].values()) else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny models, short runs: a smoke test on any device")
    ap.add_argument("--out", default="gpu_results.json")
    ap.add_argument("--log", default=None, help="default: gpu_bench.log beside --out")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--limit", type=float, default=LIMIT, help="overall seconds, imports included")
    ap.add_argument("--margin", type=float, default=MARGIN, help="seconds kept to write the results at the end")
    ap.add_argument("--deadline_scale", type=float, default=1.0, help="multiplies every section's deadline")
    ap.add_argument("--skip", default="", help=f"comma list of sections to skip: {', '.join(SECTION_FUNCS)}")
    ap.add_argument("--section", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.section is None:
        sys.exit(drive(args))
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="gpu_bench_work_")
    SECTION_FUNCS[args.section](args, _Partial(args.part))


if __name__ == "__main__":
    main()
