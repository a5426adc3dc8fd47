"""Tabular games for SMIDA: App. E.4/F utilities of an antisymmetric ensemble ``P [k, X, Y, Y]``, random games."""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from alignment_games.modules.algorithms.disagreement import decision_uncertainty, ensemble_jsd, ensemble_variance
from alignment_games.modules.algorithms.stackelberg import _SUM_TOLERANCE


def _check_preferences(name: str, p: Tensor, ensemble: bool) -> None:
    want, shape = (4, "[k, X, Y, Y]") if ensemble else (3, "[X, Y, Y]")
    if not isinstance(p, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(p).__name__}")
    if p.ndim != want or p.shape[-1] != p.shape[-2] or 0 in p.shape:
        raise ValueError(f"{name} must have shape {shape} with P[..., y, y′] = P(y ≻ y′ | x), got {list(p.shape)}")
    if not p.is_floating_point() or not ((p >= 0) & (p <= 1)).all():
        raise ValueError(f"{name} must hold probabilities in [0, 1]")
    gap = (p + p.transpose(-1, -2) - 1.0).abs().max()
    if gap > _SUM_TOLERANCE:
        raise ValueError(
            f"{name} must be antisymmetric, P(y ≻ y′) + P(y′ ≻ y) = 1, as the paper's preference models are "
            f"(eq. 27); the largest violation is {float(gap):.3g}"
        )


def tabular_ensemble_variance(P: Tensor) -> Tensor:
    """The paper's utility ``u = 4·Var_i P_i(y ≻ y′ | x)`` (population variance; §3.1, App. E.4), ``[X, Y, Y]``."""
    _check_preferences("P", P, ensemble=True)
    return 4.0 * ensemble_variance(P.movedim(0, -1))


def slhf_utility(P: Tensor) -> Tensor:
    """``u(x, y, y′) = P(y′ ≻ y | x)`` of one preference model ``[X, Y, Y]``: the Follower seeks to beat the Leader."""
    _check_preferences("P", P, ensemble=False)
    return P.transpose(-1, -2).clone()


def decision_uncertainty_utility(P: Tensor) -> Tensor:
    """``u = min(P̄, 1 − P̄)`` of the ensemble mean (App. F.1); antisymmetry makes copying the Leader a best response."""
    _check_preferences("P", P, ensemble=True)
    return decision_uncertainty(P.movedim(0, -1))


def jsd_utility(P: Tensor) -> Tensor:
    """Jensen–Shannon divergence ``H(P̄) − mean_i H(P_i)`` among the members (App. F.1): 0 where all agree."""
    _check_preferences("P", P, ensemble=True)
    return ensemble_jsd(P.movedim(0, -1))


def directed_utility(P: Tensor, member: int, lam: float) -> Tensor:
    """The directed objective of App. F.2 on the ``4·Var`` scale: ``4·Var + λ P_j(y′ ≻ y | x)`` for member ``j``."""
    _check_preferences("P", P, ensemble=True)
    if not -P.shape[0] <= member < P.shape[0]:
        raise ValueError(f"member must index one of the {P.shape[0]} members, got {member}")
    if not lam >= 0:
        raise ValueError(f"lam must be >= 0, got {lam}")
    return tabular_ensemble_variance(P) + lam * P[member].transpose(-1, -2)


def random_preference_ensemble(
    k: int,
    X: int,
    Y: int,
    generator: torch.Generator | None = None,
    *,
    scale: float = 2.0,
    spread: float = 1.0,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """A random tabular ensemble of ``k`` antisymmetric preference models, ``[k, X, Y, Y]``.

    Member ``i`` has ``P_i(y ≻ y′ | x) = σ(S_i)`` with skew-symmetric Gaussian scores ``S_i = scale · A + spread · B_i``
    (``A`` shared). Antisymmetry holds bit for bit: the partner of ``p = σ(|S|) ≥ ½`` is ``1 − p``, exact (Sterbenz).
    """
    for name, value in (("k", k), ("X", X), ("Y", Y)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    def skew(*shape: int) -> Tensor:
        a = torch.randn(*shape, Y, Y, generator=generator, dtype=dtype)
        return (a - a.transpose(-1, -2)) / math.sqrt(2.0)  # (a − b) = −(b − a) exactly; unit variance off-diagonal

    scores = scale * skew(1, X) + spread * skew(k, X)
    larger = torch.sigmoid(scores.abs())
    return torch.where(scores >= 0, larger, 1.0 - larger)


#: The utilities :func:`random_game` can build a game from, by name (what ``TabularSMIDA(utility=...)`` accepts).
UTILITIES = {
    "variance": tabular_ensemble_variance,
    "decision_uncertainty": decision_uncertainty_utility,
    "jsd": jsd_utility,
    "slhf": lambda p: slhf_utility(p.mean(0)),  # the ensemble mean is itself an antisymmetric preference model
}
#: The tensors every game holds (a saved game may add a context prior ``rho``).
GAME_KEYS = ("u", "pi_ref", "omega_ref")


def random_game(
    num_contexts: int,
    num_actions: int,
    ensemble_size: int,
    utility: str,
    reference: str,
    seed: int,
    dtype: torch.dtype = torch.float64,
) -> dict[str, Tensor]:
    """A random game ``{"u", "pi_ref", "omega_ref"}`` from a :data:`UTILITIES` key and random or uniform references."""
    if utility not in UTILITIES:
        raise ValueError(f"utility must be one of {sorted(UTILITIES)}, got {utility!r}")
    if reference not in ("random", "uniform"):
        raise ValueError(f"reference must be 'random' or 'uniform', got {reference!r}")
    gen = torch.Generator().manual_seed(seed)
    P = random_preference_ensemble(ensemble_size, num_contexts, num_actions, gen, dtype=dtype)
    x, y = num_contexts, num_actions
    if reference == "random":
        pi_ref = torch.softmax(torch.randn(x, y, generator=gen, dtype=dtype), -1)
        omega_ref = torch.softmax(torch.randn(x, y, y, generator=gen, dtype=dtype), -1)
    else:
        pi_ref = torch.full((x, y), 1.0 / y, dtype=dtype)
        omega_ref = torch.full((x, y, y), 1.0 / y, dtype=dtype)
    return {"u": UTILITIES[utility](P), "pi_ref": pi_ref, "omega_ref": omega_ref}


def load_game(path: str | os.PathLike) -> dict[str, Tensor]:
    """Read a game saved with ``torch.save({"u": ..., "pi_ref": ..., "omega_ref": ...[, "rho": ...]}, path)``.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: when the file is not a dict holding the three tensors.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"game_path {str(path)!r} does not exist")
    game = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(game, dict) or any(not isinstance(game.get(k), Tensor) for k in GAME_KEYS):
        found = sorted(game) if isinstance(game, dict) else type(game).__name__
        raise ValueError(
            f"game file {str(path)!r} must hold a dict of tensors {list(GAME_KEYS)} (+ optional rho), found {found}"
        )
    return game
