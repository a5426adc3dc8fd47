"""Utilities u(x, y, y′) of the Stackelberg game: any scorer of (prompt, leader response, follower response).

The paper's utility is ``4·Var`` of a frozen preference ensemble (App. E.4); the alternatives of App. F are
computed from the same member probabilities (:func:`utility_from_member_probs`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn
from typing_extensions import override

from alignment_games.modules.algorithms.disagreement import decision_uncertainty, ensemble_jsd, ensemble_variance

__all__ = ["EnsembleUtility", "Utility", "utility_from_member_probs"]

# Why a utility without a checkpoint is refused, and the two ways out (a trained ensemble, or asking by name).
UNTRAINED_REFUSAL = (
    "EnsembleUtility: no checkpoint, so the game would be played against an untrained ensemble with random heads. "
    "Train one with `python train.py fit --config configs/preference_ensemble.yaml` (the main job) and give "
    "--model.init_args.utility.init_args.checkpoint=runs/preference_ensemble/version_<n>/checkpoints/last.ckpt; "
    "for a smoke test, ask for the untrained one by name with "
    "--model.init_args.utility.init_args.allow_untrained=true"
)

UtilityKind = Literal["variance", "decision_uncertainty", "jsd", "slhf", "directed", "preference", "mean_preference"]
UTILITY_KINDS = ("variance", "decision_uncertainty", "jsd", "slhf", "directed", "preference", "mean_preference")


def utility_from_member_probs(
    p: Tensor, kind: UtilityKind = "variance", scale: float = 4.0, lam: float = 0.0, member: int = 0
) -> Tensor:
    """The game utility from member probabilities ``p[..., k] = P_i(y ≻ y′ | x)`` (leader response first).

    * ``variance``: ``scale · Var`` (``scale = 4`` maps it to [0, 1], App. E.4);
    * ``decision_uncertainty``: ``min(P̄, 1 − P̄)``;
    * ``jsd``: Jensen–Shannon divergence among the members;
    * ``slhf``: ``P(y′ ≻ y) = 1 − P̄`` (the follower wants to beat the leader, App. F);
    * ``directed``: ``scale · Var + λ · P_j(y′ ≻ y)`` with member ``j = member`` (App. F.2);
    * ``preference``: ``P_j(y ≻ y′)`` of member ``j = member`` alone, the first response's win probability: the one
      frozen preference model P0 of the NLHF and SLHF baselines (App. G.4), which read it as a preference;
    * ``mean_preference``: ``P̄(y ≻ y′)``, the ensemble mean (the prediction the paper's Definition 3.1 and its 75.7%
      accuracy are stated for), the other choice of P0.

    Raises:
        ValueError: for an unknown kind or a member index out of range.
    """
    if kind == "variance":
        return scale * ensemble_variance(p)
    if kind == "decision_uncertainty":
        return decision_uncertainty(p)
    if kind == "jsd":
        return ensemble_jsd(p)
    if kind == "slhf":
        return 1.0 - p.mean(dim=-1)
    if kind == "directed":
        if not 0 <= member < p.shape[-1]:
            raise ValueError(f"member {member} is out of range for {p.shape[-1]} ensemble members")
        return scale * ensemble_variance(p) + lam * (1.0 - p[..., member])
    if kind == "preference":
        if not 0 <= member < p.shape[-1]:
            raise ValueError(f"member {member} is out of range for {p.shape[-1]} ensemble members")
        return p[..., member]
    if kind == "mean_preference":
        return p.mean(dim=-1)
    raise ValueError(f"unknown utility kind {kind!r}")


class Utility(nn.Module, ABC):
    """A utility ``u(x, y, y′)``: called on equal-length lists, returns a float tensor ``[N]`` on the CPU."""

    @abstractmethod
    def forward(self, prompts: Sequence[str], leader: Sequence[str], follower: Sequence[str]) -> Tensor:
        """Score each triplet."""


class EnsembleUtility(Utility):
    """A utility computed from a frozen preference ensemble (see :func:`utility_from_member_probs`).

    The ensemble is built from these arguments (``backbone``, ``backbone_task``, ``num_members`` and ``ensemble``),
    never from the hyper-parameters stored in ``checkpoint``, which could name a model folder with code to run; the
    checkpoint gives only tensors, and one that does not fit the ensemble built is refused naming both (see
    :meth:`~modules.preference.PreferenceEnsemble.load_frozen`).

    Args:
        checkpoint: Checkpoint of a trained :class:`~modules.preference.PreferenceEnsemble` (the main job writes
            ``runs/preference_ensemble/version_*/checkpoints/last.ckpt``); the arguments here must describe the
            ensemble it was trained as. ``None`` is refused unless ``allow_untrained`` asks for an untrained one.
        kind: Which utility.
        scale: Multiplier of the variance.
        lam: λ of the directed objective.
        member: Member ``j`` of the directed objective, or the one preference model of ``kind: preference``.
        batch_size: Pairs scored per ensemble call.
        num_members: Members of the ensemble.
        backbone: Backbone of the ensemble (e.g. the policy's own folder, as the paper's Qwen members).
        backbone_task: ``encoder`` or ``causal_lm`` for that backbone.
        ensemble: Further :class:`~modules.preference.PreferenceEnsemble` arguments, as in the trained run's config
            (``member_type``, ``embed_dim``, ``sharing``, ``pooling``, ``max_length``, or a whole ``lm``, which then
            replaces ``backbone``).
        allow_untrained: With no ``checkpoint``, build an untrained ensemble with randomly initialised heads (a real
            function of the texts, for smoke tests only) instead of refusing to start. A game against it trains the
            players on noise.

    Raises:
        ValueError: without ``checkpoint`` unless ``allow_untrained``, naming both options and the config that trains
            an ensemble; for an unknown ``kind``.
    """

    def __init__(
        self,
        checkpoint: str | None = None,
        kind: UtilityKind = "variance",
        scale: float = 4.0,
        lam: float = 0.0,
        member: int = 0,
        batch_size: int = 64,
        num_members: int = 5,
        backbone: str = "builtin:minilm-l6",
        backbone_task: str = "encoder",
        ensemble: dict[str, Any] | None = None,
        allow_untrained: bool = False,
    ) -> None:
        super().__init__()
        from alignment_games.modules.lm.model_config import ModelConfig
        from alignment_games.modules.preference import PreferenceEnsemble

        if kind not in UTILITY_KINDS:
            raise ValueError(f"utility kind {kind!r} is not one of {', '.join(UTILITY_KINDS)}")
        args: dict[str, Any] = {"lm": ModelConfig(backbone), "backbone_task": backbone_task, "num_members": num_members}
        args.update(ensemble or {})
        if checkpoint is None:
            if not allow_untrained:
                raise ValueError(UNTRAINED_REFUSAL)
            model = PreferenceEnsemble(**args).eval().requires_grad_(False)
        else:
            model = PreferenceEnsemble.load_frozen(checkpoint, **args)
        utility_from_member_probs(torch.full((1, model.hparams.num_members), 0.5), kind, scale, lam, member)
        self.ensemble = model
        self.kind, self.scale, self.lam, self.member, self.batch_size = kind, scale, lam, member, batch_size
        self.last_member_probs: Tensor | None = None

    def member_probs(self, prompts: Sequence[str], leader: Sequence[str], follower: Sequence[str]) -> Tensor:
        """``[N, k]`` member probabilities that the leader's response is preferred."""
        return self.ensemble.score(list(prompts), list(leader), list(follower), batch_size=self.batch_size)

    @override
    @torch.no_grad()
    def forward(self, prompts, leader, follower):
        p = self.member_probs(prompts, leader, follower)
        self.last_member_probs = p  # read by the game for diagnostics (variance shares) without scoring twice
        return utility_from_member_probs(p, self.kind, self.scale, self.lam, self.member).float()
