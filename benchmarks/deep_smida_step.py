"""Wall time of one deep-SMIDA step split into generate / score / log-prob / backward / optimizer, and tokens/s.

Runs a few training steps of :class:`modules.deep_smida.DeepSMIDA` with a tiny Qwen2 policy (random-initialised from
a config dict, so nothing is downloaded) against an untrained 5-member MiniLM ensemble, for the default layout (two
LoRA adapters over one frozen base, the reference through the disabled adapter) and for the peer layout (two full
copies plus a frozen reference copy), each in its own process:

    python benchmarks/deep_smida_step.py                      # B=4, D=2, M=2, 64 new tokens, 6 steps (2 dropped)
    python benchmarks/deep_smida_step.py --policy Qwen/Qwen2.5-1.5B-Instruct --dtype bfloat16   # on a GPU

The last line is ``separate_vs_lora=<median step time of separate copies / of LoRA adapters>``.
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


def worker(args) -> dict:
    import lightning as L
    import torch

    torch.set_num_threads(args.threads)
    from alignment_games.datamodules.prompts import PromptDataModule
    from alignment_games.modules.deep_smida import DeepSMIDA
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.models import build_tiny_causal_lm
    from alignment_games.modules.lm.sampling import Sampling
    from alignment_games.modules.preference import EnsembleUtility

    policy = args.policy or build_tiny_causal_lm(
        os.path.join(tempfile.gettempdir(), "ag_bench_tiny"),
        config={"hidden_size": 96, "intermediate_size": 256, "num_hidden_layers": 3},
    )
    L.seed_everything(0)
    model = DeepSMIDA(
        lm=ModelConfig(policy, players=args.players, dtype=args.dtype),
        utility=EnsembleUtility(allow_untrained=True),  # timing only: the heads need no training
        samples_per_prompt=args.d,
        follower_samples=args.m,
        sampling=Sampling(temperature=0.6, max_new_tokens=args.tokens),
        leader_lr=1e-4,
        follower_lr=2e-4,
    )
    times = []

    class Collect(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *a):
            times.append(dict(pl_module.phase_times))

    trainer = L.Trainer(
        max_steps=2 * args.steps,
        logger=False,
        default_root_dir=os.path.join(tempfile.gettempdir(), "ag_bench_runs"),  # not cwd
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        callbacks=[Collect()],
        accelerator="auto",
        devices=1,
    )
    trainer.fit(model, PromptDataModule(num_prompts=200, batch_size=args.b))
    kept = times[2:]
    phases = ["generate", "score", "logprob", "backward", "optimizer"]
    med = {p: statistics.median(t[p] for t in kept) for p in phases}
    med["step"] = statistics.median(sum(t[p] for p in phases) for t in kept)
    med["generated_tokens_per_s"] = statistics.median(t["generated_tokens"] / t["generate"] for t in kept)
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--b", type=int, default=4)
    ap.add_argument("--d", type=int, default=2)
    ap.add_argument("--m", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--players", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.players:
        print(json.dumps(worker(args)))
        return
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    res = {}
    for players in ("lora", "separate"):
        cmd = [sys.executable, __file__, "--players", players] + [
            f"--{k}={v}" for k, v in vars(args).items() if k != "players" and v is not None
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout.strip().splitlines()[-1]
        res[players] = r = json.loads(out)
        print(
            f"{players:9s} step={r['step']:.3f}s  generate={r['generate']:.3f}  score={r['score']:.3f}  "
            f"logprob={r['logprob']:.3f}  backward={r['backward']:.3f}  optimizer={r['optimizer']:.4f}  "
            f"gen_tokens/s={r['generated_tokens_per_s']:.0f}"
        )
    print(f"separate_vs_lora={res['separate']['step'] / res['lora']['step']:.2f}")


if __name__ == "__main__":
    main()
