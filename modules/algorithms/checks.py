"""Value checks that refuse a bad argument by name, one message per kind (positive, at least, in an interval)."""

from __future__ import annotations


class UserError(ValueError):
    """A bad config value, file or row: ``train.py`` prints its message as one ``error:`` line and exits 2."""


class MissingFileError(FileNotFoundError, UserError):
    """A file the config names does not exist."""


def require_positive(**values: float) -> None:
    """Refuse, by name, the first value that is not > 0 (NaN included): rates, temperatures, clip ranges.

    Raises:
        ValueError: ``"<name> must be positive, got <value>"``.
    """
    for name, value in values.items():
        if not value > 0:
            raise UserError(f"{name} must be positive, got {value!r}")


def require_at_least(**values: tuple[float, float]) -> None:
    """Refuse, by name, the first ``name=(value, minimum)`` with ``value`` below ``minimum`` (NaN included).

    Raises:
        ValueError: ``"<name> must be at least <minimum>, got <value>"``.
    """
    for name, (value, minimum) in values.items():
        if not value >= minimum:
            raise UserError(f"{name} must be at least {minimum}, got {value!r}")


def require_in_range(
    name: str, value: float, low: float, high: float, *, open_low: bool = False, open_high: bool = False
) -> None:
    """Refuse ``value`` outside ``[low, high]`` (an end excluded when ``open_low`` / ``open_high``; NaN refused).

    Raises:
        ValueError: ``"<name> must be in (low, high], got <value>"`` with the interval as checked.
    """
    above = value > low if open_low else value >= low
    below = value < high if open_high else value <= high
    if not (above and below):
        interval = f"{'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
        raise UserError(f"{name} must be in {interval}, got {value!r}")
