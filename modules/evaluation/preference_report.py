"""Evaluation report of a preference-model ensemble on held-out triplets (paper §5.2, App. E.3 Table 1, App. F.1).

An *error* is a triplet where the ensemble-mean prediction (y≻y′ when ``>= 0.5``) disagrees with the label. Rankings
keep item order on ties (stable sort); bootstrap intervals resample whole prompts; all math is float64 on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from alignment_games.modules.algorithms.checks import require_at_least, require_in_range
from alignment_games.modules.algorithms.disagreement import decision_uncertainty, ensemble_jsd, ensemble_variance
from alignment_games.modules.evaluation.game_eval import interval_ends, resample_prompts

#: The three disagreement scores of the report, in the order used for keys, legends and colours.
SCORE_NAMES: tuple[str, ...] = ("variance", "decision_uncertainty", "jsd")

#: Fractions at which :func:`build_report` evaluates the error-rate curve (Fig. 1b): 0.01, 0.02, ..., 1.00.
DEFAULT_FRACTIONS: tuple[float, ...] = tuple(round(0.01 * i, 2) for i in range(1, 101))

#: Threshold of ``fraction_above_threshold`` in :func:`variance_summary` (App. E.3: 8.93% of comparisons above 0.02).
VARIANCE_THRESHOLD = 0.02

_PERCENTILES = (25, 75, 90, 95, 99)


def _one_d(x: Any, name: str) -> Tensor:
    """``x`` as a non-empty 1-D CPU tensor; ValueError naming ``name`` otherwise."""
    t = torch.as_tensor(x).detach().cpu()
    if t.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{name} is empty")
    return t


def _vector(x: Any, name: str) -> Tensor:
    """``x`` as a non-empty 1-D float64 CPU tensor without NaN."""
    t = _one_d(x, name).to(torch.float64)
    if torch.isnan(t).any():
        raise ValueError(f"{name} contains NaN at index {int(torch.isnan(t).nonzero()[0])}")
    return t


def _binary(x: Any, name: str) -> Tensor:
    """``x`` (0/1 or bool) as a non-empty 1-D bool tensor."""
    t = _one_d(x, name)
    if t.dtype != torch.bool:
        bad = ~((t == 0) | (t == 1))
        if bad.any():
            i = int(bad.nonzero()[0])
            raise ValueError(f"{name} must be binary (0/1), got {t[i].item()!r} at index {i}")
        t = t == 1
    return t


def _same_length(first: tuple[str, Tensor], *others: tuple[str, Tensor]) -> None:
    """Raise ValueError naming the first argument whose length differs from ``first``'s."""
    name0, t0 = first
    for name, t in others:
        if t.shape[0] != t0.shape[0]:
            raise ValueError(f"{name} has length {t.shape[0]} but {name0} has length {t0.shape[0]}")


def _scores_and_errors(scores: Any, errors: Any, errors_name: str = "errors") -> tuple[Tensor, Tensor, int, int]:
    """The checked scores and errors, and the numbers of errors and non-errors."""
    s, e = _vector(scores, "scores"), _binary(errors, errors_name)
    _same_length(("scores", s), (errors_name, e))
    n_pos = int(e.sum())
    return s, e, n_pos, e.numel() - n_pos


def _fraction_counts(fractions: Sequence[float] | Tensor, n: int) -> Tensor:
    """``ceil(f * n)`` (at least 1) per fraction in (0, 1]; rounded to 9 decimals first so 0.07 * 100 selects 7."""
    f = torch.as_tensor(fractions, dtype=torch.float64).detach().cpu().reshape(-1)
    if f.numel() == 0:
        raise ValueError("fractions is empty")
    if not bool(((f > 0) & (f <= 1)).all()):
        raise ValueError(f"fractions must lie in (0, 1], got {f.tolist()}")
    counts = [max(1, math.ceil(round(float(v) * n, 9))) for v in f]
    return torch.tensor(counts, dtype=torch.long)


def error_auroc(scores: Tensor, errors: Tensor) -> float:
    """AUROC of ``scores`` at ranking ``errors`` first: normalised Mann–Whitney U (§5.2), 0.5 for a single class.

    Raises:
        ValueError: If an input is empty, not 1-D, of mismatched length, non-binary (``errors``) or NaN (``scores``).
    """
    s, e, n_pos, n_neg = _scores_and_errors(scores, errors)
    if n_pos == 0 or n_neg == 0:
        return 0.5
    sorted_s, order = torch.sort(s)
    _, inverse, counts = torch.unique_consecutive(sorted_s, return_inverse=True, return_counts=True)
    counts = counts.to(torch.float64)
    mean_rank = counts.cumsum(0) - (counts - 1.0) / 2.0  # 1-based average rank of each group of tied scores
    rank_sum = mean_rank[inverse][e[order]].sum().item()
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)  # U / (n_pos n_neg)


def roc_curve_points(scores: Tensor, errors: Tensor) -> tuple[Tensor, Tensor]:
    """``(fpr, tpr)`` of a score as an error detector, one point per distinct score (area: :func:`error_auroc`).

    Raises:
        ValueError: As :func:`error_auroc`.
    """
    s, e, n_pos, n_neg = _scores_and_errors(scores, errors)
    if n_pos == 0 or n_neg == 0:
        diag = torch.tensor([0.0, 1.0], dtype=torch.float64)
        return diag, diag.clone()
    sorted_s, order = torch.sort(s, descending=True)
    _, counts = torch.unique_consecutive(sorted_s, return_counts=True)
    last = counts.cumsum(0) - 1  # index of the last item of each tie group in the sorted order
    tps = e[order].to(torch.float64).cumsum(0)[last]
    fps = (last + 1).to(torch.float64) - tps
    zero = torch.zeros(1, dtype=torch.float64)
    return torch.cat([zero, fps / n_neg]), torch.cat([zero, tps / n_pos])


def decile_accuracy(scores: Tensor, correct: Tensor, n_bins: int = 10) -> list[float]:
    """Accuracy within each of ``n_bins`` score bins (``torch.tensor_split``; empty: NaN), lowest first (Fig. 1a).

    Raises:
        ValueError: As :func:`error_auroc` (with ``correct`` in place of ``errors``), or if ``n_bins < 1``.
    """
    require_at_least(n_bins=(n_bins, 1))
    s, c = _scores_and_errors(scores, correct, errors_name="correct")[:2]
    c, order = c.to(torch.float64), torch.sort(s, stable=True).indices
    return [c[b].mean().item() if b.numel() else float("nan") for b in torch.tensor_split(order, n_bins)]


def error_rate_curve(scores: Tensor, errors: Tensor, fractions: Sequence[float] | Tensor) -> Tensor:
    """Error rate among the ``ceil(f * N)`` highest-score items, one per fraction ``f`` in (0, 1] (paper Fig. 1b).

    Raises:
        ValueError: As :func:`error_auroc`, or if a fraction lies outside (0, 1] or ``fractions`` is empty.
    """
    s, e = _scores_and_errors(scores, errors)[:2]
    m = _fraction_counts(fractions, s.numel())
    cum_errors = e[torch.sort(s, descending=True, stable=True).indices].to(torch.float64).cumsum(0)
    return cum_errors[m - 1] / m.to(torch.float64)


def top_fraction_error_rate(scores: Tensor, errors: Tensor, fraction: float = 0.1) -> float:
    """Error rate among the ``ceil(fraction * N)`` highest-score items (paper §5.2: top 10% by variance).

    Raises:
        ValueError: As :func:`error_rate_curve`.
    """
    return error_rate_curve(scores, errors, [fraction])[0].item()


def top_fraction_lift(scores: Tensor, errors: Tensor, fraction: float = 0.1) -> float:
    """The error rate among the top ``fraction`` by score over the overall one (§5.2: 40.6% / 24.3%); NaN: no error."""
    s, e = _scores_and_errors(scores, errors)[:2]
    overall = e.to(torch.float64).mean().item()
    return top_fraction_error_rate(s, e, fraction) / overall if overall > 0 else math.nan


def variance_summary(
    variance: Tensor, errors: Tensor | None = None, threshold: float = VARIANCE_THRESHOLD
) -> dict[str, float]:
    """Distribution summary of the per-triplet ensemble variance (App. E.3, Table 1), with error/correct means if given.

    Raises:
        ValueError: If an input is empty, not 1-D, of mismatched length, NaN or non-binary.
    """
    v = _vector(variance, "variance")
    q = torch.tensor([0.5] + [p / 100 for p in _PERCENTILES], dtype=torch.float64)
    median, *quantiles = torch.quantile(v, q, interpolation="linear").tolist()
    out: dict[str, float] = {
        "n": float(v.numel()),
        "mean": v.mean().item(),
        "median": median,
        "variance": v.var(unbiased=False).item(),
        "std": v.std(unbiased=False).item(),
        "min": v.min().item(),
        "max": v.max().item(),
    }
    out |= {f"p{p}": val for p, val in zip(_PERCENTILES, quantiles)} | {"threshold": float(threshold)}
    out["fraction_above_threshold"] = (v > threshold).to(torch.float64).mean().item()
    if errors is not None:
        e = _binary(errors, "errors")
        _same_length(("variance", v), ("errors", e))
        out |= {"mean_when_error": v[e].mean().item(), "mean_when_correct": v[~e].mean().item()}  # NaN if none
    return out


def prompt_bootstrap(
    stat_fn: Callable[[Tensor], Tensor | float | Sequence[float]],
    groups: Tensor,
    n_boot: int = 200,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[Tensor, Tensor]:
    """Percentile bootstrap ``(low, high)`` of ``stat_fn(item indices)``, resampling prompts ``groups [N]``.

    NaN replicates are ignored.

    Raises:
        ValueError: for bad ``groups``, ``n_boot < 1``, ``level`` outside (0, 1), or ``stat_fn`` changing its shape.
    """
    g = _one_d(groups, "groups")
    require_in_range("level", level, 0, 1, open_low=True, open_high=True)
    _, group_index = torch.unique(g, return_inverse=True)
    n_groups = int(group_index.max()) + 1
    draws = resample_prompts(n_groups, n_boot, seed)
    times_drawn = torch.zeros(n_boot, n_groups, dtype=torch.long).scatter_add_(1, draws, torch.ones_like(draws))
    replicates = []
    for b in range(n_boot):
        idx = torch.repeat_interleave(torch.arange(g.numel()), times_drawn[b][group_index])
        value = torch.as_tensor(stat_fn(idx), dtype=torch.float64).detach().cpu()
        if replicates and value.shape != replicates[0].shape:
            raise ValueError(
                f"stat_fn returned shape {tuple(value.shape)} in replicate {b}, but {tuple(replicates[0].shape)} before"
            )
        replicates.append(value)
    stacked = torch.stack(replicates).reshape(n_boot, -1)
    low, high = torch.nanquantile(stacked, interval_ends(level), dim=0, interpolation="linear")
    return low.reshape(replicates[0].shape), high.reshape(replicates[0].shape)


def _check_report_inputs(member_probs: Any, labels: Any, prompt_ids: Any) -> tuple[Tensor, Tensor, Tensor]:
    p = torch.as_tensor(member_probs).detach().cpu()
    if p.ndim != 2:
        raise ValueError(f"member_probs must have shape [N, k], got shape {tuple(p.shape)}")
    if p.numel() == 0:
        raise ValueError(f"member_probs is empty (shape {tuple(p.shape)})")
    p = p.to(torch.float64)
    bad = ~((p >= 0) & (p <= 1))  # also catches NaN
    if bad.any():
        row, col = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"member_probs must lie in [0, 1], got {p[row, col].item()!r} at row {row}, member {col}")
    y, g = _binary(labels, "labels"), _one_d(prompt_ids, "prompt_ids")
    _same_length(("member_probs", p), ("labels", y), ("prompt_ids", g))
    return p, y, g


def disagreement_scores(member_probs: Tensor) -> dict[str, Tensor]:
    """The three disagreement scores of ``member_probs [N, k]`` in float64: ``{name: [N]}`` for :data:`SCORE_NAMES`."""
    p = torch.as_tensor(member_probs).detach().cpu().to(torch.float64)
    return {"variance": ensemble_variance(p), "decision_uncertainty": decision_uncertainty(p), "jsd": ensemble_jsd(p)}


def _nll(prob: Tensor, labels: Tensor, eps: float = 1e-12) -> Tensor:
    """Mean binary negative log-likelihood over the first dimension, probabilities clamped to [eps, 1 - eps]."""
    q, y = prob.clamp(eps, 1.0 - eps), labels.to(torch.float64)
    y = y[:, None] if q.ndim == 2 else y
    return -(y * q.log() + (1.0 - y) * (1.0 - q).log()).mean(dim=0)


def build_report(
    member_probs: Tensor,
    labels: Tensor,
    prompt_ids: Tensor,
    *,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    n_boot: int = 200,
    seed: int = 0,
    level: float = 0.95,
) -> dict[str, Any]:
    """``report.json`` from members' ``P_i(y≻y′|x)`` ``[N, k]``, labels and prompt ids; ``n_boot > 0`` adds ``bands``.

    Empty deciles are NaN: pass the report through :func:`json_safe`.

    Raises:
        ValueError: naming the argument that is empty, misshapen, of another length, outside [0, 1] or not binary.
    """
    p, y, g = _check_report_inputs(member_probs, labels, prompt_ids)
    fractions = [float(f) for f in fractions]
    _fraction_counts(fractions, p.shape[0])  # validate once, before any work
    p_bar = p.mean(dim=1)
    correct = (p_bar >= 0.5) == y
    errors = ~correct
    scores = disagreement_scores(p)
    variance = scores["variance"]
    banded = _banded(scores, correct, fractions)
    report: dict[str, Any] = {
        "ensemble_accuracy": banded["ensemble_accuracy"],
        "member_accuracy": ((p >= 0.5) == y[:, None]).to(torch.float64).mean(dim=0).tolist(),
        "auroc": banded["auroc"],
        "decile_accuracy": banded["decile_accuracy"],
        "top10_error_rate": banded["top10_error_rate_by_score"]["variance"],
        "top10_lift": banded["top10_lift"],
        "overall_error_rate": errors.to(torch.float64).mean().item(),
        "variance_summary": variance_summary(variance, errors),
        "n_pairs": int(p.shape[0]),
        "n_prompts": int(torch.unique(g).numel()),
        "n_members": int(p.shape[1]),
        "n_errors": int(errors.sum()),
        "member_nll": _nll(p, y).tolist(),
        "ensemble_nll": _nll(p_bar, y).item(),
        "top10_error_rate_by_score": banded["top10_error_rate_by_score"],
        "error_rate_curve": {"fractions": fractions} | banded["error_rate_curve"],
    }
    if n_boot > 0:  # every statistic from the same prompt resamples

        def stat(idx: Tensor) -> Tensor:
            resampled = _banded({k: v[idx] for k, v in scores.items()}, correct[idx], fractions)
            return torch.tensor(_leaves(resampled), dtype=torch.float64)

        low, high = prompt_bootstrap(stat, g, n_boot=n_boot, seed=seed, level=level)
        lows, highs = (_refill(banded, iter(bound.tolist())) for bound in (low, high))
        bands = {"n_boot": int(n_boot), "level": float(level), "seed": int(seed)}
        bands |= {k: {"low": lows[k], "high": highs[k]} for k in banded}
        acc = bands["ensemble_accuracy"]  # the error rate is 1 - accuracy in every replicate: the mirror interval
        report["bands"] = bands | {"overall_error_rate": {"low": 1.0 - acc["high"], "high": 1.0 - acc["low"]}}
    return report


def _banded(scores: Mapping[str, Tensor], correct: Tensor, fractions: list[float]) -> dict[str, Any]:
    """The report's statistics that get bootstrap bands, in the order of ``bands``."""
    errors = ~correct
    return {
        "ensemble_accuracy": correct.to(torch.float64).mean().item(),
        "decile_accuracy": decile_accuracy(scores["variance"], correct),
        "auroc": {name: error_auroc(s, errors) for name, s in scores.items()},
        "top10_error_rate_by_score": {name: top_fraction_error_rate(s, errors, 0.1) for name, s in scores.items()},
        "top10_lift": top_fraction_lift(scores["variance"], errors, 0.1),
        "error_rate_curve": {name: error_rate_curve(s, errors, fractions).tolist() for name, s in scores.items()},
    }


def _leaves(tree: Any) -> list[float]:
    """The numbers of nested dicts and lists, depth first."""
    if isinstance(tree, Mapping | list):
        return [v for x in (tree.values() if isinstance(tree, Mapping) else tree) for v in _leaves(x)]
    return [tree]


def _refill(tree: Any, values: Iterator[float]) -> Any:
    """``tree`` with its numbers replaced, depth first, by ``values`` (the inverse of :func:`_leaves`)."""
    if isinstance(tree, Mapping):
        return {k: _refill(v, values) for k, v in tree.items()}
    return [_refill(v, values) for v in tree] if isinstance(tree, list) else next(values)


def json_safe(obj: Any) -> Any:
    """Copy of nested dicts, lists and tuples (as lists) with non-finite floats replaced by ``None`` (strict JSON)."""
    if isinstance(obj, Mapping):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return None if isinstance(obj, float) and not math.isfinite(obj) else obj
