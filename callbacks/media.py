"""Text, histograms and figures for every logger a trainer has: TensorBoard, Weights & Biases, MLflow and CSV.

Written on rank zero, each logger in its own form (``docs/tensorboard.md``); one that fails does not stop the others.
"""

from __future__ import annotations

import functools
import io
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

SUPPORTED = (TensorBoardLogger, WandbLogger, MLFlowLogger, CSVLogger)
_warned: set[str] = set()  # the unknown loggers already warned about (once per class and process)
_PART = re.compile(r"[^A-Za-z0-9_.=-]")


@dataclass(frozen=True)
class Histogram:
    """Buckets ``[edges[i], edges[i + 1])`` holding ``counts[i]`` (a count or a weight), and the values' moments."""

    edges: tuple[float, ...]
    counts: tuple[float, ...]
    num: float
    sum: float
    sum_squares: float
    min: float
    max: float

    @classmethod
    def of_values(cls, values: Any, bins: int = 64) -> Histogram | None:
        """``bins`` equal buckets over the finite ``values`` (non-finite ones left out); ``None`` if none is finite."""
        array = np.asarray(values, dtype=np.float64).reshape(-1)
        array = array[np.isfinite(array)]
        if not array.size:
            return None
        counts, edges = np.histogram(array, bins=bins)
        return cls(
            edges=tuple(edges.tolist()),
            counts=tuple(float(c) for c in counts),
            num=float(array.size),
            sum=float(array.sum()),
            sum_squares=float((array**2).sum()),
            min=float(array.min()),
            max=float(array.max()),
        )

    @classmethod
    def of_distribution(cls, probabilities: Any) -> Histogram:
        """A distribution over ``0 … K-1`` whose bucket ``i`` (``[i - ½, i + ½)``) has height ``p_i``."""
        p = np.asarray(probabilities, dtype=np.float64).reshape(-1)
        arms = np.arange(p.size, dtype=np.float64)
        return cls(
            edges=tuple((np.arange(p.size + 1) - 0.5).tolist()),
            counts=tuple(p.tolist()),
            num=float(p.sum()),
            sum=float((arms * p).sum()),
            sum_squares=float((arms**2 * p).sum()),
            min=-0.5,
            max=p.size - 0.5,
        )

    def as_dict(self) -> dict[str, Any]:
        """The fields as JSON-ready lists and floats."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}


def logging_step(trainer: pl.Trainer) -> int:
    """The step Lightning gives the scalars logged now (read as ``LearningRateMonitor`` does), so media line up."""
    loop = getattr(trainer, "fit_loop", None)
    if trainer.state.fn == "fit" and loop is not None:
        return int(loop.epoch_loop._batches_that_stepped)
    return int(trainer.global_step)


def media_loggers(trainer: pl.Trainer | None) -> list[Logger]:
    """The trainer's loggers that take text, histograms and figures, on rank zero; ``[]`` elsewhere."""
    if trainer is None or not trainer.is_global_zero:
        return []
    loggers = []
    for logger in trainer.loggers:
        if isinstance(logger, SUPPORTED):
            loggers.append(logger)
        elif not isinstance(logger, DummyLogger) and type(logger).__name__ not in _warned:
            _warned.add(type(logger).__name__)
            rank_zero_warn(
                f"{type(logger).__name__} takes only scalars here: text, histograms and figures go to "
                f"TensorBoardLogger, WandbLogger, MLFlowLogger and CSVLogger alone"
            )
    return loggers


def _path(tag: str, step: int, suffix: str) -> str:
    """``media/<tag>/step_<step><suffix>``, each part of ``tag`` made a safe file name (no ``..``, no separator)."""
    parts = [_PART.sub("_", p) for p in tag.split("/") if p]
    parts = [p if p.strip(".") else p.replace(".", "_") for p in parts] or ["_"]
    return "/".join(["media", *parts, f"step_{step}{suffix}"])


def _write_file(logger: Logger, relative: str, data: bytes) -> None:
    """``data`` as ``relative`` under the CSV logger's run folder (atomically) or as the MLflow run's artifact."""
    if isinstance(logger, CSVLogger):
        path = os.path.join(logger.log_dir, *relative.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    else:  # MLflow: the file under its own name, in the artifact folder of the tag
        folder, name = relative.rsplit("/", 1)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, name)
            with open(path, "wb") as f:
                f.write(data)
            logger.experiment.log_artifact(logger.run_id, path, folder)


def _each(loggers: Iterable[Logger], what: str, tag: str, step: int, write: Callable[[Logger], None]) -> None:
    """``write`` to every logger; one that fails is only warned about, so a logger's outage cannot end a training."""
    for logger in loggers:
        try:
            write(logger)
        except Exception as error:
            rank_zero_warn(
                f"{type(logger).__name__} could not log the {what} {tag!r} at step {step}: "
                f"{type(error).__name__}: {error}; the other loggers have it"
            )


def _log_media(
    trainer: pl.Trainer | None, what: str, tag: str, step: int | None, write: Callable[[Logger, int], None]
) -> None:
    """``write(logger, step)`` to every media logger of ``trainer`` (none: nothing), at ``step`` or the logging step."""
    loggers = media_loggers(trainer)
    if not loggers:
        return
    step = logging_step(trainer) if step is None else int(step)
    _each(loggers, what, tag, step, functools.partial(write, step=step))


def log_text(trainer: pl.Trainer | None, tag: str, text: str, step: int | None = None) -> None:
    """``text`` (markdown) under ``tag`` at ``step`` (default: :func:`logging_step`) in every supported logger."""

    def write(logger: Logger, step: int) -> None:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_text(tag, text, global_step=step)
        elif isinstance(logger, WandbLogger):
            import wandb

            logger.log_metrics({tag: wandb.Table(columns=["text"], data=[[text]])}, step=step)
        else:
            _write_file(logger, _path(tag, step, ".md"), text.encode("utf-8"))

    _log_media(trainer, "text", tag, step, write)


def log_histogram(trainer: pl.Trainer | None, tag: str, histogram: Histogram, step: int | None = None) -> None:
    """``histogram`` under ``tag`` at ``step`` (default: :func:`logging_step`) in every supported logger."""

    def write(logger: Logger, step: int) -> None:
        if isinstance(logger, TensorBoardLogger):
            moments = {k: getattr(histogram, k) for k in ("min", "max", "num", "sum", "sum_squares")}
            # TensorBoard's buckets are named by their right edge
            limits, counts = list(histogram.edges[1:]), list(histogram.counts)
            logger.experiment.add_histogram_raw(
                tag, **moments, bucket_limits=limits, bucket_counts=counts, global_step=step
            )
        elif isinstance(logger, WandbLogger):
            import wandb

            value = wandb.Histogram(np_histogram=(list(histogram.counts), list(histogram.edges)))
            logger.log_metrics({tag: value}, step=step)
        else:
            _write_file(logger, _path(tag, step, ".json"), json.dumps(histogram.as_dict()).encode("utf-8"))

    _log_media(trainer, "histogram", tag, step, write)


def log_figure(trainer: pl.Trainer | None, tag: str, figure: Any, step: int | None = None, dpi: int = 110) -> None:
    """A matplotlib ``figure``, rendered once as a PNG, under ``tag`` at ``step`` in every supported logger."""
    loggers = media_loggers(trainer)
    if not loggers:
        return
    step = logging_step(trainer) if step is None else int(step)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    png = buffer.getvalue()
    pixels = None

    def write(logger: Logger) -> None:
        nonlocal pixels
        if isinstance(logger, (TensorBoardLogger, WandbLogger)) and pixels is None:
            from PIL import Image  # matplotlib's own dependency

            pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGBA"))
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_image(tag, pixels, global_step=step, dataformats="HWC")
        elif isinstance(logger, WandbLogger):
            import wandb

            logger.log_metrics({tag: wandb.Image(pixels)}, step=step)
        else:
            _write_file(logger, _path(tag, step, ".png"), png)

    _each(loggers, "figure", tag, step, write)


def log_scalar_layout(trainer: pl.Trainer | None, layout: dict[str, dict[str, list[Any]]]) -> None:
    """A chart layout of logged scalars (``{category: {chart: ["Multiline", [tag regexes]]}}``) for TensorBoard.

    TensorBoard reads a run's first one, so write it once, whole, at the start of fit; other loggers have no layout.
    """
    loggers = [logger for logger in media_loggers(trainer) if isinstance(logger, TensorBoardLogger)]

    def write(logger: Logger) -> None:
        logger.experiment.add_custom_scalars(layout)

    _each(loggers, "scalar layout", ", ".join(layout), logging_step(trainer) if loggers else 0, write)
