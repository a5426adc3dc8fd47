"""Utilities u(x, y, y′) of the Stackelberg game: any scorer of (prompt, leader response, follower response)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Literal

from torch import Tensor, nn

from alignment_games.modules.algorithms.disagreement import decision_uncertainty, ensemble_jsd, ensemble_variance

UtilityKind = Literal["variance", "decision_uncertainty", "jsd", "slhf", "directed", "preference", "mean_preference"]
UTILITY_KINDS = ("variance", "decision_uncertainty", "jsd", "slhf", "directed", "preference", "mean_preference")


def utility_from_member_probs(
    p: Tensor, kind: UtilityKind = "variance", scale: float = 4.0, lam: float = 0.0, member: int = 0
) -> Tensor:
    """The game utility from member probabilities ``p[..., k] = P_i(y ≻ y′ | x)`` (leader response first).

    * ``variance``: ``scale · Var`` (``scale = 4`` maps it to [0, 1], App. E.4);
    * ``decision_uncertainty``: ``min(P̄, 1 − P̄)``; ``jsd``: Jensen–Shannon divergence among the members;
    * ``slhf``: ``P(y′ ≻ y) = 1 − P̄`` (the follower wants to beat the leader, App. F);
    * ``directed``: ``scale · Var + λ · P_j(y′ ≻ y)`` with member ``j = member`` (App. F.2);
    * ``preference``: ``P_j(y ≻ y′)`` of member ``j`` alone, the frozen P0 of the NLHF/SLHF baselines (App. G.4);
    * ``mean_preference``: ``P̄(y ≻ y′)``, the ensemble mean, the other choice of P0.

    Raises:
        ValueError: for an unknown kind or a member index out of range.
    """
    if kind in ("directed", "preference") and not 0 <= member < p.shape[-1]:
        raise ValueError(f"member {member} is out of range for {p.shape[-1]} ensemble members")
    if kind == "variance":
        return scale * ensemble_variance(p)
    if kind == "decision_uncertainty":
        return decision_uncertainty(p)
    if kind == "jsd":
        return ensemble_jsd(p)
    if kind == "slhf":
        return 1.0 - p.mean(dim=-1)
    if kind == "directed":
        return scale * ensemble_variance(p) + lam * (1.0 - p[..., member])
    if kind == "preference":
        return p[..., member]
    if kind == "mean_preference":
        return p.mean(dim=-1)
    raise ValueError(f"unknown utility kind {kind!r}")


class Utility(nn.Module, ABC):
    """A utility ``u(x, y, y′)``: called on equal-length lists, returns a float tensor ``[N]`` on the CPU."""

    @abstractmethod
    def forward(self, prompts: Sequence[str], leader: Sequence[str], follower: Sequence[str]) -> Tensor:
        """Score each triplet."""
