"""Three intervals for a mean of ``x[seed, problem]`` (crossed and nested bootstraps, seed-level t), side by side.

With 3 seeds the bootstraps approach ``[min, max]`` of the seed means (coverage 1 − 2^(1 − S) = 0.75), so an interval
is said to exclude a value only when all three do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from alignment_games.modules.algorithms.checks import require_at_least

#: how each method is printed
LABELS = {"crossed": "crossed bootstrap", "nested": "nested bootstrap", "seed_t": "seed t"}


def _counts(gen: torch.Generator, shape: tuple[int, ...], n: int) -> torch.Tensor:
    """``[*shape, n]``: how often each of ``n`` items is drawn in ``n`` draws with replacement, per leading index."""
    idx = torch.randint(n, (*shape, n), generator=gen)
    return torch.zeros(*shape, n, dtype=torch.float64).scatter_add_(-1, idx, torch.ones_like(idx, dtype=torch.float64))


def _generator(seeds: int, problems: int, n_boot: int, seed: int) -> torch.Generator:
    """The resamples' generator, after checking the sizes."""
    if not problems:
        raise ValueError("no problems")
    require_at_least(n_boot=(n_boot, 1), seeds=(seeds, 1))
    return torch.Generator().manual_seed(seed)


def crossed_bootstrap_weights(
    seeds: int, problems: int, n_boot: int, seed: int = 0, batch: Sequence[int] = ()
) -> torch.Tensor:
    """``[*batch, n_boot, seeds, problems]``: how often a crossed resample counts seed ``s`` on problem ``p``.

    The problems are drawn once for all seeds, then the seeds; the weight is the product of the two counts. ``batch``
    gives independent draws to each of many data sets at once.

    Raises:
        ValueError: for no seeds, no problems or ``n_boot < 1``.
    """
    gen = _generator(seeds, problems, n_boot, seed)
    by_problem = _counts(gen, (*batch, n_boot), problems)  # drawn first, then the seeds
    return _counts(gen, (*batch, n_boot), seeds)[..., :, None] * by_problem[..., None, :]


def nested_bootstrap_weights(
    seeds: int, problems: int, n_boot: int, seed: int = 0, batch: Sequence[int] = ()
) -> torch.Tensor:
    """``[*batch, n_boot, seeds, problems]``: how often a nested resample counts seed ``s`` on problem ``p``.

    Each drawn seed draws its own problems (independently, also for a repeated seed); the weight sums the problem
    counts of every draw of seed ``s``.

    Raises:
        ValueError: for no seeds, no problems or ``n_boot < 1``.
    """
    gen = _generator(seeds, problems, n_boot, seed)
    drawn = torch.randint(seeds, (*batch, n_boot, seeds), generator=gen)  # [..., b, j]: the j-th drawn seed
    by_problem = _counts(gen, (*batch, n_boot, seeds), problems)  # [..., b, j, p]: that draw's problems
    which = torch.nn.functional.one_hot(drawn, seeds).double()  # [..., b, j, s]
    return torch.einsum("...js,...jp->...sp", which, by_problem)


def percentile_interval(values: torch.Tensor, confidence: float = 0.95) -> torch.Tensor:
    """``[..., 2]``: the central ``confidence`` percentile interval of the bootstrap ``values[..., n_boot]``."""
    tail = (1 - confidence) / 2
    q = torch.quantile(values.double(), torch.tensor([tail, 1 - tail], dtype=torch.float64), dim=-1)
    return q.movedim(0, -1)


def _bootstrap_interval(weights_fn: Any, x: torch.Tensor, n_boot: int, seed: int, confidence: float) -> torch.Tensor:
    """Percentile interval of the resamples' means of ``x[..., S, P]`` (every resample weighs ``S × P`` in all)."""
    x = x.double()
    w = weights_fn(x.shape[-2], x.shape[-1], n_boot, seed, x.shape[:-2])
    return percentile_interval(torch.einsum("...bsp,...sp->...b", w, x) / (x.shape[-2] * x.shape[-1]), confidence)


def crossed_bootstrap_interval(
    x: torch.Tensor, n_boot: int = 2000, seed: int = 0, confidence: float = 0.95
) -> torch.Tensor:
    """``[..., 2]``: percentile interval of the mean of ``x[..., seeds, problems]`` under the crossed bootstrap.

    With one seed this is the problem bootstrap; a leading batch draws independently for each data set.

    Raises:
        ValueError: for no problems or ``n_boot < 1``.
    """
    return _bootstrap_interval(crossed_bootstrap_weights, x, n_boot, seed, confidence)


def nested_bootstrap_interval(
    x: torch.Tensor, n_boot: int = 2000, seed: int = 0, confidence: float = 0.95
) -> torch.Tensor:
    """``[..., 2]``: percentile interval of the mean of ``x[..., seeds, problems]`` under the nested bootstrap.

    Raises:
        ValueError: for no problems or ``n_boot < 1``.
    """
    return _bootstrap_interval(nested_bootstrap_weights, x, n_boot, seed, confidence)


def seed_t_interval(per_seed: torch.Tensor, confidence: float = 0.95) -> torch.Tensor:
    """``[..., 2]``: the t interval (df = seeds − 1) of the mean of the per-seed statistics ``per_seed[..., seeds]``.

    Example:
        >>> [round(v, 3) for v in seed_t_interval(torch.tensor([0.115, 0.005, -0.035])).tolist()]
        [-0.165, 0.221]

    Raises:
        ValueError: for fewer than 2 seeds (no spread to estimate).
    """
    from scipy import stats  # here, not at the top: importing the bootstraps must not need scipy

    per_seed, n = per_seed.double(), per_seed.shape[-1]
    if n < 2:
        raise ValueError(f"a t interval over seeds needs at least 2 seeds, got {n}")
    half, mean = float(stats.t.ppf((1 + confidence) / 2, n - 1)) * per_seed.std(dim=-1) / n**0.5, per_seed.mean(-1)
    return torch.stack([mean - half, mean + half], dim=-1)


def compare_intervals(intervals: Mapping[str, Sequence[float] | None], null: float = 0.0) -> dict[str, Any]:
    """The intervals (``None``: not computed), the most conservative named, and whether all of them exclude ``null``.

    The most conservative: the widest of those containing ``null``, else the one whose nearer end is closest to it.

    Raises:
        ValueError: when no interval is given.
    """
    given = {k: [float(v) for v in ci] for k, ci in intervals.items() if ci is not None}
    if not given:
        raise ValueError("no intervals to compare")
    containing = {k: ci for k, ci in given.items() if ci[0] <= null <= ci[1]}
    if containing:
        pick = max(containing, key=lambda k: containing[k][1] - containing[k][0])
    else:
        pick = min(given, key=lambda k: min(abs(given[k][0] - null), abs(given[k][1] - null)))
    above, below = all(ci[0] > null for ci in given.values()), all(ci[1] < null for ci in given.values())
    out: dict[str, Any] = {k: given.get(k) for k in intervals}  # None where not computed
    return out | {"most_conservative": pick, "null": null, "excludes_null": above or below}


def seed_intervals(
    x: torch.Tensor,
    n_boot: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
    null: float = 0.0,
    crossed: bool = True,
) -> dict[str, Any]:
    """The three intervals of the mean of ``x[seeds, problems]``, compared by :func:`compare_intervals`.

    ``crossed=False`` (a nested design) leaves the crossed one ``None``, and one seed the t interval.
    """
    x = x.double()
    return compare_intervals(
        {
            "crossed": crossed_bootstrap_interval(x, n_boot, seed, confidence).tolist() if crossed else None,
            "nested": nested_bootstrap_interval(x, n_boot, seed, confidence).tolist(),
            "seed_t": seed_t_interval(x.mean(dim=-1), confidence).tolist() if x.shape[0] > 1 else None,
        },
        null,
    )


def format_intervals(summary: Mapping[str, Any], spec: str = "+.3f", scale: float = 1.0) -> str:
    """``crossed bootstrap [a, b] · nested bootstrap [c, d] · seed t [e, f]``, the most conservative in bold."""
    parts = {
        k: f"{label} [{format(scale * ci[0], spec)}, {format(scale * ci[1], spec)}]"
        for k, label in LABELS.items()
        if (ci := summary.get(k)) is not None
    }
    return " · ".join(f"**{t}**" if k == summary.get("most_conservative") else t for k, t in parts.items())
