"""The same GRPO workload run by this suite (:class:`modules.grpo.GRPO`) and by TRL's ``GRPOTrainer``, step by step.

Both sides get the same random-initialised tiny Qwen2 policy saved to a folder, the same prompts in the same order
(generated arithmetic, no shuffling), ``G`` generations per prompt with the same number of new tokens (EOS suppressed
until ``max_new_tokens`` by a minimum length), five sequence-classification reward models (random tiny Qwen2
classifiers, loaded by path on both sides), the same LoRA adapter (rank, alpha, peft's default target modules), the
same β (the reference is the disabled adapter on both sides), the same clipped loss (TRL ``loss_type="grpo"``:
sequence mean then batch mean; one update per rollout), AdamW with the same rate and gradient clipping, and the same
number of optimizer steps, in fp32 on CPU with ``--threads`` threads. TRL is configured as fast as it allows for that
work: the whole batch in one micro-batch (no gradient accumulation, one generation per optimizer step), no gradient
checkpointing, no bf16, no logging, no saving. Each framework runs in its own process, the order alternates between
repeats, and the first ``--discard`` steps of every run are dropped.

    python benchmarks/vs_trl.py                      # 64, 128 (3 repeats x 6 steps), 256 new tokens (3 x 5 steps)
    python benchmarks/vs_trl.py --tokens 256 --repeats 2 --steps 5                # one length
    python benchmarks/vs_trl.py --trl-python path/to/other/venv/bin/python   # TRL from a separate environment
    python benchmarks/vs_trl.py --policy builtin:smollm2-135m-instruct --decode vllm  # SmolLM2; ours rolls out by vLLM
    python benchmarks/vs_trl.py --before path/to/earlier/checkout   # also that checkout's GRPO, in the same run

With ``--before``, a checkout of an earlier commit (its own ``.venv``, or ``--before-python``) runs as a third worker in
every repeat, so its ratio to TRL and ours come from the same spells of machine load; the order rotates, then rotates
reversed, so that over 6 repeats each worker follows each other one equally often (give ``--repeats 6``).

Every step of both sides must generate exactly ``B x G x tokens`` tokens (checked; a run that generated fewer would be
faster by doing less). For each completion length it prints each phase's median time (generate, score, reference
log-probs, forward + backward, optimizer) for both and the interquartile range of the step-time ratio (every TRL step
against every step of ours from the same repeat); then one line per length, and, as its last line,
``speedup_vs_trl=<median TRL step time / median step time of ours>`` at 64 tokens. A step's time is the wall
time between the ends of consecutive optimizer steps (data, generation, scoring, update: everything).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

import _common  # benchmarks/ is the script's folder
from _host import host, host_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PHASES = ("generate", "score", "ref_logprobs", "forward_backward", "optimizer")
POLICY = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4}
REWARD = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}


def prepare(workdir: str, num_prompts: int, num_rewards: int, policy: str | None = None) -> dict:
    """Policy (``policy``: that model instead of the tiny one), reward models and prompts on disk (idempotent); the
    paths both workers read."""
    from alignment_games.modules.algorithms.arithmetic import generate_problems
    from alignment_games.modules.lm.models import build_tiny_causal_lm, build_tiny_reward_model, resolve_name_or_path

    os.makedirs(workdir, exist_ok=True)
    if policy:
        policy = resolve_name_or_path(policy)  # a folder both frameworks load (a builtin: alias's converted one)
    else:
        policy = build_tiny_causal_lm(os.path.join(workdir, "policy"), config=POLICY, seed=0)
    rewards = [
        build_tiny_reward_model(os.path.join(workdir, f"reward_{i}"), config=REWARD, seed=100 + i)
        for i in range(num_rewards)
    ]
    prompts = [p.question for p in generate_problems(num_prompts, seed=7)]
    path = os.path.join(workdir, "prompts.json")
    with open(path, "w") as f:
        json.dump(prompts, f)
    return {"policy": policy, "rewards": rewards, "prompts": path}


# ---------------------------------------------------------------------- ours
def run_ours(args, paths: dict) -> list[dict]:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from alignment_games.modules.algorithms.rl_losses import PolicyGradient
    from alignment_games.modules.grpo import GRPO
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.sampling import Sampling

    prompts = json.load(open(paths["prompts"]))
    L.seed_everything(args.seed)
    model = GRPO(
        lm=ModelConfig(
            paths["policy"], players="lora", lora_r=args.lora_r, lora_alpha=2 * args.lora_r, decode=args.decode
        ),
        reward_models=paths["rewards"],
        answer_reward=False,
        policy_gradient=PolicyGradient(group_size=args.g, kl_coef=args.beta, clip=0.2),
        lr=args.lr,
        grad_clip=1.0,
        sampling=Sampling(temperature=1.0, top_p=1.0, max_new_tokens=args.tokens, min_new_tokens=args.tokens),
        chat_template=False,
    )
    loader = DataLoader(
        [{"prompt": p, "reference": None} for p in prompts],
        batch_size=args.b,
        shuffle=False,
        collate_fn=lambda rows: {"prompt": [r["prompt"] for r in rows], "reference": [None] * len(rows)},
    )
    steps: list[dict] = []

    class Collect(L.Callback):
        def __init__(self) -> None:
            self.last = None

        def on_train_batch_start(self, trainer, pl_module, *a):
            if self.last is None:
                self.last = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, *a):
            now = time.perf_counter()
            t = pl_module.phase_times
            steps.append(
                {
                    "step": now - self.last,
                    "generate": t["generate"],
                    "score": t["score"],
                    "ref_logprobs": t.get("ref_logprobs", 0.0),
                    "forward_backward": t["backward"],
                    "optimizer": t["optimizer"],
                    "tokens": t["generated_tokens"],
                }
            )
            self.last = now

    accelerator = "gpu" if args.device == "cuda" else "cpu"
    # the end-of-fit export goes under the work folder, not the cwd
    trainer = _common.quiet_trainer(args.steps, os.path.join(args.workdir, "ours_out"), [Collect()], accelerator)
    torch.set_num_threads(args.threads)
    trainer.fit(model, train_dataloaders=loader)
    return steps


# ---------------------------------------------------------------------- TRL
def run_trl(args, paths: dict) -> list[dict]:
    import torch
    from transformers import TrainerCallback

    prompts = json.load(open(paths["prompts"]))
    steps: list[dict] = []
    current: dict = {}
    trainer = _common.trl_grpo_trainer(
        paths,
        prompts,
        args,
        args.b,
        args.g,
        args.tokens,
        max_steps=args.steps,
        bf16=False,
        # on a GPU both bases in bf16 (ours: lm.dtype auto), the adapters in fp32 (peft's default cast)
        model_init_kwargs={"dtype": "bfloat16"} if args.device == "cuda" else None,
        fp16=False,
        scale_rewards="group",
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
    )

    @contextmanager
    def timed(name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            current[name] = current.get(name, 0.0) + time.perf_counter() - t0

    def count(n: float) -> None:
        # the micro-batch is the whole batch, so this counts every generated token of the step
        current["tokens"] = current.get("tokens", 0.0) + n

    # the reference log-probs: called under no_grad only for the reference (one generation per optimizer step)
    wrap = _common.trl_phases(trainer, timed, count)
    trainer._prepare_inputs = wrap("prepare", trainer._prepare_inputs)
    trainer.training_step = wrap("training_step", trainer.training_step)

    class Collect(TrainerCallback):
        def __init__(self) -> None:
            self.last = None

        def on_step_begin(self, a, state, control, **kw):
            if self.last is None:
                self.last = time.perf_counter()

        def on_pre_optimizer_step(self, a, state, control, **kw):
            current["opt_start"] = time.perf_counter()

        def on_optimizer_step(self, a, state, control, **kw):
            current["optimizer"] = time.perf_counter() - current.pop("opt_start")

        def on_step_end(self, a, state, control, **kw):
            now = time.perf_counter()
            steps.append(
                {
                    "step": now - self.last,
                    "generate": current.get("generate", 0.0),
                    "score": current.get("score", 0.0),
                    "ref_logprobs": current.get("ref_logprobs", 0.0),
                    # training_step = _prepare_inputs (generate, score, reference) + forward + backward
                    "forward_backward": current["training_step"] - current["prepare"],
                    "optimizer": current.get("optimizer", 0.0),
                    "tokens": current.get("tokens", 0.0),
                }
            )
            current.clear()
            self.last = now

    trainer.add_callback(Collect())
    torch.set_num_threads(args.threads)
    trainer.train()
    return steps


# ---------------------------------------------------------------------- driver
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=os.path.join("/tmp", "ag_vs_trl"))
    ap.add_argument("--trl-python", default=sys.executable, help="Python of an environment with TRL installed")
    ap.add_argument("--b", type=int, default=8, help="prompts per step")
    ap.add_argument("--g", type=int, default=4, help="generations per prompt")
    ap.add_argument("--tokens", type=int, default=None, help="one completion length instead of the sweep")
    ap.add_argument("--lengths", default="64,128,256", help="completion lengths of the sweep (comma list)")
    ap.add_argument("--long-steps", type=int, default=5, help="optimizer steps per run at lengths above 128")
    ap.add_argument("--rewards", type=int, default=5, help="reward models")
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per run")
    ap.add_argument("--discard", type=int, default=2, help="first steps of each run dropped")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: both frameworks on the GPU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--before", help="checkout of an earlier commit whose GRPO also runs, in every repeat")
    ap.add_argument("--before-python", help="its Python (default: <before>/.venv/bin/python)")
    ap.add_argument("--policy", default=None, help="a model folder or builtin: alias instead of the tiny Qwen2")
    ap.add_argument("--decode", default="auto", help="lm.decode of ours (e.g. vllm: the vLLM engine)")
    ap.add_argument("--worker", choices=("ours", "trl"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        paths = prepare(args.workdir, args.b * args.steps, args.rewards, args.policy)
        steps = (run_ours if args.worker == "ours" else run_trl)(args, paths)
        print("RESULT " + json.dumps(steps), flush=True)
        return
    env = worker_env(args.threads, args.device)
    if args.before:
        args.before = os.path.abspath(args.before)
        args.before_python = args.before_python or os.path.join(args.before, ".venv", "bin", "python")
    lengths = [args.tokens] if args.tokens else [int(x) for x in args.lengths.split(",")]
    results = {}
    for tokens in lengths:
        steps = args.steps if args.tokens or tokens <= 128 else args.long_steps
        if args.discard >= steps:
            ap.error(f"steps ({steps}) must exceed --discard ({args.discard})")
        results[tokens] = run_length(args, env, tokens, steps)
    print()
    print(host_line(host()))
    for tokens, r in results.items():
        print(
            f"tokens={tokens} speedup={r['speedup']:.2f} ratio_iqr=[{r['q1']:.2f}, {r['q3']:.2f}] "
            + " ".join(f"{p}={r['phase_ratios'][p]:.2f}x" for p in PHASES if p != "optimizer")
            + (f" before_speedup={r['before_speedup']:.2f}" if args.before else "")
        )
    headline = results[64] if 64 in results else results[lengths[0]]
    print(f"speedup_vs_trl={headline['speedup']:.2f}")


def worker_env(threads: int, device: str = "cpu") -> dict:
    """The workers' environment: offline, ``threads`` threads, no GPU unless ``device`` is cuda, this checkout
    importable."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}),
        "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),  # keeps alignment_games
    }


def run_worker(who: str, python: str, root: str, argv: list[str], env: dict, steps: int, tokens: int) -> list[dict]:
    """One worker process (``root``'s vs_trl.py with ``argv``): its steps, each checked to generate ``tokens``.

    Exits naming the worker when it fails, records another number of steps or generates another number of tokens.
    """
    proc = subprocess.run(
        [python, os.path.join(root, "benchmarks", "vs_trl.py"), *argv],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))},
        cwd=root,
    )
    if proc.returncode != 0:
        sys.exit(f"{who} worker failed:\n{proc.stderr[-4000:]}")
    line = next(s for s in reversed(proc.stdout.splitlines()) if s.startswith("RESULT "))
    run = json.loads(line[len("RESULT ") :])
    if len(run) != steps:
        sys.exit(f"{who} worker recorded {len(run)} steps, expected {steps}")
    counts = sorted({s["tokens"] for s in run})
    if counts != [tokens]:
        # a faster step that generated fewer tokens would be less work, not more speed
        sys.exit(f"{who} worker generated {counts} tokens per step, expected {tokens}")
    return run


def run_length(args, env: dict, tokens: int, steps: int) -> dict:
    """All repeats of both frameworks at one completion length; prints the phase table, returns the ratios."""
    common = [
        f"--workdir={args.workdir}",
        f"--b={args.b}",
        f"--g={args.g}",
        f"--tokens={tokens}",
        f"--rewards={args.rewards}",
        f"--beta={args.beta}",
        f"--lr={args.lr}",
        f"--lora-r={args.lora_r}",
        f"--steps={steps}",
        f"--discard={args.discard}",
        f"--threads={args.threads}",
        f"--seed={args.seed}",
        *([f"--device={args.device}"] if args.device != "cpu" else []),
        *([f"--policy={args.policy}"] if args.policy else []),
        *([f"--decode={args.decode}"] if args.decode != "auto" else []),
    ]
    expected_tokens = args.b * args.g * tokens  # min_new_tokens = max_new_tokens: every row decodes `tokens`
    workers = ["ours", "trl", *(["before"] if args.before else [])]
    kept: dict[str, list[dict]] = {w: [] for w in workers}
    pair_ratios: list[float] = []
    before_ratios: list[float] = []  # every step of `before` against every step of ours from the same repeat
    for rep in range(args.repeats):
        # rotations, then rotations of the reversed list: over 2 x len(workers) repeats each worker runs after each
        # other one equally often (a plain rotation of three always runs `before` right after TRL)
        lists = (workers, workers[::-1]) if len(workers) > 2 else (workers,)
        orders = [w[i:] + w[:i] for w in lists for i in range(len(workers))]
        order = orders[rep % len(orders)]
        this_rep: dict[str, list[dict]] = {}
        for who in order:
            python, root, worker = {"trl": (args.trl_python, ROOT, "trl"), "ours": (sys.executable, ROOT, "ours")}.get(
                who, (args.before_python, args.before, "ours")
            )
            run = run_worker(who, python, root, [*common, f"--worker={worker}"], env, steps, expected_tokens)
            this_rep[who] = run[args.discard :]
            kept[who].extend(this_rep[who])
            med = statistics.median(s["step"] for s in this_rep[who])
            print(f"tokens {tokens} repeat {rep} {who:6s}: median step {med:.3f} s", flush=True)
        # every TRL step against every step of ours from the same repeat (the same spell of machine load)
        pair_ratios += [t["step"] / o["step"] for t in this_rep["trl"] for o in this_rep["ours"]]
        before_ratios += [b["step"] / o["step"] for b in this_rep.get("before", []) for o in this_rep["ours"]]
    print(
        f"\nworkload: B={args.b} prompts x G={args.g} generations, {tokens} new tokens ({expected_tokens} generated "
        f"tokens per step on both sides), {args.rewards} reward models, beta={args.beta}, LoRA r={args.lora_r}, fp32 "
        f"CPU {args.threads} threads; {args.repeats} repeats x {steps - args.discard} kept steps per framework "
        "(medians, seconds)"
    )
    print(f"{'phase':18s} {'ours':>8s} {'TRL':>8s} {'TRL/ours':>9s}")
    medians, ratios = {}, {}
    for phase in (*PHASES, "step"):
        o = statistics.median(s[phase] for s in kept["ours"])
        t = statistics.median(s[phase] for s in kept["trl"])
        medians[phase] = (o, t)
        ratios[phase] = t / o if o > 0 else float("nan")
        print(f"{phase:18s} {o:8.3f} {t:8.3f} {ratios[phase]:9.2f}")
    q1, _, q3 = statistics.quantiles(pair_ratios, n=4) if len(pair_ratios) > 1 else pair_ratios * 3
    o, t = medians["step"]
    print(f"tokens={tokens}: step ratio TRL/ours {t / o:.2f}, interquartile range of step ratios [{q1:.2f}, {q3:.2f}]")
    out = {"speedup": t / o, "q1": q1, "q3": q3, "phase_ratios": ratios, "medians": medians}
    if args.before:
        b = statistics.median(s["step"] for s in kept["before"])
        print(f"{'before: step':18s} {b:8.3f} {t:8.3f} {t / b:9.2f}   (the checkout {args.before})")
        bq1, _, bq3 = statistics.quantiles(before_ratios, n=4) if len(before_ratios) > 1 else before_ratios * 3
        print(
            f"tokens={tokens}: step ratio TRL/before {t / b:.2f}, before/ours {b / o:.2f}, "
            f"interquartile range of before/ours step ratios [{bq1:.2f}, {bq3:.2f}]"
        )
        out.update(before_speedup=t / b, before_over_ours=b / o, before_q1=bq1, before_q3=bq3)
    return out


if __name__ == "__main__":
    main()
