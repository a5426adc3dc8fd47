"""Reading a table of rows by local path or hub name through ``datasets``, with errors that name the column."""

from __future__ import annotations

import gzip
import itertools
import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import lightning as L

from alignment_games.datamodules.validation import require_file
from alignment_games.modules.algorithms.checks import UserError

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def open_table(
    path: str | None,
    name: str | None,
    split: str,
    columns: Mapping[str, str | None] | Iterable[str | None],
    config_name: str | None = None,
    revision: str | None = None,
) -> tuple[Any, str]:
    """``(dataset, where)`` of a local jsonl/json/parquet/csv file (optionally ``.gz``) or a hub dataset split.

    Raises:
        FileNotFoundError: naming a missing ``path``.
        ValueError: for a path that is not a regular file, an unsupported type, no source, an unparsable file (naming
            row and field), a missing column.
    """
    import datasets

    if path is not None:
        ext = check_data_file(path, "data.path")
        try:
            ds = datasets.load_dataset(FORMATS[ext], data_files=path, split="train")
        except Exception as e:  # datasets wraps parse errors; name the file and the first cause instead
            cause = e
            while cause.__cause__ is not None or cause.__context__ is not None:
                cause = cause.__cause__ or cause.__context__
            detail = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
            if isinstance(cause, StopIteration) or os.path.getsize(path) == 0:
                detail = "the file holds no rows"
            elif FORMATS[ext] == "json":  # name the row: the readers' errors (arrow's, then pandas') name none
                detail = _json_problem(path) or detail
            raise UserError(f"data.path: {path!r} cannot be read as {FORMATS[ext]} ({detail})") from e
        if FORMATS[ext] == "json":
            ds = _as_typed(ds, path)
        where = repr(path)
    elif name is not None:
        ds = datasets.load_dataset(name, config_name, split=split, revision=revision)
        where = f"{name}{'/' + config_name if config_name else ''}[{split}]"
    else:
        raise UserError("give data.path or data.name")
    check_columns(ds.column_names, where, columns)
    return ds, where


def check_data_file(path: str, field: str) -> str:
    """Refuse a missing file, an unsupported type or unparsable JSON (Lines), cheaply (before any model loads).

    Raises:
        MissingFileError: naming ``field`` and ``path``.
        UserError: for a file not regular, of another type, or a JSON line (counted from 1) that does not parse or
            holds a non-finite number.
    """
    require_file(path, field)
    ext = os.path.splitext(path.removesuffix(".gz"))[1].lower()
    if ext not in FORMATS:
        raise UserError(f"{field}: unsupported file type {ext!r}; expected one of {sorted(FORMATS)}")
    problem = None
    if FORMATS[ext] == "json" and _is_json_array(path):  # datasets would turn a non-finite number into null
        problem = _json_problem(path)
    elif FORMATS[ext] == "json":
        try:
            _json_records(path)
        except UserError as e:  # a line that does not parse (text that is not UTF-8: the reader names its row)
            problem = str(e)
        except (OSError, UnicodeDecodeError):
            pass
    if problem is not None:
        raise UserError(f"{field}: {path!r} cannot be read as json ({problem})")
    return ext


class _TableDataModule(L.LightningDataModule):
    """A data module reading a local file or a hub dataset split (:func:`open_table`), kept as :attr:`table`.

    Args:
        path: Local jsonl/json/parquet/csv (optionally ``.gz``); takes precedence over ``name``.
        name: Hub dataset name.
        split: Split of the hub dataset.
        config_name: Subset of the hub dataset.
        revision: Revision of the hub dataset (a tag or commit).
    """

    def __init__(
        self,
        path: str | None = None,
        name: str | None = None,
        split: str = "train",
        config_name: str | None = None,
        revision: str | None = None,
    ) -> None:
        super().__init__()
        self.table = {"path": path, "name": name, "split": split, "config_name": config_name, "revision": revision}

    @property
    def table_given(self) -> bool:
        """Whether a file or a hub set is named."""
        return self.table["path"] is not None or self.table["name"] is not None


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
            raise UserError(f"{where}: {what} is missing; columns present: {present}")


def iter_rows(ds: Iterable[Any], where: str) -> Iterator[tuple[int, Any]]:
    """``enumerate(ds, 1)`` (rows count from 1, as an editor counts lines), bad UTF-8 refused naming the row.

    Raises:
        ValueError: ``"<where>: row <i>: text is not valid UTF-8 ..."``.
    """
    iterator = iter(ds)
    for i in itertools.count(1):
        try:
            rec = next(iterator)
        except StopIteration:
            return
        except UnicodeDecodeError as e:
            raise UserError(f"{where}: row {i}: text is not valid UTF-8 ({e.reason} at byte {e.start})") from e
        yield i, rec


def _open_text(path: str) -> Any:
    return gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")


def _is_json_array(path: str) -> bool:
    """Whether the file's first character (after white space) is ``[``: a JSON array rather than JSON Lines."""
    try:
        with _open_text(path) as f:
            while (char := f.read(1)) and char.isspace():
                pass
    except (OSError, UnicodeDecodeError):
        return False  # the reader names the problem
    return char == "["


class _NonFinite(str):
    """The text of a JSON number that is not finite (``1e309``, ``NaN``, ``Infinity``), kept to be named."""


def _json_float(text: str) -> float | _NonFinite:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def _non_finite_field(value: Any, field: str | None = None) -> tuple[str | None, str] | None:
    """``(field, text)`` of the first non-finite number in a parsed record (``field`` the top-level key)."""
    if isinstance(value, _NonFinite):
        return field, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if (found := _non_finite_field(item, key if field is None and isinstance(value, dict) else field)) is not None:
            return found
    return None


def _json_records(path: str, **hooks: Any) -> list[Any]:
    """The records of a JSON (Lines) file: a top-level list's items, else the non-blank lines (bad line named)."""
    with _open_text(path) as f:
        text = f.read()
    try:
        whole = json.loads(text, **hooks)
        return whole if isinstance(whole, list) else [whole]
    except json.JSONDecodeError:
        pass
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            records += [json.loads(line, **hooks)] if line.strip() else []
        except json.JSONDecodeError as e:
            raise UserError(f"line {number}: not valid JSON ({e.msg} at column {e.colno})") from None
    return records


def _json_problem(path: str) -> str | None:
    """The first JSON (Lines) row that does not parse or holds a non-finite number, described; else ``None``."""
    try:
        records = _json_records(path, parse_float=_json_float, parse_constant=_NonFinite)
    except (OSError, UnicodeDecodeError):
        return None
    except ValueError as e:
        return str(e)
    for i, rec in enumerate(records, 1):
        if (found := _non_finite_field(rec)) is not None:
            field, number = found
            at = f"row {i}: field {field!r}" if field is not None else f"row {i}"
            return f"{at} = {number} is not finite (beyond the range of a float, or NaN/Infinity)"
    return None


class JsonRows(list):
    """A JSON (Lines) file's rows as ``json`` reads them (mixed-type columns kept), with ``column_names``."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        names = list(dict.fromkeys(key for rec in records for key in rec))
        super().__init__({name: rec.get(name) for name in names} for rec in records)
        self.column_names = names


def _as_typed(ds: Any, path: str) -> Any:
    """``ds``, or the file's :class:`JsonRows` when ``datasets`` read a column of mixed types (``Json``)."""
    if "Json(" not in repr(ds.features):  # no column (nor nested field) of mixed types
        return ds
    try:
        records = _json_records(path)
    except (OSError, UnicodeDecodeError, ValueError):  # datasets read it: let its rows (and errors) stand
        return ds
    if len(records) != ds.num_rows or not all(isinstance(r, dict) for r in records):
        return ds
    return JsonRows(records)
