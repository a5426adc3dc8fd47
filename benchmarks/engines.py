"""The generation engines on SmolLM2-135M-Instruct in one run: the own decoder, transformers' ``generate``, vLLM.

* ``decode``: 16 distinct chat prompts x 64 sampled tokens, then one prompt x 64 tokens. ``own``:
  ``PolicyBank.generate`` of a LoRA player (r 16, moved off its zero init) with ``lm.decode: auto`` (on CPU the
  grouped lean decode, the adapter merged); ``generate``: transformers' ``generate`` of the same base with the same
  adapter merged by peft (``merge_and_unload``), nothing of this suite in the loop; ``vllm``: the same player through
  ``lm.decode: vllm`` (the colocated engine, the adapter as a ``LoRARequest``).
* ``pool``: the pool's 3-adapter decode: three players' chat prompts (``--pool-prompts`` each, G = 4 samples) in one
  mixed-adapter batch: ``own`` and ``vllm`` through ``PolicyBank.generate_each``, ``generate`` through peft's
  mixed-adapter batch (``adapter_names``, one per row, adapters unmerged).
* ``grpo``: a whole GRPO step (rollout + LoRA update), ours with each engine against TRL's ``GRPOTrainer``, run by
  benchmarks/vs_trl.py's workers on SmolLM2 (``--policy``): its setup (5 tiny reward models, arithmetic prompts, the
  same LoRA, beta, loss, optimizer, no chat template), B = 8 prompts x G = 4, 64 tokens; each worker in its own
  process, the order rotating between repeats, the first ``--discard`` steps of each run dropped.

Every row writes all its tokens (``min_new_tokens``), temperature 1, top-p 1, fp32 on ``--threads`` threads. The decode
and pool rows run in one process, interleaved, after an untimed warm-up of each. Each figure is the median over the
repeats, printed with the median 1-minute load average (``os.getloadavg``) over its runs, and ratios are the peer's
time over the engine's (above 1: faster than the peer: ``generate`` for decoding, TRL for a GRPO step). Where ``vllm``
cannot be imported or the suite has no ``lm.decode: vllm``, its rows print ``engine not available: <why>``.

    python benchmarks/engines.py                          # everything (about 15 minutes on a quiet 2-core host)
    python benchmarks/engines.py --sections decode --repeats 5
    python benchmarks/engines.py --tiny                   # the smoke test: a tiny random decoder, a few tokens

Prints the host, one line per row, then one JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time

from _host import host, host_line  # benchmarks/ is the script's folder
from vs_trl import ROOT, run_worker, worker_env

MODEL = "builtin:smollm2-135m-instruct"
#: a tiny decoder whose head size (64) vLLM's CPU attention serves
TINY = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 256}
TOPICS = (
    "why the sky is blue",
    "how a bicycle stays upright",
    "what a prime number is",
    "how plants make sugar",
    "why ice floats",
    "how a rainbow forms",
    "what causes the seasons",
    "how vaccines work",
    "why bread rises",
    "how a compass works",
    "what an eclipse is",
    "how bees make honey",
    "why the sea is salty",
    "how a lever helps lift",
    "what a volcano is",
    "how sound travels",
)


def load() -> float:
    """The 1-minute load average."""
    return os.getloadavg()[0]


def vllm_unavailable() -> str | None:
    """Why the vLLM engine cannot run here, or ``None``."""
    from alignment_games.modules.lm.model_config import DECODES

    if "vllm" not in DECODES:
        return "this checkout has no lm.decode: vllm"
    if importlib.util.find_spec("vllm") is None:
        return 'the vllm package is not installed (pip install -e ".[vllm]")'
    return None


def model_path(args) -> str:
    from alignment_games.modules.lm.models import build_tiny_causal_lm

    if args.tiny:
        folder = os.path.join(tempfile.gettempdir(), "ag_bench_engines_tiny")
        return build_tiny_causal_lm(folder, TINY, seed=0, architecture="llama")
    return args.model


def banks(args, players: list[str], engines: list[str]) -> dict:
    """One bank per suite engine (the same adapters, moved off zero), and the peft model ``generate`` decodes."""
    import torch

    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.policy_bank import PolicyBank

    path = model_path(args)
    lm = {"lora_r": 16, "lora_alpha": 32, "vllm_kv_cache_gib": 0.25 if args.tiny else 1.0}
    own = PolicyBank(ModelConfig(path, decode="auto", **lm), players=players)
    with torch.no_grad():
        for i, p in enumerate(players):
            gen = torch.Generator().manual_seed(100 + i)
            for w in own.player_parameters(p):
                w.add_(0.02 * torch.randn(w.shape, generator=gen))
    out = {"own": own}
    if "vllm" in engines:
        out["vllm"] = PolicyBank(ModelConfig(path, decode="vllm", **lm), players=players)
        out["vllm"].load_state_dict(own.state_dict())
    return out


def merged_peer(bank, player: str):
    """transformers' model of the bank's base with ``player``'s adapter merged by peft, nothing of the suite left."""
    peer = bank.lm.with_adapters(bank.lm.load_model("causal_lm", frozen=True), [player])
    peer.load_state_dict({k: v for k, v in bank.model.state_dict().items() if ".lora_" not in k or f".{player}." in k})
    return peer.merge_and_unload().eval()


def hf_generate(model, tokenizer, ids, mask, g: int, tokens: int, adapter_names=None):
    """transformers' ``generate``: ``g`` sampled rows per prompt, every row ``tokens`` long."""
    import torch

    kw = {"adapter_names": [a for a in adapter_names for _ in range(g)]} if adapter_names else {}
    model.eval()  # peft takes adapter_names in eval mode only
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.repeat_interleave(g, dim=0),
            attention_mask=mask.repeat_interleave(g, dim=0),
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **kw,
        )
    return out[:, ids.shape[1] :]


def timed_rows(args, rows: dict, check) -> dict:
    """Run each of ``rows`` (name: call) once untimed, then ``--repeats`` times interleaved: median seconds and load."""
    import torch

    for name, call in rows.items():
        start = time.perf_counter()
        check(call())
        print(f"  warm-up {name}: {time.perf_counter() - start:.2f} s", flush=True)
    times = {name: [] for name in rows}
    loads = {name: [] for name in rows}
    for rep in range(args.repeats):
        names = list(rows) if rep % 2 == 0 else list(rows)[::-1]  # each engine first as often as last
        for name in names:
            torch.manual_seed(rep)
            start = time.perf_counter()
            check(rows[name]())
            times[name].append(time.perf_counter() - start)
            loads[name].append(load())
            print(f"  repeat {rep} {name}: {times[name][-1]:.2f} s (load {loads[name][-1]:.1f})", flush=True)
    return {n: {"seconds": statistics.median(times[n]), "load": statistics.median(loads[n])} for n in rows}


def section_decode(args, engines: list[str]) -> list[dict]:
    """16 prompts x 1 and one prompt x 1, ``--tokens`` each: the engines against transformers' generate."""
    from alignment_games.modules.lm.sampling import Sampling

    bank = banks(args, ["policy"], engines)
    own = bank["own"]
    peer = merged_peer(own, "policy")
    texts = [own.chat(None, f"In two sentences, explain {t}.") for t in TOPICS]
    sampling = Sampling(1.0, 1.0, args.tokens, args.tokens)
    results = []
    for n in (args.prompts, 1):
        prompts = texts[:n]
        ids, mask = own.encode_prompts(prompts).values()
        rows = {"generate": lambda ids=ids, mask=mask: hf_generate(peer, own.tokenizer, ids, mask, 1, args.tokens)}
        for e in engines:
            if e != "generate":
                rows[e] = lambda b=bank[e], x=prompts, w=ids.shape[1]: b.generate("policy", x, 1, sampling).sequences[
                    :, w:
                ]

        def check(new, n=n):  # every row writes all its tokens: no engine is faster by doing less
            if tuple(new.shape) != (n, args.tokens):
                raise RuntimeError(f"decode {n} prompts: {tuple(new.shape)} new tokens, expected ({n}, {args.tokens})")

        res = timed_rows(args, rows, check)
        results.append({"section": "decode", "prompts": n, "group": 1, "tokens": args.tokens, "rows": res})
    return results


def section_pool(args, engines: list[str]) -> list[dict]:
    """Three players' prompts, G samples each, in one mixed-adapter batch."""
    from alignment_games.modules.lm.sampling import Sampling

    players = ["m0", "m1", "m2"]
    bank = banks(args, players, engines)
    own = bank["own"]
    k = args.pool_prompts
    requests = [
        (p, [own.chat(None, f"Answer briefly: {TOPICS[i * k + j]}?") for j in range(k)]) for i, p in enumerate(players)
    ]
    sampling = Sampling(1.0, 1.0, args.tokens, args.tokens)
    flat = [x for _, xs in requests for x in xs]
    ids, mask = own.encode_prompts(flat).values()
    names = [p for p, xs in requests for _ in xs]
    g = args.group
    rows = {"generate": lambda: hf_generate(own.model, own.tokenizer, ids, mask, g, args.tokens, names)}
    for e in engines:
        if e != "generate":
            rows[e] = lambda b=bank[e]: [r.completion_mask for r in b.generate_each(requests, g, sampling)]

    def check(out):
        n = sum(int(m.sum()) for m in out) if isinstance(out, list) else out.numel()
        if n != len(flat) * g * args.tokens:
            raise RuntimeError(f"pool decode: {n} new tokens, expected {len(flat) * g * args.tokens}")

    res = timed_rows(args, rows, check)
    return [{"section": "pool", "players": 3, "prompts": len(flat), "group": g, "tokens": args.tokens, "rows": res}]


def section_grpo(args, engines: list[str]) -> list[dict]:
    """A whole GRPO step, ours with each engine and TRL, by vs_trl.py's workers (each its own process)."""
    b, g, tokens = (2, 2, 4) if args.tiny else (8, 4, args.tokens)
    common = [
        f"--workdir={os.path.join(tempfile.gettempdir(), 'ag_bench_engines_grpo' + ('_tiny' if args.tiny else ''))}",
        f"--b={b}",
        f"--g={g}",
        f"--tokens={tokens}",
        f"--rewards={1 if args.tiny else 5}",
        f"--steps={args.grpo_steps}",
        f"--discard={args.discard}",
        f"--threads={args.threads}",
        *([] if args.tiny else [f"--policy={args.model}"]),
    ]
    workers = {"trl": ["--worker=trl"]}
    for e in engines:
        if e == "own":
            workers["ours_own"] = ["--worker=ours"]
        elif e == "vllm":
            workers["ours_vllm"] = ["--worker=ours", "--decode=vllm"]
    env = worker_env(args.threads)
    steps = {w: [] for w in workers}
    loads = {w: [] for w in workers}
    order = list(workers)
    for rep in range(args.grpo_repeats):
        for who in order[rep % len(order) :] + order[: rep % len(order)]:
            run = run_worker(who, sys.executable, ROOT, [*common, *workers[who]], env, args.grpo_steps, b * g * tokens)
            steps[who] += [s["step"] for s in run[args.discard :]]
            loads[who].append(load())
            print(f"grpo repeat {rep} {who}: median step {statistics.median(steps[who]):.2f} s", flush=True)
    rows = {w: {"seconds": statistics.median(steps[w]), "load": statistics.median(loads[w])} for w in workers}
    return [{"section": "grpo", "prompts": b, "group": g, "tokens": tokens, "rows": rows}]


def print_result(r: dict) -> None:
    """One line per engine: its median seconds and load, and its ratio against the section's peer."""
    peer = "trl" if r["section"] == "grpo" else "generate"
    shape = f"{r['prompts']} prompts x G={r['group']} x {r['tokens']} tokens" + (
        " (3 adapters)" * (r["section"] == "pool")
    )
    base = r["rows"][peer]["seconds"]
    for name, x in r["rows"].items():
        ratio = "" if name == peer else f", {peer}/{name} {base / x['seconds']:.2f}x"
        print(f"{r['section']} {shape}: {name} {x['seconds']:.3f} s (load {x['load']:.1f}){ratio}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=MODEL, help="the base (a folder or builtin: alias)")
    ap.add_argument("--sections", default="decode,pool,grpo", help="comma list of decode, pool, grpo")
    ap.add_argument("--engines", default="own,generate,vllm", help="comma list of own, generate, vllm")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="a tiny random decoder and a few tokens: the smoke test")
    rows = ap.add_argument_group("the decode and pool rows")
    rows.add_argument("--prompts", type=int, default=16, help="prompts of the batched decode row")
    rows.add_argument("--tokens", type=int, default=64, help="new tokens of every row")
    rows.add_argument("--group", type=int, default=4, help="samples per prompt in the pool's decode")
    rows.add_argument("--pool-prompts", type=int, default=2, help="prompts per player in the pool's decode")
    rows.add_argument("--repeats", type=int, default=3, help="timed repeats of the decode and pool rows")
    grpo = ap.add_argument_group("the GRPO rows")
    grpo.add_argument("--grpo-steps", type=int, default=3, help="optimizer steps of each GRPO worker run")
    grpo.add_argument("--grpo-repeats", type=int, default=2, help="runs of each GRPO worker")
    grpo.add_argument("--discard", type=int, default=1, help="first steps of each GRPO run dropped")
    args = ap.parse_args()
    if args.tiny:
        args.prompts, args.tokens, args.repeats, args.grpo_steps, args.grpo_repeats = 2, 4, 1, 2, 1
        args.pool_prompts, args.group = 1, 2
    if args.grpo_steps <= args.discard:
        ap.error(f"--grpo-steps ({args.grpo_steps}) must exceed --discard ({args.discard})")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    info = host()
    print(host_line(info), flush=True)
    engines = args.engines.split(",")
    why = vllm_unavailable() if "vllm" in engines else None
    if why:
        print(f"vllm: engine not available: {why}; its rows are skipped", flush=True)
        engines.remove("vllm")
    if "generate" not in engines:
        engines.append("generate")  # the peer of every decode ratio
    results = []
    for section in args.sections.split(","):
        fn = {"decode": section_decode, "pool": section_pool, "grpo": section_grpo}[section]
        for r in fn(args, engines):
            print_result(r)
            results.append(r)
    print(json.dumps({"host": info, "vllm": why or "available", "results": results}))


if __name__ == "__main__":
    main()
