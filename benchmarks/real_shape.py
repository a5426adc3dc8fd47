"""One training step of each language-model family at a real model's shape: peak memory and seconds per phase.

The policy is a Qwen2.5-0.5B-shaped decoder built from a config (vocabulary 151,936, hidden 896, 14/2 heads,
intermediate 4,864, tied embeddings; ``--layers`` decoder blocks, 2 by default on a CPU, 24 is the real depth), saved
with the suite's byte tokenizer, random-initialised (nothing is downloaded). Players are LoRA adapters (r 8) on it.
Each family runs one step in its own process, at a batch that makes ``--rows`` sequences of ``--tokens`` completion
tokens (``min_new_tokens`` = ``max_new_tokens``, so every row decodes them all):

* ``grpo``: :class:`modules.grpo.GRPO`, ``rows / 4`` prompts x G = 4, two tiny reward models;
* ``trl``: the same GRPO step in TRL's ``GRPOTrainer`` (same policy, prompts, reward models, LoRA, β, one
  micro-batch), TRL's phases wrapped as in ``benchmarks/vs_trl.py``;
* ``deep_smida``: :class:`modules.deep_smida.DeepSMIDA`, ``rows / 4`` prompts x D = 2 x M = 2, an untrained
  ensemble utility over a tiny decoder (``--utility_backbone policy``: over the policy's own base);
* ``debate``: :class:`modules.debate.DebateSelfPlay` (debate_ab), ``rows / 4`` problems x G = 4, the programmatic
  judge, replies of ``--reply_tokens`` tokens;
* ``pool``: :class:`modules.pool.StackelbergPool`, m = 3 adapters, one duel of G = 4 GRPO rollouts per combatant
  (``rows`` answers), constrained peer judging.

Peak memory per phase is measured by :class:`benchmarks._phase_memory.PhaseMemory` (the profiler's allocation
timeline on CPU, ``torch.cuda.max_memory_allocated`` on a GPU): the most bytes tensors held during the phase above
what they held when the step began. The log-probability phase alone, chunked against full-vocabulary logits, is
``benchmarks/logprob_memory.py`` at the same shape, run here too.

    python benchmarks/real_shape.py                     # CPU: 2 layers, 8 rows x 256 tokens, all families + TRL
    python benchmarks/real_shape.py --families grpo,deep_smida,debate,pool --device cuda --layers 24 --dtype bfloat16
    python benchmarks/real_shape.py --tiny              # the code path at a tiny size (the smoke test)

The last line is ``peak_mem_ratio_vs_trl=<our GRPO step's peak / TRL's> logprob_mem_ratio_vs_full=<chunked / full>``
(a ratio is ``nan`` when a side was not run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import _common  # benchmarks/ is the script's folder
from _host import host, host_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

QWEN25_05B = {**_common.QWEN25_05B, "max_position_embeddings": 4096}
TINY = {
    "vocab_size": 4096,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
SMALL_DECODER = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}  # reward models, utility
FAMILIES = ("grpo", "trl", "deep_smida", "debate", "pool")
G = 4


def prepare(args) -> dict:
    """The policy, two reward models, a small decoder for the utility, and the prompts, on disk (reused if present)."""
    from alignment_games.modules.algorithms.arithmetic import generate_problems
    from alignment_games.modules.lm.models import build_tiny_causal_lm, build_tiny_reward_model

    shape = {**(TINY if args.tiny else QWEN25_05B), "num_hidden_layers": args.layers}
    work = args.workdir
    paths = {
        "policy": build_tiny_causal_lm(
            os.path.join(work, f"policy_{'tiny' if args.tiny else 'q05b'}_{args.layers}"), config=shape, seed=0
        ),
        "rewards": [
            build_tiny_reward_model(os.path.join(work, f"reward_{i}"), config=SMALL_DECODER, seed=100 + i)
            for i in range(2)
        ],
        "small": build_tiny_causal_lm(os.path.join(work, "small_decoder"), config=SMALL_DECODER, seed=1),
        "shape": shape,
    }
    paths["prompts"] = [p.question for p in generate_problems(64, seed=7)]
    return paths


# ---------------------------------------------------------------------- our families (Lightning)
def run_family(args, paths: dict) -> dict:
    """One step of one of our families under :class:`PhaseMemory`; its phases, peaks and seconds."""
    import lightning as L
    import torch

    from alignment_games.modules.algorithms.rl_losses import PolicyGradient
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.sampling import Sampling
    from benchmarks._phase_memory import PhaseMemory

    device = torch.device(args.device)
    meter = PhaseMemory(device)
    lm = ModelConfig(paths["policy"], lora_r=8, lora_alpha=16, dtype=args.dtype)
    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=args.tokens, min_new_tokens=args.tokens)
    b = max(1, args.rows // G)
    L.seed_everything(0)
    if args.worker == "grpo":
        from torch.utils.data import DataLoader

        from alignment_games.modules.grpo import GRPO

        model = GRPO(
            lm=lm,
            reward_models=paths["rewards"],
            answer_reward=False,
            policy_gradient=PolicyGradient(group_size=G, kl_coef=0.04, clip=0.2),
            lr=1e-5,
            grad_clip=1.0,
            sampling=sampling,
            chat_template=False,
        )
        rows = [{"prompt": p, "reference": None} for p in paths["prompts"]]
        data = {
            "train_dataloaders": DataLoader(
                rows,
                batch_size=b,
                collate_fn=lambda r: {"prompt": [x["prompt"] for x in r], "reference": [None] * len(r)},
            )
        }
    elif args.worker == "deep_smida":
        from alignment_games.datamodules.prompts import PromptDataModule
        from alignment_games.modules.deep_smida import DeepSMIDA
        from alignment_games.modules.preference import EnsembleUtility

        backbone = paths["policy"] if args.utility_backbone == "policy" else paths["small"]
        utility = EnsembleUtility(
            checkpoint=None,
            backbone=backbone,
            backbone_task="causal_lm",
            ensemble={"lm": ModelConfig(backbone, dtype=args.dtype)},
            allow_untrained=True,  # memory and time only: the heads need no training
        )
        model = DeepSMIDA(
            lm=lm,
            utility=utility,
            samples_per_prompt=2,
            follower_samples=2,
            sampling=sampling,
            leader_lr=1e-5,
            follower_lr=1e-5,
        )
        data = {"datamodule": PromptDataModule(num_prompts=64, batch_size=max(1, args.rows // 4))}
    elif args.worker == "debate":
        from alignment_games.datamodules.debate import DebateDataModule
        from alignment_games.modules.debate import DebateSelfPlay
        from alignment_games.modules.scorers.judges import ProgrammaticJudge

        model = DebateSelfPlay(
            lm=lm,
            protocol="debate_ab",
            judge=ProgrammaticJudge(num_votes=8),
            policy_gradient=PolicyGradient(group_size=G),
            sampling=sampling,
            reply_max_new_tokens=args.reply_tokens,
            require_thinking=False,
            lr=1e-5,
        )
        data = {"datamodule": DebateDataModule(problems="single_step", num_prompts=64, batch_size=b)}
    elif args.worker == "pool":
        from alignment_games.datamodules.pool import InstructionPoolDataModule
        from alignment_games.modules.games.pool_followers import FollowerTraining
        from alignment_games.modules.pool import StackelbergPool
        from alignment_games.modules.scorers.peer_judges import PeerJudging

        model = StackelbergPool(
            lm=lm,
            num_players=3,
            duels_per_iteration=1,
            num_iterations=1,
            sampling=sampling,
            eval_max_new_tokens=8,
            judging=PeerJudging(
                template="Rate 1 to 10.\n{prompt}\n{response}", mode="constrained", prefill='{"score": '
            ),
            followers=FollowerTraining(
                algorithm="grpo",
                policy_gradient=PolicyGradient(group_size=max(2, args.rows // 2)),
                batch_size=args.rows,
                lr=1e-5,
            ),
        )
        # generated arithmetic problems (a file source would need the datasets package, absent on the GPU machine)
        data = {"datamodule": InstructionPoolDataModule(num_problems=64, num_test_problems=8, batch_size=4)}
        # its end-of-training figures are not part of a step and need matplotlib (absent on the GPU machine)
        model.on_train_end = lambda: None
    else:
        raise ValueError(f"unknown family {args.worker!r}")
    meter.instrument(model)

    class Measure(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, *a):
            meter.begin()

        def on_train_batch_end(self, trainer, pl_module, *a):
            meter.end()

    accelerator = "gpu" if device.type == "cuda" else "cpu"
    trainer = _common.quiet_trainer(1, args.workdir, [Measure()], accelerator)
    trainer.fit(model, **data)
    out = meter.steps[-1]
    out["generated_tokens"] = float(getattr(model, "phase_times", {}).get("generated_tokens", 0.0))
    return out


# ---------------------------------------------------------------------- TRL
def run_trl(args, paths: dict) -> dict:
    """The GRPO step in TRL's GRPOTrainer under :class:`PhaseMemory` (CPU, fp32, as ``benchmarks/vs_trl.py``)."""
    from transformers import TrainerCallback

    from benchmarks._phase_memory import PhaseMemory

    meter = PhaseMemory(args.device)
    b = max(1, args.rows // G)
    bf16 = args.dtype != "float32"
    trainer = _common.trl_grpo_trainer(paths, paths["prompts"], args, b, G, args.tokens, bf16=bf16)
    tokens = {"n": 0.0}

    def count(n: float) -> None:
        tokens["n"] += n

    phased = _common.trl_phases(trainer, meter.phase, count)
    trainer.compute_loss = phased("forward", trainer.compute_loss)
    trainer.accelerator.backward = phased("backward", trainer.accelerator.backward)
    opt: dict = {}

    class Measure(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            meter.begin()

        def on_pre_optimizer_step(self, a, state, control, **kw):
            opt["cm"] = meter.phase("optimizer")
            opt["cm"].__enter__()

        def on_optimizer_step(self, a, state, control, **kw):
            opt.pop("cm").__exit__(None, None, None)

        def on_step_end(self, a, state, control, **kw):
            meter.end()

    trainer.add_callback(Measure())
    trainer.train()
    out = meter.steps[-1]
    out["generated_tokens"] = tokens["n"]
    return out


# ---------------------------------------------------------------------- driver
def _worker_argv(args, who: str) -> list[str]:
    keep = ("workdir", "layers", "rows", "tokens", "reply_tokens", "device", "dtype", "threads", "utility_backbone")
    argv = [f"--{k}={getattr(args, k)}" for k in keep]
    return argv + (["--tiny"] if args.tiny else []) + [f"--worker={who}"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma list of {', '.join(FAMILIES)}")
    ap.add_argument("--layers", type=int, default=2, help="decoder blocks (Qwen2.5-0.5B has 24)")
    ap.add_argument("--rows", type=int, default=8, help="sequences per step (a multiple of 4)")
    ap.add_argument("--tokens", type=int, default=256, help="completion tokens per sequence")
    ap.add_argument("--reply_tokens", type=int, default=64, help="tokens of the debate's critique and rebuttal")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--utility_backbone", choices=("small", "policy"), default="small")
    ap.add_argument("--no_logprob", action="store_true", help="skip benchmarks/logprob_memory.py")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "ag_real_shape"))
    ap.add_argument("--tiny", action="store_true", help="tiny shape, 4 rows x 8 tokens: the smoke test")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tiny:
        args.rows, args.tokens, args.reply_tokens = 4, 8, 4
    if args.rows % 4 or args.rows < 4:
        ap.error(f"--rows must be a positive multiple of 4 (G = 4, D x M = 4), got {args.rows}")
    families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        ap.error(f"--families: unknown {unknown}; known: {', '.join(FAMILIES)}")
    os.makedirs(args.workdir, exist_ok=True)
    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        paths = prepare(args)
        result = (run_trl if args.worker == "trl" else run_family)(args, paths)
        print("RESULT " + json.dumps(result), flush=True)
        return result
    paths = prepare(args)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # ROOT first, then the caller's path (gpu_bench puts a stand-in for the alignment_games install there)
        "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": str(args.threads),
    }
    results: dict = {
        "shape": paths["shape"],
        "rows": args.rows,
        "completion_tokens": args.tokens,
        "device": args.device,
        "dtype": args.dtype,
        "families": {},
    }
    for who in families:
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), *_worker_argv(args, who)],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
        )
        if proc.returncode != 0:
            sys.exit(f"{who} failed:\n{proc.stderr[-4000:]}")
        line = next(s for s in reversed(proc.stdout.splitlines()) if s.startswith("RESULT "))
        res = json.loads(line[len("RESULT ") :])
        res["wall_seconds"] = round(time.perf_counter() - start, 1)
        results["families"][who] = res
        phases = ", ".join(
            f"{k} {v['peak_bytes'] / 2**30:.3f} GiB / {v['seconds']:.1f} s"
            for k, v in res.items()
            if isinstance(v, dict)
        )
        print(
            f"{who}: {phases}; generated tokens {res['generated_tokens']:.0f} (process {res['wall_seconds']} s)",
            flush=True,
        )
    if "grpo" in results["families"] and "trl" in results["families"]:
        ours, theirs = results["families"]["grpo"], results["families"]["trl"]
        if ours["generated_tokens"] != theirs["generated_tokens"]:
            sys.exit(f"generated tokens differ: ours {ours['generated_tokens']}, TRL {theirs['generated_tokens']}")
        mem_ratio = ours["step"]["peak_bytes"] / theirs["step"]["peak_bytes"]
    else:
        mem_ratio = float("nan")
    lp_ratio = float("nan")
    if not args.no_logprob:
        cmd = [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "logprob_memory.py"),
            f"--layers={args.layers}",
            f"--rows={args.rows}",
            f"--tokens={args.tokens}",
            f"--device={args.device}",
        ]
        proc = subprocess.run(
            cmd + (["--tiny"] if args.tiny else []), capture_output=True, text=True, env=env, cwd=ROOT
        )
        if proc.returncode != 0:
            sys.exit(f"logprob_memory failed:\n{proc.stderr[-4000:]}")
        results["logprob"] = json.loads(next(s for s in proc.stdout.splitlines() if s.startswith("{")))
        lp_ratio = results["logprob"]["chunked_peak_bytes"] / results["logprob"]["full_peak_bytes"]
    results["peak_mem_ratio_vs_trl"], results["logprob_mem_ratio_vs_full"] = mem_ratio, lp_ratio
    results["host"] = host()
    print(json.dumps(results))
    print(host_line(results["host"]))
    print(f"peak_mem_ratio_vs_trl={mem_ratio:.4f} logprob_mem_ratio_vs_full={lp_ratio:.4f}")
    return results


if __name__ == "__main__":
    main()
