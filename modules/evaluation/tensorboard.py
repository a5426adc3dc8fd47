"""What a game shows beyond its scalars: sampled text, value histograms, a distribution over arms.

The games hand a :class:`GameBoard` what they already produced (never a fresh draw, so resumes stay exact).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import lightning as L
import numpy as np
import torch

from alignment_games.callbacks.media import Histogram, log_histogram, log_scalar_layout, log_text, media_loggers
from alignment_games.modules.algorithms.checks import require_at_least

# ASCII punctuation may start markdown (lists, headings, emphasis, code, tables, links, HTML): a numeric entity does not
_PUNCTUATION = re.compile(r"[!-/:-@\[-`{-~]")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def escape_markdown(text: str, max_chars: int = 2000) -> str:
    """``text`` as markdown that renders as exactly that text: no markup, HTML or layout of its own survives.

    Punctuation becomes numeric entities, indents and blank lines non-breaking spaces, line breaks hard breaks;
    control characters are dropped, and text past ``max_chars`` is cut with a note.

    Example:
        >>> escape_markdown("# 1*2 <b>")
        '&#35; 1&#42;2 &#60;b&#62;'
    """
    text = _CONTROL.sub("", str(text).replace("\r\n", "\n").replace("\r", "\n"))
    cut = f" … ({len(text) - max_chars} more characters)" if len(text) > max_chars else ""
    text, lines = text[:max_chars], []
    for line in text.split("\n"):
        body = line.strip(" \t")  # trailing blanks would merge into the hard break anyway
        indent = line[: len(line) - len(line.lstrip(" \t"))].replace("\t", "    ")
        # a blank line would end the paragraph (and the field with it): it holds one non-breaking space instead
        lead = "&#160;" * max(len(indent), not body)
        lines.append(lead + _PUNCTUATION.sub(lambda m: f"&#{ord(m.group())};", body))
    return "  \n".join(lines) + cut  # two trailing spaces: a hard line break


def _value(value: Any) -> str:
    """A field's value as markdown: numbers to 4 significant digits, text escaped, ``None`` and ``""`` in italics."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, float):
        return f"{value:.4g}"  # also "nan" and "inf"
    if isinstance(value, (bool, int)):
        return str(value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value):
        return ", ".join(_value(float(v)) for v in value)
    if value is None:
        return "*(none)*"
    return escape_markdown(str(value)) or "*(empty)*"  # an empty reply is shown as such, not as a missing field


def samples_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """One markdown document: each row a numbered section of escaped ``**field**`` and value, rows ruled off."""
    return "\n\n---\n\n".join(
        f"#### {i}\n\n" + "\n\n".join(f"**{escape_markdown(k, 200)}**  \n{_value(v)}" for k, v in row.items())
        for i, row in enumerate(rows, start=1)
    )


class GameBoard:
    """A game's extras: validation samples as text, training values as histograms, a leader's arms.

    Touches no generator, trained or checkpointed state; off rank zero or without a media logger it does nothing.

    Args:
        num_samples: Rows of text per tag and validation (0: no text).

    Raises:
        ValueError: if ``num_samples`` is negative.
    """

    def __init__(self, num_samples: int = 4) -> None:
        require_at_least(log_samples=(num_samples, 0))
        self.num_samples = int(num_samples)
        self._samples: dict[str, list[dict[str, Any]]] = {}
        self._values: dict[str, list[np.ndarray]] = {}

    def wants_samples(self, module: L.LightningModule, tag: str) -> bool:
        """Whether ``tag`` still takes rows (so a caller can skip building them)."""
        wanted = self.num_samples > len(self._samples.get(tag, []))
        return wanted and bool(media_loggers(module._trainer))

    def add_samples(
        self, module: L.LightningModule, tag: str, rows: Iterable[Mapping[str, Any]], replace: bool = False
    ) -> None:
        """Keep rows for ``tag`` up to ``num_samples`` (the first ones; ``replace`` drops the kept ones first)."""
        if replace:
            self._samples.pop(tag, None)
        if not self.wants_samples(module, tag):
            return
        kept = self._samples.setdefault(tag, [])
        kept.extend(dict(row) for row in itertools.islice(rows, self.num_samples - len(kept)))

    def write_samples(self, module: L.LightningModule) -> None:
        """Write each tag's kept rows as one markdown text at the current step, then forget them."""
        samples, self._samples = self._samples, {}
        for tag, rows in samples.items():
            if rows:
                log_text(module._trainer, tag, samples_markdown(rows))

    def add_values(self, module: L.LightningModule, values: Mapping[str, Any]) -> None:
        """Buffer finite values per tag until :meth:`write_values_if_due` writes them as histograms."""
        if not media_loggers(module._trainer):
            return
        for tag, value in values.items():
            array = np.asarray(torch.as_tensor(value).detach().double().cpu().reshape(-1).numpy())
            self._values.setdefault(tag, []).append(array[np.isfinite(array)])

    def write_values_if_due(self, module: L.LightningModule) -> None:
        """At a training batch that logs scalars, write each tag's buffer (values since the last) as one histogram."""
        trainer = module._trainer
        if self._values and (trainer._logger_connector.should_update_logs or trainer.fast_dev_run):
            self.flush_values(module)  # asked as Lightning's own LearningRateMonitor asks

    def flush_values(self, module: L.LightningModule) -> None:
        """Write the buffered values now (one histogram per tag holding any), then forget them."""
        values, self._values = self._values, {}
        for tag, parts in values.items():
            histogram = Histogram.of_values(np.concatenate(parts))
            if histogram is not None:
                log_histogram(module._trainer, tag, histogram)

    def write_distribution(self, module: L.LightningModule, tag: str, probabilities: Any) -> None:
        """A distribution over arms ``0 … K-1`` as a histogram whose bucket ``i`` has height ``p_i``."""
        p = torch.as_tensor(probabilities).detach().double().cpu().reshape(-1).numpy()
        log_histogram(module._trainer, tag, Histogram.of_distribution(p))

    def write_layout(self, module: L.LightningModule, layout: dict[str, dict[str, list[Any]]]) -> None:
        """Write a custom-scalars layout (``{category: {chart: ["Multiline", [tag regexes]]}}``) once, at fit start."""
        log_scalar_layout(module._trainer, layout)


def debate_row(transcript: Any, share: float, verdict: str, rewards: Sequence[Any]) -> dict[str, Any]:
    """One debate as a text row: problem, reference, each ply's reply and reward, the judge's verdict."""
    row: dict[str, Any] = {"problem": transcript.problem, "reference": transcript.reference}
    for ply, reply, reward in zip(transcript.plies, transcript.replies, rewards):
        row |= {ply: reply.raw, f"{ply} reward": float(reward.reward)}
    return row | {"judge verdict": verdict, "Alice's vote share": float(share), "Alice correct": transcript.correct}
