"""Wall time of one debate self-play step by phase: generate per ply, judge, log-prob, backward, optimizer.

Runs a few training steps of :class:`modules.debate.DebateSelfPlay` per protocol with a tiny Qwen2 policy
(random-initialised from a config dict, nothing downloaded) and either the programmatic judge or, with
``--hf_judge``, a tiny Qwen2 as the frozen LLM judge (8 sampled verdicts per transcript in one ``generate`` call):

    python benchmarks/debate_step.py                         # B=4, G=4, 64/48 new tokens, 6 steps (2 dropped)
    python benchmarks/debate_step.py --hf_judge --judge_tokens 32
    python benchmarks/debate_step.py --policy Qwen/Qwen2.5-1.5B-Instruct --dtype bfloat16   # on a GPU

Each protocol runs in its own process; one line of medians per protocol.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PHASES = ["generate_answer", "generate_critique", "generate_rebuttal", "judge", "logprob", "backward", "optimizer"]


def worker(args) -> dict:
    import lightning as L
    import torch

    torch.set_num_threads(args.threads)
    from alignment_games.datamodules.debate import DebateDataModule
    from alignment_games.modules.debate import DebateSelfPlay
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.models import build_tiny_causal_lm
    from alignment_games.modules.lm.sampling import Sampling
    from alignment_games.modules.scorers.judges import HFJudge, ProgrammaticJudge

    tiny = os.path.join(tempfile.gettempdir(), "ag_bench_tiny")
    policy = args.policy or build_tiny_causal_lm(
        tiny, config={"hidden_size": 96, "intermediate_size": 256, "num_hidden_layers": 3}
    )
    judge = (
        HFJudge(
            args.judge or policy, num_votes=8, sampling=Sampling(max_new_tokens=args.judge_tokens), dtype=args.dtype
        )
        if args.hf_judge
        else ProgrammaticJudge(num_votes=8)
    )
    L.seed_everything(0)
    model = DebateSelfPlay(
        lm=ModelConfig(policy, dtype=args.dtype),
        protocol=args.protocol,
        judge=judge,
        group_size=args.g,
        sampling=Sampling(temperature=0.6, max_new_tokens=args.tokens),
        reply_max_new_tokens=args.reply_tokens,
        require_thinking=False,
        lr=1e-4,
    )
    times = []

    class Collect(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *a):
            times.append(dict(pl_module.phase_times))

    trainer = L.Trainer(
        max_steps=args.steps,
        logger=False,
        default_root_dir=os.path.join(tempfile.gettempdir(), "ag_bench_runs"),  # not cwd
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        callbacks=[Collect()],
        accelerator="auto",
        devices=1,
    )
    trainer.fit(model, DebateDataModule(problems="single_step", num_prompts=200, batch_size=args.b))
    kept = times[2:]
    med = {p: statistics.median(t.get(p, 0.0) for t in kept) for p in PHASES}
    med["step"] = statistics.median(sum(t.get(p, 0.0) for p in PHASES) for t in kept)
    gen = [sum(t.get(p, 0.0) for p in PHASES if p.startswith("generate")) for t in kept]
    med["generated_tokens_per_s"] = statistics.median(t["generated_tokens"] / g for t, g in zip(kept, gen))
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default=None)
    ap.add_argument("--judge", default=None, help="HF judge model (default: the policy's base)")
    ap.add_argument("--hf_judge", action="store_true", help="an LLM judge instead of the programmatic one")
    ap.add_argument("--judge_tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--b", type=int, default=4)
    ap.add_argument("--g", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reply_tokens", type=int, default=48)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--protocols", default="rlaif_a,debate_ab,debate_aba,rlvr")
    ap.add_argument("--protocol", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.protocol:
        print(json.dumps(worker(args)))
        return
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for protocol in args.protocols.split(","):
        cmd = [sys.executable, __file__, "--protocol", protocol] + [
            f"--{k}={v}" for k, v in vars(args).items() if k not in ("protocol", "hf_judge") and v is not None
        ]
        cmd += ["--hf_judge"] if args.hf_judge else []
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout.strip().splitlines()[-1]
        r = json.loads(out)
        gen = " ".join(f"{p[9:]}={r[p]:.3f}" for p in PHASES if p.startswith("generate") and r[p] > 0)
        print(
            f"{protocol:10s} step={r['step']:.3f}s  generate[{gen}]  judge={r['judge']:.3f}  logprob={r['logprob']:.3f}"
            f"  backward={r['backward']:.3f}  optimizer={r['optimizer']:.4f}"
            f"  gen_tokens/s={r['generated_tokens_per_s']:.0f}"
        )


if __name__ == "__main__":
    main()
