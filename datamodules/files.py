"""Reading a table of rows by local path or hub name through ``datasets``, with errors that name the column."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

__all__ = ["FORMATS", "check_columns", "iter_rows", "open_table"]

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def open_table(
    path: str | None,
    name: str | None,
    split: str,
    columns: Mapping[str, str | None] | Iterable[str | None],
    config_name: str | None = None,
    revision: str | None = None,
) -> tuple[Any, str]:
    """Open a local file (``.jsonl``/``.json``/``.parquet``/``.csv``, optionally ``.gz``) or a hub dataset split.

    Args:
        path: Local file; takes precedence over ``name``.
        name: Hub dataset name.
        split: Split of the hub dataset.
        columns: Columns that must be present (``None`` entries are skipped); a mapping field → column also names
            the field in the error.
        config_name: Subset of the hub dataset (GSM8K's ``"main"``).
        revision: Git revision of the hub dataset (a tag or commit, for a reproducible run).

    Returns:
        ``(dataset, where)`` with ``where`` a short description for error messages.

    Raises:
        FileNotFoundError: naming a missing ``path``.
        ValueError: for an unsupported file type, neither source given, a file that cannot be parsed (bad JSON or CSV,
            bytes that are not UTF-8, no rows), or a missing column (listing those present).
    """
    import datasets

    if path is not None:
        if not os.path.exists(path):
            raise FileNotFoundError(f"data.path: {path!r} does not exist")
        ext = os.path.splitext(path.removesuffix(".gz"))[1].lower()
        if ext not in FORMATS:
            raise ValueError(f"data.path: unsupported file type {ext!r}; expected one of {sorted(FORMATS)}")
        try:
            ds = datasets.load_dataset(FORMATS[ext], data_files=path, split="train")
        except Exception as e:  # datasets wraps parse errors; name the file and the first cause instead
            cause = e
            while cause.__cause__ is not None or cause.__context__ is not None:
                cause = cause.__cause__ or cause.__context__
            detail = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
            if isinstance(cause, StopIteration) or os.path.getsize(path) == 0:
                detail = "the file holds no rows"
            raise ValueError(f"data.path: {path!r} cannot be read as {FORMATS[ext]} ({detail})") from e
        where = repr(path)
    elif name is not None:
        ds = datasets.load_dataset(name, config_name, split=split, revision=revision)
        where = f"{name}{'/' + config_name if config_name else ''}[{split}]"
    else:
        raise ValueError("give data.path or data.name")
    check_columns(ds.column_names, where, columns)
    return ds, where


def check_columns(present: Iterable[str], where: str, columns: Mapping[str, str | None] | Iterable[str | None]) -> None:
    """Refuse a table that lacks one of ``columns`` (``None`` entries skipped), naming it and the columns present.

    Raises:
        ValueError: ``"<where>: column 'c' (for field 'f') is missing; columns present: [...]"``.
    """
    present = list(present)
    named = columns.items() if isinstance(columns, Mapping) else ((None, c) for c in columns)
    for field, col in named:
        if col is not None and col not in present:
            what = f"column {col!r}" + (f" (for field {field!r})" if field is not None else "")
            raise ValueError(f"{where}: {what} is missing; columns present: {present}")


def iter_rows(ds: Iterable[Any], where: str) -> Iterator[tuple[int, Any]]:
    """``enumerate(ds)``, with text that is not UTF-8 reported as a ``ValueError`` naming the row.

    Raises:
        ValueError: ``"<where>: row <i>: text is not valid UTF-8 ..."``.
    """
    i = 0
    iterator = iter(ds)
    while True:
        try:
            rec = next(iterator)
        except StopIteration:
            return
        except UnicodeDecodeError as e:
            raise ValueError(f"{where}: row {i}: text is not valid UTF-8 ({e.reason} at byte {e.start})") from e
        yield i, rec
        i += 1
