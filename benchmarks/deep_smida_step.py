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

import os
import statistics
import tempfile

import _common  # benchmarks/ is the script's folder


def worker(args) -> dict:
    import lightning as L
    import torch

    torch.set_num_threads(args.threads)
    from alignment_games.datamodules.prompts import PromptDataModule
    from alignment_games.modules.deep_smida import DeepSMIDA
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.sampling import Sampling
    from alignment_games.modules.preference import EnsembleUtility

    policy = args.policy or _common.tiny_policy()
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
    data = PromptDataModule(num_prompts=200, batch_size=args.b)
    times = _common.fit_phases(model, data, 2 * args.steps, os.path.join(tempfile.gettempdir(), "ag_bench_runs"))
    kept = times[2:]
    phases = ["generate", "score", "logprob", "backward", "optimizer"]
    med = {p: statistics.median(t[p] for t in kept) for p in phases}
    med["step"] = statistics.median(sum(t[p] for p in phases) for t in kept)
    med["generated_tokens_per_s"] = statistics.median(t["generated_tokens"] / t["generate"] for t in kept)
    return med


def main() -> None:
    ap = _common.step_parser(__doc__, "players")
    ap.add_argument("--d", type=int, default=2)
    ap.add_argument("--m", type=int, default=2)
    args = _common.parse_or_work(ap, "players", worker)
    if args is None:
        return
    res = {}
    for players in ("lora", "separate"):
        argv = [f"--players={players}", *_common.worker_argv(args, ("players",))]
        res[players] = r = _common.worker_json(__file__, argv)
        print(
            f"{players:9s} step={r['step']:.3f}s  generate={r['generate']:.3f}  score={r['score']:.3f}  "
            f"logprob={r['logprob']:.3f}  backward={r['backward']:.3f}  optimizer={r['optimizer']:.4f}  "
            f"gen_tokens/s={r['generated_tokens_per_s']:.0f}"
        )
    print(f"separate_vs_lora={res['separate']['step'] / res['lora']['step']:.2f}")


if __name__ == "__main__":
    main()
