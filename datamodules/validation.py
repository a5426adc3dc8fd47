"""Checks shared by the readers of data files: the file is a regular file; a bad row is refused by row and field."""

from __future__ import annotations

import math
import numbers
import os
import stat
from typing import Any

from alignment_games.modules.algorithms.checks import MissingFileError, UserError


def require_file(path: str, field: str) -> None:
    """Refuse a ``path`` that is missing or not a regular file (a link to one is one), before anything opens it.

    A FIFO would block the reader for ever, a device read without end, a folder fail in the reader's own words.

    Raises:
        FileNotFoundError: ``"<field>: '<path>' does not exist"``.
        ValueError: ``"<field>: '<path>' is a FIFO, not a regular file"`` (or a folder, a device, a socket).
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise MissingFileError(f"{field}: {path!r} does not exist") from None
    if not stat.S_ISREG(mode):
        kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a folder"), (stat.S_ISSOCK, "a socket"))
        kind = next((name for test, name in kinds if test(mode)), "a device")
        raise UserError(f"{field}: {path!r} is {kind}, not a regular file; give a data file")


def require_text(value: Any, field: str, where: str, row: int) -> str:
    """``value`` when it is text with a non-whitespace character; else a ``ValueError`` naming the row and field.

    Raises:
        ValueError: ``"<where>: row <row>: field '<field>' is missing"``, ``"... must be text, got int"`` or
            ``"... is empty"``.

    Example:
        >>> require_text("2 + 2?", "prompt", "q.jsonl", 0)
        '2 + 2?'
    """
    if value is None:
        raise UserError(f"{where}: row {row}: field {field!r} is missing")
    if not isinstance(value, str):
        raise UserError(f"{where}: row {row}: field {field!r} must be text, got {type(value).__name__}")
    if not value.strip():
        raise UserError(f"{where}: row {row}: field {field!r} is empty")
    return value


def require_number(value: Any, field: str, where: str, row: int, low: float, high: float) -> float:
    """``value`` as a float when it is a number (not text such as ``"0.7"``, not a bool), finite and in ``[low, high]``.

    Raises:
        ValueError: naming row and field: missing, ``"... = '0.7' is not a number (got str)"``, not finite, or outside.

    Example:
        >>> require_number(1, "label", "pairs.jsonl", 0, 0.0, 1.0)
        1.0
    """
    at = f"{where}: row {row}: field {field!r}"
    if value is None:
        raise UserError(f"{at} is missing")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise UserError(f"{at} = {value!r:.80} is not a number (got {type(value).__name__})")
    try:
        number = float(value)
    except OverflowError:  # an integer beyond the float range
        raise UserError(f"{at} is an integer of {value.bit_length()} bits, outside [{low:g}, {high:g}]") from None
    if not math.isfinite(number):
        raise UserError(f"{at} = {value!r} is not finite")
    if not low <= number <= high:
        raise UserError(f"{at} = {value!r} is outside [{low:g}, {high:g}]")
    return number
