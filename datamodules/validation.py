"""Row checks shared by the datamodules that read texts: a bad row is refused by file, row number and field."""

from __future__ import annotations

from typing import Any

__all__ = ["require_text"]


def require_text(value: Any, field: str, where: str, row: int) -> str:
    """``value`` when it is text with a non-whitespace character; else a ``ValueError`` naming the row and field.

    Args:
        value: The field's value in the row.
        field: The field (or column) name, quoted in the error.
        where: The file or split the row comes from.
        row: The row's number (0-based, in file order).

    Raises:
        ValueError: ``"<where>: row <row>: field '<field>' is missing"`` (``None``), ``"... must be text, got int"``
            or ``"... is empty"`` (empty or only whitespace).

    Example:
        >>> require_text("2 + 2?", "prompt", "q.jsonl", 0)
        '2 + 2?'
    """
    if value is None:
        raise ValueError(f"{where}: row {row}: field {field!r} is missing")
    if not isinstance(value, str):
        raise ValueError(f"{where}: row {row}: field {field!r} must be text, got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"{where}: row {row}: field {field!r} is empty")
    return value
