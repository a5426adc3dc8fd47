"""Compare groups of debate runs as the paper's Table 1 does: merged peak windows, P(Best), gap recovery.

A run is a log folder with ``debate_evals.jsonl`` or the file; its peak follows
:class:`alignment_games.callbacks.PeakCheckpoint`'s rule, and a group merges its runs' peak-window counts. Correlated
rollouts make P(Best) over-confident (App. A.3). The command line is in ``docs/debate.md``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from alignment_games.callbacks.functional import (
    beta_lower_bound,
    confusion_cells,
    gap_recovery,
    p_best,
    pooled_lower_bound,
    posterior_mean,
)
from alignment_games.callbacks.functional.mcc import matthews_corrcoef_from_counts
from alignment_games.modules.evaluation.intervals import (
    compare_intervals,
    crossed_bootstrap_weights,
    format_intervals,
    nested_bootstrap_weights,
    percentile_interval,
    seed_t_interval,
)

COUNTS = ("tp", "fp", "tn", "fn")
_VERDICT = ("correct", "accepts", "tie", "unparsed")


def evaluations_file(path: str) -> str:
    """The file a run's evaluations are read from: ``path``'s ``debate_evals.jsonl`` for a log folder, else ``path``."""
    return os.path.join(path, "debate_evals.jsonl") if os.path.isdir(path) else path


def load_evaluations(path: str) -> list[dict[str, Any]]:
    """The evaluations of one run: ``path`` is a log folder with ``debate_evals.jsonl`` or the file itself.

    Raises:
        FileNotFoundError: naming the path when there is no such file.
        ValueError: naming the line when a record lacks ``successes``/``trials`` or they are not counts.
    """
    file = evaluations_file(path)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path!r}: no debate_evals.jsonl (run a debate config with validation first)")
    out = []
    with open(file) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            s, t = rec.get("successes"), rec.get("trials")
            if not isinstance(s, (int, float)) or not isinstance(t, (int, float)) or not 0 <= s <= t:
                raise ValueError(f"{file}: line {n}: need 0 <= successes <= trials, got {s!r}, {t!r}")
            out.append(rec)
    if not out:
        raise ValueError(f"{file}: no evaluations")
    return dedup_evaluations(out)


def dedup_evaluations(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Each evaluation once: a later record of the same ``(step, batches_seen)`` replaces the earlier in its place."""
    merged: dict[Any, Mapping[str, Any]] = {}
    for rec in records:  # a record without a step is its own key
        merged[(rec["step"], rec.get("batches_seen")) if rec.get("step") is not None else object()] = rec
    return list(merged.values())


def peak_window(evaluations: Sequence[Mapping[str, Any]], window: int = 3, quantile: float = 0.025) -> dict[str, Any]:
    """The evaluation whose trailing ``window`` has the highest pooled Beta lower bound (first of equals wins)."""
    pairs = [(float(e["successes"]), float(e["trials"])) for e in evaluations]
    lowers = [pooled_lower_bound(pairs[: i + 1], window, quantile) for i in range(len(pairs))]
    i = max(range(len(pairs)), key=lowers.__getitem__)  # max keeps the first of equals
    recent = pairs[max(0, i + 1 - window) : i + 1]
    counts = {"successes": sum(s for s, _ in recent), "trials": sum(n for _, n in recent)}
    return {"index": i, "step": evaluations[i].get("step"), "lower_bound": lowers[i]} | counts


def judge_trend(evaluations: Sequence[Mapping[str, Any]], window: int = 3) -> dict[str, Any] | None:
    """The judge's pooled MCC, accept rate and mean reward over a run's first and last ``window`` evaluations.

    One evaluation's MCC is too noisy alone, hence the pooling. ``None`` when the records lack the counts.
    """
    if not evaluations or not all(all(k in e for k in COUNTS) for e in evaluations):
        return None

    def pooled(part: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        tp, fp, tn, fn = (sum(float(e[k]) for e in part) for k in COUNTS)
        rewards = [float(e["reward"]) for e in part if e.get("reward") is not None]
        return {
            "steps": [e.get("step") for e in part],
            "mcc": matthews_corrcoef_from_counts(tp, fp, tn, fn),
            "false_accepts": fp,
            "accept_rate": (tp + fp) / max(1.0, tp + fp + tn + fn),
            "trials": tp + fp + tn + fn,
            "reward": sum(rewards) / len(rewards) if rewards else None,
        }

    return {"first": pooled(evaluations[:window]), "last": pooled(evaluations[-window:])}


def _last_problems(runs: Sequence[Sequence[Mapping[str, Any]]]) -> dict[str, torch.Tensor] | None:
    """Runs × problems indicators (correct, tp, fp, tn, fn) of the last evaluations; ``None`` if not all alike."""
    rows = [r[-1].get("problems") or {} for r in runs]
    items = {tuple(sorted(p.get("item") or ())) for p in rows}
    if len(items) != 1 or not next(iter(items)):
        return None
    per_run = []
    for p in rows:
        v = {k: torch.tensor([x for _, x in sorted(zip(p["item"], p[k]))]) > 0 for k in ("referenced", *_VERDICT)}
        per_run.append(confusion_cells(v["referenced"], *(v[k] for k in _VERDICT)) | {"correct": v["correct"]})
    cols = {k: torch.stack([r[k].double() for r in per_run]) for k in ("correct", *COUNTS)}
    return {"item": torch.tensor(next(iter(items)))} | cols


def _resampled(m: Mapping[str, torch.Tensor], weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each resample's accuracy and MCC: run ``s`` on problem ``p`` weighs ``weights[b, s, p]``."""
    w = {k: torch.einsum("bsp,sp->b", weights, m[k]) for k in ("correct", *COUNTS)}
    acc = w["correct"] / weights.sum(dim=(1, 2))
    return acc, _mcc(*(w[k] for k in COUNTS))


def _mcc(tp: torch.Tensor, fp: torch.Tensor, tn: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """MCC of (weighted) confusion counts, 0 where a margin is empty."""
    den = ((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)).sqrt()
    return torch.where(den > 0, (tp * tn - fp * fn) / den.clamp_min(1e-300), torch.zeros_like(den))


def _per_run(m: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each run's accuracy and MCC, for the t interval over runs."""
    return m["correct"].mean(dim=1), _mcc(*(m[k].sum(dim=1) for k in COUNTS))


def _three(boot: Mapping[str, Sequence[torch.Tensor]], i: int, runs: Sequence[torch.Tensor], confidence: float) -> dict:
    """Statistic ``i`` (0: accuracy, 1: MCC): the bootstraps' percentile intervals and the t interval over runs."""
    cis = {k: percentile_interval(v[i], confidence).tolist() for k, v in boot.items()}
    seed_t = seed_t_interval(runs[i], confidence).tolist() if len(runs[i]) > 1 else None
    return compare_intervals(cis | {"seed_t": seed_t})


def final_intervals(
    groups: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]],
    baseline: str | None = None,
    n_boot: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """Each group's last-evaluation accuracy and judge MCC with three intervals each (:mod:`.intervals`).

    A bootstrap resample weighs run ``s`` on problem ``p`` by how often it counts it (accuracy: the weighted mean,
    MCC: that of the weighted counts); the t interval is over the runs' own values. Against ``baseline`` the runs pair
    by position (seeds in the same order) and share the resamples. A group whose runs lack per-problem rows or
    evaluated different problems is left out.
    """
    mats = {name: _last_problems(runs) for name, runs in groups.items()}
    out: dict[str, Any] = {}
    for name, m in mats.items():
        if m is None:
            continue
        runs, problems = m["correct"].shape
        weights = {
            "crossed": crossed_bootstrap_weights(runs, problems, n_boot, seed),
            "nested": nested_bootstrap_weights(runs, problems, n_boot, seed),
        }
        boot = {k: _resampled(m, w) for k, w in weights.items()}
        per_run = _per_run(m)
        pooled = {k: float(m[k].sum()) for k in ("correct", *COUNTS)}
        row = {
            "runs": runs,
            "problems": problems,
            "accuracy": pooled["correct"] / (runs * problems),
            "accuracy_intervals": _three(boot, 0, per_run, confidence),
            "mcc": matthews_corrcoef_from_counts(*(pooled[k] for k in COUNTS)),
            "mcc_intervals": _three(boot, 1, per_run, confidence),
        }
        base = mats.get(baseline) if baseline is not None and name != baseline else None
        if base is not None and base["correct"].shape == m["correct"].shape and base["item"].equal(m["item"]):
            against = {k: _resampled(base, w) for k, w in weights.items()}
            diffs = {k: [b - a for b, a in zip(boot[k], against[k])] for k in weights}
            run_diffs = [b - a for b, a in zip(per_run, _per_run(base))]
            row["accuracy_diff_intervals"] = _three(diffs, 0, run_diffs, confidence)
            row["mcc_diff_intervals"] = _three(diffs, 1, run_diffs, confidence)
        out[name] = row
    return out


def compare_groups(
    groups: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]],
    upper: str | None = None,
    baseline: str | None = None,
    window: int = 3,
    quantile: float = 0.025,
    draws: int = 100_000,
    seed: int = 0,
) -> dict[str, Any]:
    """Merge each group's runs' peak windows (``window``, ``quantile``) and compare the groups: P(Best), gap recovery.

    ``upper`` (RLVR) is reported but left out of P(Best) and tops the gap; ``baseline`` (RLAIF-A) is its bottom.

    Raises:
        ValueError: for an unknown ``upper``/``baseline`` or a group without runs.
    """
    for name in (upper, baseline):
        if name is not None and name not in groups:
            raise ValueError(f"{name!r} is not one of the groups {sorted(groups)}")
    rows: dict[str, dict[str, Any]] = {}
    for name, runs in groups.items():
        if not runs:
            raise ValueError(f"group {name!r} has no runs")
        peaks = [peak_window(r, window, quantile) for r in runs]
        s, n = sum(p["successes"] for p in peaks), sum(p["trials"] for p in peaks)
        rows[name] = {
            "peak_accuracy": posterior_mean(s, n),
            "lower_bound": beta_lower_bound(s, n, quantile),
            "observed_mean": s / n if n else float("nan"),
            "successes": s,
            "trials": n,
            "runs": [{k: p[k] for k in ("index", "step", "lower_bound", "successes", "trials")} for p in peaks],
            "judge_trends": [judge_trend(r, window) for r in runs],
        }
    contenders = {k: (v["successes"], v["trials"]) for k, v in rows.items() if k != upper}
    shares = p_best(contenders, draws=draws, seed=seed) if contenders else {}
    counts = {k: (v["successes"], v["trials"]) for k, v in rows.items()}
    for name, row in rows.items():
        row["p_best"], row["gap_recovery"] = shares.get(name), None
        if upper is not None and baseline is not None and name not in (upper, baseline):
            try:
                row["gap_recovery"] = gap_recovery(counts[name], counts[baseline], counts[upper])
            except ValueError:
                pass  # no gap between baseline and upper bound
    finals = final_intervals(groups, baseline, seed=seed)
    return dict(
        window=window, quantile=quantile, draws=draws, upper=upper, baseline=baseline, groups=rows, final=finals
    )


def _markdown(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """The lines of a markdown table."""
    return [f"| {' | '.join(header)} |", "|" + "---|" * len(header), *(f"| {' | '.join(map(str, r))} |" for r in rows)]


def format_table(result: Mapping[str, Any]) -> str:
    """The comparison in the layout of the paper's Table 1 (markdown), best peak accuracy first."""
    ci, groups, rows = round(100 * (1 - 2 * result["quantile"])), result["groups"], []
    for name in sorted(groups, key=lambda k: -groups[k]["peak_accuracy"]):
        g = groups[name]
        cells = [f"{g[k]:.4f}" for k in ("peak_accuracy", "lower_bound", "observed_mean")]
        cells += ["—" if g[k] is None else format(g[k], f) for k, f in (("p_best", ".4f"), ("gap_recovery", ".2f"))]
        rows.append([name, *cells, len(g["runs"])])
    head = ["protocol", "peak accuracy", f"{ci}% CI lower bound", "observed mean", "P(Best)", "gap recovery", "runs"]
    lines = _markdown(head, rows)
    if trends := [(name, i, t) for name in groups for i, t in enumerate(groups[name].get("judge_trends") or []) if t]:
        spec = (("mcc", ".2f"), ("accept_rate", ".2f"), ("false_accepts", ".0f"), ("reward", ".3f"))
        arrow = lambda a, b, s: "—" if a is None or b is None else f"{a:{s}} → {b:{s}}"  # noqa: E731
        rows = [[name, i, *(arrow(t["first"][k], t["last"][k], s) for k, s in spec)] for name, i, t in trends]
        head = ["protocol", "run", f"judge MCC, first → last {result['window']} evaluations", "accept rate"]
        lines += ["", *_markdown([*head, "false accepts", "mean reward"], rows)]
    if finals := result.get("final") or {}:
        spec = (("accuracy_intervals", ".3f"), ("mcc_intervals", "+.2f"), ("accuracy_diff_intervals", "+.3f"))
        rows = [
            [name, f"accuracy {f['accuracy']:.3f}, MCC {f['mcc']:.2f}"]
            + [format_intervals(f[k], s) if k in f else "—" for k, s in (*spec, ("mcc_diff_intervals", "+.2f"))]
            + [f"{f['runs']} × {f['problems']}"]
            for name, f in finals.items()
        ]
        head = ["protocol", "last evaluation", "accuracy: 95% intervals (most conservative in bold)"]
        head += ["judge MCC: 95% intervals", "vs baseline, accuracy", "vs baseline, MCC", "runs × problems"]
        lines += ["", *_markdown(head, rows)]
    return "\n".join(lines)
