"""Judge MCC from confusion counts and its least-squares trend (debate RLAIF, "Metrics")."""

import math
from collections.abc import Sequence
from typing import Any


def matthews_corrcoef_from_counts(tp: float, fp: float, tn: float, fn: float) -> float:
    r"""Matthews correlation from confusion counts; 0.0 where a denominator factor is zero, as sklearn's.

    Raises:
        ValueError: if a count is negative.

    Example:
        >>> matthews_corrcoef_from_counts(tp=5, fp=0, tn=5, fn=0)
        1.0
    """
    if min(tp, fp, tn, fn) < 0:
        raise ValueError(f"Confusion counts must be >= 0, got tp={tp}, fp={fp}, tn={tn}, fn={fn}.")
    factors = (tp + fp, tp + fn, tn + fp, tn + fn)
    if any(f == 0 for f in factors):
        return 0.0
    return (tp * tn - fp * fn) / math.sqrt(math.prod(float(f) for f in factors))


def confusion_cells(referenced: Any, truth: Any, accepts: Any, tie: Any, unparsed: Any) -> dict[str, Any]:
    """Each item's cell (tp, fp, tn, fn) of a judge's verdict on an answer, elementwise on boolean tensors or arrays.

    Only a decisive verdict (no tie, parsed) on an answer with a reference falls in a cell.
    """
    decisive = referenced & ~tie & ~unparsed
    return {
        "tp": decisive & accepts & truth,
        "fp": decisive & accepts & ~truth,
        "tn": decisive & ~accepts & ~truth,
        "fn": decisive & ~accepts & truth,
    }


def least_squares_slope(values: Sequence[float]) -> float:
    """Least-squares slope of ``values`` against their index 0, 1, ..., n - 1; 0.0 for fewer than two values.

    Example:
        >>> least_squares_slope([1.0, 2.0, 4.0])
        1.5
    """
    n = len(values)
    if n < 2:
        return 0.0
    x_mean = (n - 1) / 2.0
    y_mean = math.fsum(values) / n
    num = math.fsum((i - x_mean) * (y - y_mean) for i, y in enumerate(values))
    den = math.fsum((i - x_mean) ** 2 for i in range(n))
    return num / den
