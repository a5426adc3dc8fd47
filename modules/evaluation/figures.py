"""Figures of the evaluations as matplotlib Figures on an Agg canvas (pyplot's global state is never touched)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from alignment_games.modules.evaluation.game_eval import candidate_thresholds, candidate_yield_intervals
from alignment_games.modules.evaluation.preference_report import (
    SCORE_NAMES,
    _check_report_inputs,
    build_report,
    disagreement_scores,
    roc_curve_points,
)

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

_SCORE_LABELS = {"variance": "variance", "decision_uncertainty": "decision uncertainty", "jsd": "JSD"}
_SCORE_COLOURS = {"variance": "tab:green", "decision_uncertainty": "tab:blue", "jsd": "tab:red"}


def _new_axes(figsize: tuple[float, float], layout: str | None = None) -> tuple[Figure, Any]:
    """A Figure with its own Agg canvas (thread-safe, no pyplot) and one subplot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout=layout)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def make_figures(
    member_probs: Tensor,
    labels: Tensor,
    prompt_ids: Tensor,
    *,
    report: Mapping[str, Any] | None = None,
    n_boot: int = 200,
    seed: int = 0,
) -> dict[str, Figure]:
    """The report figures ``decile_accuracy``, ``roc_curves``, ``error_rate_vs_fraction`` (Fig. 1), from ``report``.

    Without ``report`` (:func:`build_report` on the same inputs), ``n_boot`` and ``seed`` make one.

    Raises:
        ValueError: As ``build_report``, or if ``report`` was computed on a different number of triplets.
    """
    p, y, g = _check_report_inputs(member_probs, labels, prompt_ids)
    if report is None:
        report = build_report(p, y, g, n_boot=n_boot, seed=seed)
    elif report.get("n_pairs") != p.shape[0]:
        raise ValueError(f"report has n_pairs={report.get('n_pairs')} but member_probs has {p.shape[0]} rows")
    errors = (p.mean(dim=1) >= 0.5) != y
    return {
        "decile_accuracy": _decile_figure(report),
        "roc_curves": _roc_figure(report, disagreement_scores(p), errors),
        "error_rate_vs_fraction": _error_rate_figure(report),
    }


def _decile_figure(report: Mapping[str, Any]) -> Figure:
    bands = report.get("bands")
    fig, ax = _new_axes((5.5, 4.0), "constrained")
    acc = torch.tensor(report["decile_accuracy"], dtype=torch.float64)
    x = torch.arange(1, acc.numel() + 1)
    yerr = None
    if bands is not None:
        low, high = (torch.tensor(bands["decile_accuracy"][k], dtype=torch.float64) for k in ("low", "high"))
        yerr = torch.stack([(acc - low).clamp_min(0), (high - acc).clamp_min(0)]).nan_to_num(0.0).numpy()
    ax.bar(x.numpy(), acc.nan_to_num(0.0).numpy(), yerr=yerr, capsize=3, color="tab:green", alpha=0.8)
    ax.axhline(report["ensemble_accuracy"], color="black", linestyle="--", linewidth=1, label="overall")
    ax.set(
        xticks=x.numpy(), xlabel="variance decile (1 = lowest)", ylabel="oracle agreement (accuracy)", ylim=(0, 1.05)
    )
    level = f" ({int(100 * bands['level'])}% prompt bootstrap)" if bands else ""
    ax.set_title("Accuracy by variance decile" + level, fontsize=10)
    ax.legend(loc="lower left")
    return fig


def _roc_figure(report: Mapping[str, Any], scores: Mapping[str, Tensor], errors: Tensor) -> Figure:
    fig, ax = _new_axes((5.5, 4.0), "constrained")
    for name, s in scores.items():
        fpr, tpr = roc_curve_points(s, errors)
        label = f"{_SCORE_LABELS[name]} (AUROC {report['auroc'][name]:.3f})"
        ax.plot(fpr.numpy(), tpr.numpy(), color=_SCORE_COLOURS[name], label=label)
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="chance")
    ax.set(xlabel="false positive rate (correct flagged)", ylabel="true positive rate (errors flagged)", xlim=(0, 1))
    ax.set_ylim(0, 1)
    ax.set_title("Error detection ROC", fontsize=10)
    ax.legend(loc="lower right")
    return fig


def _error_rate_figure(report: Mapping[str, Any]) -> Figure:
    bands = report.get("bands")
    fig, ax = _new_axes((5.5, 4.0), "constrained")
    curve = report["error_rate_curve"]
    frac = curve["fractions"]
    for name in SCORE_NAMES:
        colour = _SCORE_COLOURS[name]
        ax.plot(frac, curve[name], color=colour, label=_SCORE_LABELS[name])
        if bands is not None:
            lo, hi = (bands["error_rate_curve"][k][name] for k in ("low", "high"))
            ax.fill_between(frac, lo, hi, color=colour, alpha=0.2, linewidth=0)
    ax.axhline(report["overall_error_rate"], color="black", linestyle="--", linewidth=1, label="overall")
    ax.set(xlabel="fraction selected (decreasing score)", ylabel="ensemble error rate", xlim=(0, 1), ylim=(0, 1))
    ax.set_title("Error rate vs fraction selected" + (" (shaded: prompt bootstrap)" if bands else ""), fontsize=10)
    ax.legend(loc="upper right")
    return fig


def make_game_figures(
    trained: Tensor, reference: Tensor, alphas: Sequence[float] = (0.1, 0.05, 0.01), n_boot: int = 1000, seed: int = 0
) -> dict:
    """``variance_cdf`` and ``candidate_yield`` (Fig. 2a) of both pairs; ``[P, R]`` scores get bands."""
    t, r = trained.double().flatten(), reference.double().flatten()
    thresholds = candidate_thresholds(r, alphas)
    cdf, ax = _new_axes((6, 4))
    for v, label, style in ((t, "trained pair", "-"), (r, "reference pair", "--")):
        xs = torch.sort(v).values
        ax.step(xs.tolist(), (torch.arange(1, xs.numel() + 1) / xs.numel()).tolist(), style, where="post", label=label)
    for a, th in thresholds.items():
        ax.axvline(th, color="grey", lw=0.8, ls=":")
        ax.text(th, 0.02, f"α={a}", rotation=90, fontsize=7, va="bottom")
    ax.set(xlabel="ensemble variance", ylabel="empirical CDF")
    ax.legend()
    grid = torch.linspace(0.01, 0.5, 50, dtype=torch.float64).tolist()
    ths = [float(torch.quantile(r, 1.0 - a)) for a in grid]
    fy, ax = _new_axes((6, 4))
    for v, style, colour, label in ((t, "-", "tab:blue", "trained pair"), (r, "--", "tab:red", "reference pair")):
        ax.plot(grid, [float((v >= th).double().mean()) for th in ths], style, color=colour, label=label)
    banded = trained.ndim == 2 and trained.shape == reference.shape and n_boot > 0
    if banded:
        bands = candidate_yield_intervals(trained, reference, grid, n_boot, seed)
        for tag, colour in (("trained", "tab:blue"), ("reference", "tab:red")):
            lo, hi = [bands[a][tag][0] for a in grid], [bands[a][tag][1] for a in grid]
            ax.fill_between(grid, lo, hi, color=colour, alpha=0.2, linewidth=0)
    ax.plot([0, 0.5], [0, 0.5], ":", color="grey", label="nominal α")
    ax.set(xlabel="α (reference-quantile threshold)", ylabel="α-online candidate yield")
    ax.set_title("Candidate yield" + (" (shaded: 95% prompt bootstrap)" if banded else ""), fontsize=10)
    ax.legend()
    return {"variance_cdf": cdf, "candidate_yield": fy}
