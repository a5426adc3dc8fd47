"""The multi-LLM pool's figures of §5 (Figs. 3–5) from its history, and their writing beside the logs."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Sequence
from typing import Any

import torch

from alignment_games.callbacks.media import log_figure
from alignment_games.modules.evaluation.figures import _new_axes
from alignment_games.modules.training.artifacts import atomic_write_bytes, atomic_write_text


def _axes(title: str, xlabel: str, ylabel: str) -> tuple[Any, Any]:
    fig, ax = _new_axes((6.5, 4))
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    return fig, ax


def _finish(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.legend()
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _instruction_weights(weights: torch.Tensor, top: int) -> Any:
    k = weights.shape[1]
    rel = weights * k
    order = torch.argsort(rel[-1], descending=True).tolist()
    n = min(top, k // 2) if k > 1 else 1
    fig, ax = _axes(
        "Leader's instruction weights", "iteration (0: before the first update)", "instruction weight / uniform"
    )
    steps = list(range(rel.shape[0]))
    for rank, i in enumerate(order[:n]):
        ax.plot(steps, rel[:, i].tolist(), "-", color="tab:green", alpha=0.8, label="top 5" if rank == 0 else None)
    for rank, i in enumerate(order[-n:] if k > 1 else []):
        ax.plot(steps, rel[:, i].tolist(), "-", color="tab:red", alpha=0.8, label="bottom 5" if rank == 0 else None)
    ax.axhline(1.0, color="grey", ls="--", label="uniform")
    _finish(ax)
    return fig


def _per_player(values: list[list[float]], players: Sequence[str], title: str, ylabel: str, uniform: bool) -> Any:
    v = torch.tensor(values, dtype=torch.float64)
    fig, ax = _axes(title, "iteration", ylabel)
    for j, p in enumerate(players):
        ax.plot(list(range(v.shape[0])), v[:, j].tolist(), "-o", ms=3, label=p)
    if uniform:
        ax.axhline(1.0 / len(players), color="grey", ls="--", label="uniform")
    _finish(ax)
    return fig


def make_pool_figures(history: dict[str, list[Any]], players: Sequence[str], top: int = 5) -> dict[str, Any]:
    """The figures of §5 from a run's history (``weights``, ``ratings``, ``selection``: one row per iteration).

    ``instruction_weights`` (Fig. 5: the ``top`` and bottom instructions' weight over uniform), ``reputations``
    (Fig. 3: Elo ratings), ``opponent_selection`` (Fig. 4: against uniform ``1/m``).
    """
    figures = {}
    weights = torch.tensor(history["weights"], dtype=torch.float64)  # [T + 1, K]
    if weights.numel():
        figures["instruction_weights"] = _instruction_weights(weights, top)
    if history["ratings"] and len(players) > 1:
        figures["reputations"] = _per_player(
            history["ratings"], players, "Reputation trajectories", "Elo reputation", uniform=False
        )
    if history["selection"]:
        figures["opponent_selection"] = _per_player(
            history["selection"], players, "Opponent selection", "opponent-selection weight", uniform=True
        )
    return figures


def write_pool_figures(figures: dict[str, Any], folder: str, trainer: Any = None, step: int = 0) -> list[str]:
    """Each figure as ``<folder>/<name>.png`` (atomically) and as ``pool/<name>`` to the loggers; call on rank zero."""
    paths = []
    for name, fig in figures.items():
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
        path = os.path.join(folder, f"{name}.png")
        atomic_write_bytes(path, buffer.getvalue())
        paths.append(path)
        log_figure(trainer, f"pool/{name}", fig, step)
    return paths


def write_pool_artifacts(
    folder: str, record: dict[str, Any], figures: dict[str, Any], trainer: Any = None, step: int = 0
) -> list[str]:
    """``<folder>/pool_history.json`` and the figures (:func:`write_pool_figures`); call on one rank."""
    path = os.path.join(folder, "pool_history.json")
    atomic_write_text(path, json.dumps(record, indent=1))
    return [path, *write_pool_figures(figures, folder, trainer, step)]
