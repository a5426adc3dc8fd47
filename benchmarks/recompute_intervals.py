"""Recompute every multi-seed headline of RESULTS.md from the committed per-problem files, three intervals each.

For each headline: the estimate, the per-seed values, the crossed and nested bootstraps and the seed-level t interval
(:mod:`alignment_games.modules.evaluation.intervals`, 2,000 resamples, seed 0), the most conservative of them and
whether all three exclude the null (0 for a difference or gain, 0.5 for a preference rate or a backbone's accuracy,
α for a candidate yield). A design where each seed has its own held-out items (the ensemble's pairs) has no crossed
interval. Reads only ``benchmarks/results/``; prints a markdown table.

    python benchmarks/recompute_intervals.py
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator

import torch

from alignment_games.commands.compare_arms import load_arm
from alignment_games.modules.evaluation.debate_compare import final_intervals, load_evaluations
from alignment_games.modules.evaluation.intervals import format_intervals, seed_intervals

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _rows(path: str) -> list[dict]:
    with open(os.path.join(RESULTS, path)) as f:
        return [json.loads(line) for line in f]


def _solved(rows: list[dict], name: str) -> torch.Tensor:
    return torch.tensor([float(r["correct"][name]) for r in rows], dtype=torch.float64)


def _trained(rows: list[dict], seeds: int = 3) -> torch.Tensor:
    return torch.stack([_solved(rows, f"trained[{s}]") for s in range(seeds)])


def _line(headline: str, x: torch.Tensor, null: float = 0.0, scale: float = 1.0, spec: str = "+.3f", **kw) -> str:
    """One table row: ``x[seeds, items]``'s mean, per-seed means and the three intervals (shifted by ``null``)."""
    out = seed_intervals(x - null, n_boot=2000, seed=0, **kw)
    shifted = {k: None if out[k] is None else [v + null for v in out[k]] for k in ("crossed", "nested", "seed_t")}
    summary = out | shifted
    per_seed = " / ".join(format(scale * v, spec) for v in x.mean(dim=1).tolist())
    verdict = "excludes" if out["excludes_null"] else "contains"
    return (
        f"| {headline} | {format(scale * float(x.mean()), spec)} | {per_seed} "
        f"| {format_intervals(summary, spec, scale)} | {verdict} {format(scale * null, spec.lstrip('+'))} |"
    )


def grpo() -> Iterator[str]:
    """The GRPO study on SmolLM2, its equal-compute RFT baseline and the GSM8K slice (crossed: same problems)."""
    for where, g, r in (
        ("held-out 200", "grpo_smollm2/grpo_gain.problems.jsonl", "rft_smollm2/rft_gain.problems.jsonl"),
        (
            "GSM8K 50",
            "grpo_smollm2_gsm8k/gsm8k_gain.problems.jsonl",
            "rft_smollm2_gsm8k/gsm8k_gain.problems.jsonl",
        ),
    ):
        grpo_rows, rft_rows = _rows(g), _rows(r)
        assert [x["sha256"] for x in grpo_rows] == [x["sha256"] for x in rft_rows], "other problems"
        base = _solved(grpo_rows, "base")
        yield _line(f"GRPO gain, {where} (points)", _trained(grpo_rows) - base, scale=100, spec="+.1f")
        yield _line(f"RFT gain, {where} (points)", _trained(rft_rows) - base, scale=100, spec="+.1f")
        yield _line(f"GRPO − RFT, {where} (points)", _trained(grpo_rows) - _trained(rft_rows), scale=100, spec="+.1f")


def debate() -> Iterator[str]:
    """Debate on SmolLM2: the last evaluation's accuracy and MCC differences from RLAIF-A (crossed: same 32)."""
    groups = {
        name: [load_evaluations(os.path.join(RESULTS, "debate_smollm2", f"{p}_s{s}.jsonl")) for s in range(3)]
        for name, p in (
            ("RLAIF-A", "rlaif_a"),
            ("Debate-AB", "debate_ab"),
            ("Debate-ABA", "debate_aba"),
            ("RLVR", "rlvr"),
        )
    }
    finals = final_intervals(groups, baseline="RLAIF-A", n_boot=2000, seed=0)
    for name, f in finals.items():
        mcc = f["mcc_intervals"]
        yield (
            f"| debate {name}: last-evaluation judge MCC | {f['mcc']:+.2f} | | {format_intervals(mcc, '+.2f')} "
            f"| {'excludes' if mcc['excludes_null'] else 'contains'} 0 |"
        )
        if "accuracy_diff_intervals" not in f:
            continue
        d = f["accuracy_diff_intervals"]
        mine = torch.stack([torch.tensor(r[-1]["problems"]["correct"]) for r in groups[name]])
        theirs = torch.stack([torch.tensor(r[-1]["problems"]["correct"]) for r in groups["RLAIF-A"]])
        wins, losses = int(((mine == 1) & (theirs == 0)).sum()), int(((mine == 0) & (theirs == 1)).sum())
        yield (
            f"| debate {name} − RLAIF-A, last-evaluation accuracy ({wins}:{losses} discordant) "
            f"| {float((mine - theirs).double().mean()):+.3f} "
            f"| {' / '.join(f'{v:+.3f}' for v in (mine - theirs).double().mean(1).tolist())} "
            f"| {format_intervals(d)} | {'excludes' if d['excludes_null'] else 'contains'} 0 |"
        )


def pool() -> Iterator[str]:
    """Pool on SmolLM2: each arm's gain over the base and its difference from the single player (crossed)."""
    arms = {a: load_arm(os.path.join(RESULTS, "pool_smollm2", f"{a}.json")) for a in ("single", "exp3", "uniform")}
    base = torch.tensor([float(b) for b in arms["single"][1]], dtype=torch.float64)
    for name, (acc, *_) in arms.items():
        yield _line(f"pool {name}: gain over the base", acc - base)
        if name != "single":
            yield _line(f"pool {name} − single", acc - arms["single"][0])


def round_robin() -> Iterator[str]:
    """The SmolLM2 round robin: each cell's preference rate against 0.5 (crossed: the same 50 prompts)."""
    runs = [_rows(f"round_robin_smollm2/s{s}/round_robin.problems.jsonl") for s in range(3)]
    assert all([r["sha256"] for r in rows] == [r["sha256"] for r in runs[0]] for rows in runs), "other prompts"
    for pair in runs[0][0]["preferred"]:
        m = torch.tensor([[r["preferred"][pair] for r in rows] for rows in runs], dtype=torch.float64)
        yield _line(f"round robin {pair.replace('>', ' ≻ ')}", m, null=0.5)


def deep_smida() -> Iterator[str]:
    """The trained deep-SMIDA pair on held-out prompts: variance gain and α-yields (crossed; thresholds per seed)."""
    runs = [json.load(open(os.path.join(RESULTS, f"deep_smida_smollm2_heldout/s{s}/game_eval.json"))) for s in range(3)]
    t, r = (torch.tensor([x["per_prompt"][k] for x in runs], dtype=torch.float64) for k in ("trained", "reference"))
    yield _line("deep-SMIDA held-out variance gain", (t - r).mean(dim=2), spec="+.4f")
    for a in ("0.1", "0.05", "0.01"):
        th = torch.tensor([x["thresholds"][a] for x in runs], dtype=torch.float64).view(3, 1, 1)
        yield _line(f"deep-SMIDA α = {a} yield", (t >= th).double().mean(dim=2), null=float(a))


def ensemble() -> Iterator[str]:
    """The ensemble on GSM8K pairs: each backbone's accuracy and the difference (nested: each seed its own pairs)."""
    for folder, label in (("ensemble_gsm8k", "100 questions"), ("ensemble_gsm8k200", "200 questions")):
        correct = {}
        for backbone in ("minilm", "smollm2"):
            rows = [_rows(f"{folder}/{backbone}/s{s}/report.rows.jsonl") for s in range(3)]
            correct[backbone] = [
                {r["row"]: float((sum(r["members"]) / len(r["members"]) >= 0.5) == (r["label"] == 1.0)) for r in seed}
                for seed in rows
            ]
        keys = [sorted(c) for c in correct["minilm"]]
        assert keys == [sorted(c) for c in correct["smollm2"]], "the backbones saw other held-out pairs"
        m = {b: torch.tensor([[c[s][k] for k in keys[s]] for s in range(3)]) for b, c in correct.items()}
        yield _line(f"ensemble MiniLM accuracy, {label}", m["minilm"], null=0.5, crossed=False)
        yield _line(f"ensemble SmolLM2 accuracy, {label}", m["smollm2"], null=0.5, crossed=False)
        yield _line(f"ensemble SmolLM2 − MiniLM, {label}", m["smollm2"] - m["minilm"], crossed=False)


def main() -> None:
    """Print every headline as one markdown table."""
    torch.set_num_threads(1)
    print(f"python {' '.join(sys.argv)}")
    print("| headline | estimate | per seed | 95% intervals (most conservative in bold) | null |")
    print("|---|---|---|---|---|")
    for section in (grpo, debate, pool, round_robin, deep_smida, ensemble):
        for line in section():
            print(line)


if __name__ == "__main__":
    main()
