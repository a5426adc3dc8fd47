"""Evaluation report of a preference-model ensemble on held-out triplets (paper §5.2, App. E.3 Table 1, App. F.1).

Pure tensor code: from the members' probabilities ``P_i(y≻y′|x)`` ``[N, k]``, the binary oracle labels (1 if y≻y′) and
the prompt ids, :func:`build_report` computes ``report.json`` (figures: :mod:`modules.evaluation.figures`).

An *error* is a triplet where the ensemble-mean prediction (y≻y′ when ``>= 0.5``) disagrees with the label. Where a
ranking is cut, ties keep the item order (stable sort). Bootstrap intervals resample whole prompts: triplets that
share a prompt are not independent. Computations run on the CPU in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from alignment_games.modules.algorithms.disagreement import decision_uncertainty, ensemble_jsd, ensemble_variance

__all__ = [
    "DEFAULT_FRACTIONS",
    "SCORE_NAMES",
    "build_report",
    "decile_accuracy",
    "disagreement_scores",
    "error_auroc",
    "error_rate_curve",
    "json_safe",
    "prompt_bootstrap",
    "roc_curve_points",
    "top_fraction_error_rate",
    "top_fraction_lift",
    "variance_summary",
]

#: The three disagreement scores of the report, in the order used for keys, legends and colours.
SCORE_NAMES: tuple[str, ...] = ("variance", "decision_uncertainty", "jsd")

#: Fractions at which :func:`build_report` evaluates the error-rate curve (Fig. 1b): 0.01, 0.02, ..., 1.00.
DEFAULT_FRACTIONS: tuple[float, ...] = tuple(round(0.01 * i, 2) for i in range(1, 101))

#: Threshold of ``fraction_above_threshold`` in :func:`variance_summary` (App. E.3: 8.93% of comparisons above 0.02).
VARIANCE_THRESHOLD = 0.02

_PERCENTILES = (25, 75, 90, 95, 99)


def _vector(x: Any, name: str, dtype: torch.dtype = torch.float64) -> Tensor:
    """Return ``x`` as a non-empty 1-D CPU tensor of ``dtype``; raise ValueError naming ``name`` otherwise."""
    t = torch.as_tensor(x).detach().cpu()
    if t.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{name} is empty")
    if dtype.is_floating_point:
        t = t.to(dtype)
        if torch.isnan(t).any():
            raise ValueError(f"{name} contains NaN at index {int(torch.isnan(t).nonzero()[0])}")
    return t


def _binary(x: Any, name: str) -> Tensor:
    """Return ``x`` as a non-empty 1-D bool tensor; its values must be 0/1 (or bool)."""
    t = torch.as_tensor(x).detach().cpu()
    if t.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{name} is empty")
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


def _scores_and_errors(scores: Any, errors: Any, errors_name: str = "errors") -> tuple[Tensor, Tensor]:
    s = _vector(scores, "scores")
    e = _binary(errors, errors_name)
    _same_length(("scores", s), (errors_name, e))
    return s, e


def _fraction_counts(fractions: Sequence[float] | Tensor, n: int) -> Tensor:
    """Number of items ``ceil(f * n)`` (at least 1) for each fraction ``f`` in (0, 1].

    ``f * n`` is rounded to 9 decimals first, so that ``0.07 * 100 = 7.000000000000001`` does not select 8 items.
    """
    f = torch.as_tensor(fractions, dtype=torch.float64).detach().cpu().reshape(-1)
    if f.numel() == 0:
        raise ValueError("fractions is empty")
    if not bool(((f > 0) & (f <= 1)).all()):
        raise ValueError(f"fractions must lie in (0, 1], got {f.tolist()}")
    counts = [max(1, math.ceil(round(float(v) * n, 9))) for v in f]
    return torch.tensor(counts, dtype=torch.long)


def error_auroc(scores: Tensor, errors: Tensor) -> float:
    """AUROC of a score at ranking errors above correct predictions (paper §5.2, Fawcett 2006).

    The normalised Mann–Whitney U statistic, equal to ``sklearn.metrics.roc_auc_score(errors, scores)``.

    Args:
        scores: Disagreement scores, shape ``[N]`` (higher = more likely an error).
        errors: 1 (or True) where the ensemble errs, 0 where it is correct, shape ``[N]``.

    Returns:
        The AUROC in [0, 1]; 0.5 (chance) when only one class is present, so bootstrap replicates never fail.

    Raises:
        ValueError: If an input is empty, not 1-D, of mismatched length, non-binary (``errors``) or NaN (``scores``).
    """
    s, e = _scores_and_errors(scores, errors)
    n_pos = int(e.sum())
    n_neg = e.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return 0.5
    sorted_s, order = torch.sort(s)
    _, inverse, counts = torch.unique_consecutive(sorted_s, return_inverse=True, return_counts=True)
    counts = counts.to(torch.float64)
    mean_rank = counts.cumsum(0) - (counts - 1.0) / 2.0  # 1-based average rank of each group of tied scores
    rank_sum = mean_rank[inverse][e[order]].sum().item()
    u = rank_sum - n_pos * (n_pos + 1) / 2.0
    return u / (n_pos * n_neg)


def roc_curve_points(scores: Tensor, errors: Tensor) -> tuple[Tensor, Tensor]:
    """ROC curve of a score as an error detector: one point per distinct score threshold.

    Tied items enter together, so the trapezoid area equals :func:`error_auroc`. Arguments as :func:`error_auroc`.

    Returns:
        ``(fpr, tpr)`` from (0, 0) to (1, 1), float64 tensors of length ``n_distinct_scores + 1``; the chance diagonal
        ``([0, 1], [0, 1])`` when only one class is present.

    Raises:
        ValueError: As :func:`error_auroc`.
    """
    s, e = _scores_and_errors(scores, errors)
    n_pos = int(e.sum())
    n_neg = e.numel() - n_pos
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
    """Accuracy within each score decile, lowest score first (paper Fig. 1a).

    Bins are cut by ``torch.tensor_split`` (the first ``N % n_bins`` bins hold one extra item).

    Args:
        scores: Disagreement scores, shape ``[N]``.
        correct: 1 where the ensemble is correct, 0 where it errs, shape ``[N]``.
        n_bins: Number of bins (10 for deciles).

    Returns:
        ``n_bins`` accuracies, lowest-score bin first. With fewer than ``n_bins`` items the trailing bins are empty
        and their accuracy is ``float('nan')`` (undefined; :func:`json_safe` maps it to ``null``).

    Raises:
        ValueError: As :func:`error_auroc` (with ``correct`` in place of ``errors``), or if ``n_bins < 1``.
    """
    if n_bins < 1:
        raise ValueError(f"n_bins must be at least 1, got {n_bins}")
    s, c = _scores_and_errors(scores, correct, errors_name="correct")
    order = torch.sort(s, stable=True).indices
    c = c.to(torch.float64)
    return [c[b].mean().item() if b.numel() else float("nan") for b in torch.tensor_split(order, n_bins)]


def error_rate_curve(scores: Tensor, errors: Tensor, fractions: Sequence[float] | Tensor) -> Tensor:
    """Error rate among the comparisons selected in decreasing order of score, for many fractions (paper Fig. 1b).

    For each fraction ``f`` the ``ceil(f * N)`` highest-score items (at least one) are selected.

    Args:
        scores: Disagreement scores, shape ``[N]``.
        errors: 1 where the ensemble errs, 0 where it is correct, shape ``[N]``.
        fractions: Fractions in (0, 1], any length.

    Returns:
        float64 tensor of error rates, one per fraction.

    Raises:
        ValueError: As :func:`error_auroc`, or if a fraction lies outside (0, 1] or ``fractions`` is empty.
    """
    s, e = _scores_and_errors(scores, errors)
    m = _fraction_counts(fractions, s.numel())
    order = torch.sort(s, descending=True, stable=True).indices
    cum_errors = e[order].to(torch.float64).cumsum(0)
    return cum_errors[m - 1] / m.to(torch.float64)


def top_fraction_error_rate(scores: Tensor, errors: Tensor, fraction: float = 0.1) -> float:
    """Error rate among the ``ceil(fraction * N)`` highest-score items (paper §5.2: top 10% by variance).

    ``scores`` and ``errors`` as :func:`error_rate_curve`; ``fraction`` lies in (0, 1].

    Raises:
        ValueError: As :func:`error_rate_curve`.
    """
    return error_rate_curve(scores, errors, [fraction])[0].item()


def top_fraction_lift(scores: Tensor, errors: Tensor, fraction: float = 0.1) -> float:
    """The error rate among the top ``fraction`` by score over the overall error rate (paper §5.2: 40.6% / 24.3%).

    Above 1 when the score concentrates errors in its upper tail; NaN when there is no error at all.
    """
    s, e = _scores_and_errors(scores, errors)
    overall = e.to(torch.float64).mean().item()
    return top_fraction_error_rate(s, e, fraction) / overall if overall > 0 else math.nan


def variance_summary(
    variance: Tensor, errors: Tensor | None = None, threshold: float = VARIANCE_THRESHOLD
) -> dict[str, float]:
    """Distribution summary of the ensemble variance, every triplet weighted equally (App. E.3, Table 1).

    Args:
        variance: Per-triplet ensemble variance, shape ``[N]``.
        errors: Optional 1 where the ensemble errs, 0 where it agrees with the oracle, shape ``[N]``.
        threshold: Threshold of ``fraction_above_threshold`` (0.02 in the paper).

    Returns:
        Plain floats: ``n``, ``mean``, ``median``, ``variance`` (population, denominator N), ``std`` (population),
        ``min``, ``max``, percentiles ``p25``, ``p75``, ``p90``, ``p95``, ``p99`` (linear interpolation, as numpy's
        default), ``threshold`` and ``fraction_above_threshold`` (strictly greater). With ``errors`` also
        ``mean_when_error`` and ``mean_when_correct``, ``float('nan')`` when that group is empty.

    Raises:
        ValueError: If an input is empty, not 1-D, of mismatched length, NaN or non-binary.
    """
    v = _vector(variance, "variance")
    q = torch.tensor([0.5] + [p / 100 for p in _PERCENTILES], dtype=torch.float64)
    quantiles = torch.quantile(v, q, interpolation="linear").tolist()
    out: dict[str, float] = {
        "n": float(v.numel()),
        "mean": v.mean().item(),
        "median": quantiles[0],
        "variance": v.var(unbiased=False).item(),
        "std": v.std(unbiased=False).item(),
        "min": v.min().item(),
        "max": v.max().item(),
    }
    out.update({f"p{p}": val for p, val in zip(_PERCENTILES, quantiles[1:])})
    out["threshold"] = float(threshold)
    out["fraction_above_threshold"] = (v > threshold).to(torch.float64).mean().item()
    if errors is not None:
        e = _binary(errors, "errors")
        _same_length(("variance", v), ("errors", e))
        out["mean_when_error"] = v[e].mean().item() if e.any() else float("nan")
        out["mean_when_correct"] = v[~e].mean().item() if (~e).any() else float("nan")
    return out


def prompt_bootstrap(
    stat_fn: Callable[[Tensor], Tensor | float | Sequence[float]],
    groups: Tensor,
    n_boot: int = 200,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[Tensor, Tensor]:
    """Percentile bootstrap interval of a statistic, resampling prompts (groups) with replacement.

    Each replicate draws as many prompts as there are, and includes every item of a drawn prompt once per draw.

    Args:
        stat_fn: Called once per replicate with the item indices of the resample (int64, shape ``[M]``, ``M`` varies
            with the sizes of the drawn prompts; items of a prompt drawn twice appear twice); returns a tensor (or
            float / sequence) of a fixed shape. ``stat_fn(torch.arange(N))`` is the point estimate.
        groups: Prompt id of every item, shape ``[N]``, any integer values.
        n_boot: Number of bootstrap replicates (at least 1).
        seed: Seed of the resampling.
        level: Coverage of the two-sided interval, in (0, 1).

    Returns:
        ``(low, high)``: float64 tensors with the shape of ``stat_fn``'s output, the ``(1 - level) / 2`` and
        ``(1 + level) / 2`` quantiles (linear interpolation) of the replicates. NaN replicate values (e.g. an empty
        decile) are ignored element-wise; an element that is NaN in every replicate stays NaN.

    Raises:
        ValueError: If ``groups`` is empty or not 1-D, ``n_boot < 1``, ``level`` is outside (0, 1), or ``stat_fn``
            changes the shape of its output between replicates.
    """
    g = torch.as_tensor(groups).detach().cpu()
    if g.ndim != 1:
        raise ValueError(f"groups must be 1-D, got shape {tuple(g.shape)}")
    if g.numel() == 0:
        raise ValueError("groups is empty")
    if n_boot < 1:
        raise ValueError(f"n_boot must be at least 1, got {n_boot}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    _, group_index = torch.unique(g, return_inverse=True)
    n_groups = int(group_index.max()) + 1
    gen = torch.Generator().manual_seed(int(seed))
    draws = torch.randint(n_groups, (n_boot, n_groups), generator=gen)
    times_drawn = torch.zeros(n_boot, n_groups, dtype=torch.long).scatter_add_(1, draws, torch.ones_like(draws))
    items = torch.arange(g.numel())
    replicates = []
    for b in range(n_boot):
        idx = torch.repeat_interleave(items, times_drawn[b][group_index])
        value = torch.as_tensor(stat_fn(idx), dtype=torch.float64).detach().cpu()
        if replicates and value.shape != replicates[0].shape:
            raise ValueError(
                f"stat_fn returned shape {tuple(value.shape)} in replicate {b}, but {tuple(replicates[0].shape)} before"
            )
        replicates.append(value)
    stacked = torch.stack(replicates).reshape(n_boot, -1)
    alpha = (1.0 - level) / 2.0
    q = torch.tensor([alpha, 1.0 - alpha], dtype=torch.float64)
    bounds = torch.nanquantile(stacked, q, dim=0, interpolation="linear")
    shape = replicates[0].shape
    return bounds[0].reshape(shape), bounds[1].reshape(shape)


def _check_report_inputs(member_probs: Any, labels: Any, prompt_ids: Any) -> tuple[Tensor, Tensor, Tensor]:
    p = torch.as_tensor(member_probs).detach().cpu()
    if p.ndim != 2:
        raise ValueError(f"member_probs must have shape [N, k], got shape {tuple(p.shape)}")
    if p.shape[0] == 0 or p.shape[1] == 0:
        raise ValueError(f"member_probs is empty (shape {tuple(p.shape)})")
    p = p.to(torch.float64)
    bad = ~((p >= 0) & (p <= 1))  # also catches NaN
    if bad.any():
        row, col = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"member_probs must lie in [0, 1], got {p[row, col].item()!r} at row {row}, member {col}")
    y = _binary(labels, "labels")
    g = torch.as_tensor(prompt_ids).detach().cpu()
    if g.ndim != 1:
        raise ValueError(f"prompt_ids must be 1-D, got shape {tuple(g.shape)}")
    if g.numel() == 0:
        raise ValueError("prompt_ids is empty")
    _same_length(("member_probs", p), ("labels", y), ("prompt_ids", g))
    return p, y, g


def disagreement_scores(member_probs: Tensor) -> dict[str, Tensor]:
    """The three disagreement scores of every triplet, in float64: ``{name: tensor [N]}`` for :data:`SCORE_NAMES`.

    Args:
        member_probs: Members' probabilities, shape ``[N, k]``.

    Returns:
        Dict with keys ``variance``, ``decision_uncertainty`` and ``jsd`` (see :mod:`modules.algorithms.disagreement`).
    """
    p = torch.as_tensor(member_probs).detach().cpu().to(torch.float64)
    return {
        "variance": ensemble_variance(p),
        "decision_uncertainty": decision_uncertainty(p),
        "jsd": ensemble_jsd(p),
    }


def _nll(prob: Tensor, labels: Tensor, eps: float = 1e-12) -> Tensor:
    """Mean binary negative log-likelihood over the first dimension, probabilities clamped to [eps, 1 - eps]."""
    q = prob.clamp(eps, 1.0 - eps)
    y = labels.to(torch.float64)
    if q.ndim == 2:
        y = y[:, None]
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
    """Compute the held-out evaluation report of the ensemble (the content of ``report.json``).

    Args:
        member_probs: Members' probabilities ``P_i(y≻y′|x)``, shape ``[N, k]``, values in [0, 1].
        labels: Binary oracle labels, 1 if y≻y′, shape ``[N]``.
        prompt_ids: Prompt id of every triplet (the bootstrap unit), shape ``[N]``.
        fractions: Fractions in (0, 1] at which the error-rate curve (Fig. 1b) is evaluated.
        n_boot: Prompt-bootstrap replicates for ``bands``; 0 omits ``bands``.
        seed: Seed of the bootstrap.
        level: Coverage of the bootstrap intervals.

    Returns:
        JSON-ready dict (plain floats, ints, lists, dicts) with the required keys ``ensemble_accuracy``,
        ``member_accuracy`` (list of k), ``auroc`` (``variance``, ``decision_uncertainty``, ``jsd``),
        ``decile_accuracy`` (10 values, lowest variance first), ``top10_error_rate`` (by variance),
        ``overall_error_rate``, ``top10_lift`` (their ratio, with a band), ``variance_summary`` (see
        :func:`variance_summary`, with errors), ``n_pairs``,
        ``n_prompts``; and the extra keys ``n_members``, ``n_errors``, ``member_nll`` (list), ``ensemble_nll``,
        ``top10_error_rate_by_score`` (per score), ``error_rate_curve`` (``fractions`` and one list per score) and,
        when ``n_boot > 0``, ``bands``: ``n_boot``, ``level``, ``seed`` and ``{"low": ..., "high": ...}`` prompt-
        bootstrap intervals for ``ensemble_accuracy``, ``overall_error_rate``, ``decile_accuracy``, ``auroc``,
        ``top10_error_rate_by_score`` and ``error_rate_curve`` (shapes as the point estimates). Deciles of fewer
        than 10 triplets are NaN (see :func:`decile_accuracy`); pass the report through :func:`json_safe` before
        writing strict JSON.

    Raises:
        ValueError: Naming the argument, if an input is empty, has the wrong shape or mismatched length, a
            probability lies outside [0, 1] or a label is not binary.
    """
    p, y, g = _check_report_inputs(member_probs, labels, prompt_ids)
    fractions = [float(f) for f in fractions]
    _fraction_counts(fractions, p.shape[0])  # validate once, before any work
    p_bar = p.mean(dim=1)
    correct = (p_bar >= 0.5) == y
    errors = ~correct
    member_correct = (p >= 0.5) == y[:, None]
    scores = disagreement_scores(p)
    variance = scores["variance"]

    report: dict[str, Any] = {
        "ensemble_accuracy": correct.to(torch.float64).mean().item(),
        "member_accuracy": member_correct.to(torch.float64).mean(dim=0).tolist(),
        "auroc": {name: error_auroc(s, errors) for name, s in scores.items()},
        "decile_accuracy": decile_accuracy(variance, correct),
        "top10_error_rate": top_fraction_error_rate(variance, errors, 0.1),
        "top10_lift": top_fraction_lift(variance, errors, 0.1),
        "overall_error_rate": errors.to(torch.float64).mean().item(),
        "variance_summary": variance_summary(variance, errors),
        "n_pairs": int(p.shape[0]),
        "n_prompts": int(torch.unique(g).numel()),
        "n_members": int(p.shape[1]),
        "n_errors": int(errors.sum()),
        "member_nll": _nll(p, y).tolist(),
        "ensemble_nll": _nll(p_bar, y).item(),
        "top10_error_rate_by_score": {name: top_fraction_error_rate(s, errors, 0.1) for name, s in scores.items()},
        "error_rate_curve": {"fractions": fractions}
        | {name: error_rate_curve(s, errors, fractions).tolist() for name, s in scores.items()},
    }
    if n_boot > 0:
        report["bands"] = _bands(scores, correct, g, fractions, n_boot, seed, level)
    return report


def _bands(
    scores: Mapping[str, Tensor],
    correct: Tensor,
    groups: Tensor,
    fractions: list[float],
    n_boot: int,
    seed: int,
    level: float,
) -> dict[str, Any]:
    """Prompt-bootstrap intervals of the report's statistics, all from the same resamples."""
    errors = ~correct
    names = list(scores)
    n_curve = len(fractions)
    # Layout of the flat statistic vector: [accuracy, deciles(10), auroc(3), top10(3), lift(1), curves(3 * n_curve)].
    sizes = [1, 10, len(names), len(names), 1, len(names) * n_curve]

    def stat(idx: Tensor) -> Tensor:
        c, e = correct[idx], errors[idx]
        s = {name: scores[name][idx] for name in names}
        parts = [
            [c.to(torch.float64).mean().item()],
            decile_accuracy(s["variance"], c),
            [error_auroc(s[name], e) for name in names],
            [top_fraction_error_rate(s[name], e, 0.1) for name in names],
            [top_fraction_lift(s["variance"], e, 0.1)],
        ]
        flat = torch.tensor([v for part in parts for v in part], dtype=torch.float64)
        curves = [error_rate_curve(s[name], e, fractions) for name in names]
        return torch.cat([flat, *curves])

    low, high = prompt_bootstrap(stat, groups, n_boot=n_boot, seed=seed, level=level)
    out: dict[str, Any] = {"n_boot": int(n_boot), "level": float(level), "seed": int(seed)}
    for bound_name, bound in (("low", low), ("high", high)):
        acc, deciles, auroc, top10, lift, curves = torch.split(bound, sizes)
        curves = curves.reshape(len(names), n_curve)
        entries = {
            "ensemble_accuracy": acc.item(),
            "decile_accuracy": deciles.tolist(),
            "auroc": dict(zip(names, auroc.tolist())),
            "top10_error_rate_by_score": dict(zip(names, top10.tolist())),
            "top10_lift": lift.item(),
            "error_rate_curve": {name: curves[i].tolist() for i, name in enumerate(names)},
        }
        for key, value in entries.items():
            out.setdefault(key, {})[bound_name] = value
    # The error rate is 1 - accuracy in every replicate, so its interval is the mirror image of the accuracy interval.
    acc_band = out["ensemble_accuracy"]
    out["overall_error_rate"] = {"low": 1.0 - acc_band["high"], "high": 1.0 - acc_band["low"]}
    return out


def json_safe(obj: Any) -> Any:
    """Copy of nested dicts, lists and tuples (as lists) with non-finite floats replaced by ``None`` (strict JSON)."""
    if isinstance(obj, Mapping):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
