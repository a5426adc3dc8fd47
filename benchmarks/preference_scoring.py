"""Scoring throughput, peak memory and training-step time of a k-member preference ensemble.

Compares, in one run, k members sharing one frozen backbone (a head each) against k separate backbone copies (the
paper's layout), each variant in its own process so that peak RSS is its own:

    python benchmarks/preference_scoring.py                 # MiniLM backbone, k = 5, 256 pairs, 2 threads
    python benchmarks/preference_scoring.py --pairs 512 --threads 2

Prints one line per variant and, last, the ratios shared/separate.
"""

from __future__ import annotations

import argparse
import random
import resource
import time

import _common  # benchmarks/ is the script's folder


def _pairs(n: int):
    from alignment_games.modules.algorithms.arithmetic import CORRUPTIONS, generate_problems, make_response

    rng = random.Random(0)
    xs, ya, yb = [], [], []
    for p in generate_problems(n, seed=0):
        a, b = rng.sample(CORRUPTIONS, 2)
        xs.append(p.question)
        ya.append(make_response(p, a, rng))
        yb.append(make_response(p, b, rng))
    return xs, ya, yb


def worker(variant: str, pairs: int, members: int, threads: int, repeats: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from alignment_games.datamodules.preference import PreferenceDataModule
    from alignment_games.modules.preference import PreferenceEnsemble

    sharing = "frozen" if variant.startswith("shared") else "separate"
    cache = variant == "shared_cached"
    model = PreferenceEnsemble(num_members=members, sharing=sharing, cache_features=cache).eval()
    xs, ya, yb = _pairs(pairs)
    model.score(xs[:8], ya[:8], yb[:8])  # warm-up
    model._feature_cache.clear()
    times = []
    for _r in range(repeats):
        if not cache:
            model._feature_cache.clear()
        t = time.perf_counter()
        model.score(xs, ya, yb, batch_size=64)
        times.append(time.perf_counter() - t)
    # cached: the first pass fills the cache, later passes are what a multi-epoch run or a game sees
    kept = sorted(times[1:] if cache and repeats > 1 else times)
    score_s = kept[len(kept) // 2]

    dm = PreferenceDataModule(num_prompts=40, num_members=members, batch_size=32, seed=0)
    dm._tokenizer = model.tokenizer
    dm.setup("fit")
    batches = [dm.collate(dm.splits["train"][i : i + 32]) for i in range(0, 32 * 6, 32)]
    model.train()
    opt = model.configure_optimizers()
    step_times = []
    for i, batch in enumerate(batches):
        t = time.perf_counter()
        logits = model._own_member_logits(batch)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch["label"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i >= 2:  # drop the first two steps
            step_times.append(time.perf_counter() - t)
    step_times.sort()
    return {
        "variant": variant,
        "pairs_per_s": pairs / score_s,
        "train_step_s": step_times[len(step_times) // 2],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=256)
    ap.add_argument("--members", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = _common.parse_or_work(ap, "worker", lambda a: worker(a.worker, a.pairs, a.members, a.threads, a.repeats))
    if args is None:
        return
    results = {}
    for variant in ("shared", "shared_cached", "separate"):
        results[variant] = _common.worker_json(__file__, ["--worker", variant, *_common.worker_argv(args, ("worker",))])
        r = results[variant]
        print(
            f"{variant:14s} pairs/s={r['pairs_per_s']:8.1f}  train_step_s={r['train_step_s']:.3f}  "
            f"peak_rss_mb={r['peak_rss_mb']:7.0f}  params_m={r['params_m']:.1f}"
        )
    s, c, p = results["shared"], results["shared_cached"], results["separate"]
    print(
        f"throughput_shared_vs_separate={s['pairs_per_s'] / p['pairs_per_s']:.2f} "
        f"throughput_cached_vs_separate={c['pairs_per_s'] / p['pairs_per_s']:.2f} "
        f"memory_separate_vs_shared={p['peak_rss_mb'] / s['peak_rss_mb']:.2f} "
        f"train_step_separate_vs_shared={p['train_step_s'] / s['train_step_s']:.2f}"
    )


if __name__ == "__main__":
    main()
