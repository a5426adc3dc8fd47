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

import os
import statistics
import tempfile

import _common  # benchmarks/ is the script's folder

PHASES = ["generate_answer", "generate_critique", "generate_rebuttal", "judge", "logprob", "backward", "optimizer"]


def worker(args) -> dict:
    import lightning as L
    import torch

    torch.set_num_threads(args.threads)
    from alignment_games.datamodules.debate import DebateDataModule
    from alignment_games.modules.algorithms.rl_losses import PolicyGradient
    from alignment_games.modules.debate import DebateSelfPlay
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.sampling import Sampling
    from alignment_games.modules.scorers.judges import HFJudge, ProgrammaticJudge

    policy = args.policy or _common.tiny_policy()
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
        policy_gradient=PolicyGradient(group_size=args.g),
        sampling=Sampling(temperature=0.6, max_new_tokens=args.tokens),
        reply_max_new_tokens=args.reply_tokens,
        require_thinking=False,
        lr=1e-4,
    )
    data = DebateDataModule(problems="single_step", num_prompts=200, batch_size=args.b)
    times = _common.fit_phases(model, data, args.steps, os.path.join(tempfile.gettempdir(), "ag_bench_runs"))
    kept = times[2:]
    med = {p: statistics.median(t.get(p, 0.0) for t in kept) for p in PHASES}
    med["step"] = statistics.median(sum(t.get(p, 0.0) for p in PHASES) for t in kept)
    gen = [sum(t.get(p, 0.0) for p in PHASES if p.startswith("generate")) for t in kept]
    med["generated_tokens_per_s"] = statistics.median(t["generated_tokens"] / g for t, g in zip(kept, gen))
    return med


def main() -> None:
    ap = _common.step_parser(__doc__, "protocol")
    ap.add_argument("--judge", default=None, help="HF judge model (default: the policy's base)")
    ap.add_argument("--hf_judge", action="store_true", help="an LLM judge instead of the programmatic one")
    ap.add_argument("--judge_tokens", type=int, default=32)
    ap.add_argument("--g", type=int, default=4)
    ap.add_argument("--reply_tokens", type=int, default=48)
    ap.add_argument("--protocols", default="rlaif_a,debate_ab,debate_aba,rlvr")
    args = _common.parse_or_work(ap, "protocol", worker)
    if args is None:
        return
    for protocol in args.protocols.split(","):
        r = _common.worker_json(__file__, ["--protocol", protocol, *_common.worker_argv(args, ("protocol",))])
        gen = " ".join(f"{p[9:]}={r[p]:.3f}" for p in PHASES if p.startswith("generate") and r[p] > 0)
        print(
            f"{protocol:10s} step={r['step']:.3f}s  generate[{gen}]  judge={r['judge']:.3f}  logprob={r['logprob']:.3f}"
            f"  backward={r['backward']:.3f}  optimizer={r['optimizer']:.4f}"
            f"  gen_tokens/s={r['generated_tokens_per_s']:.0f}"
        )


if __name__ == "__main__":
    main()
