"""Policy-optimisation losses shared by the games: GRPO-style group advantages and clipped loss, and pairwise losses."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from alignment_games.modules.algorithms.checks import require_at_least, require_positive


@dataclass(frozen=True)
class PolicyGradient:
    """The group-relative policy-gradient update: group baseline, clipped ratio, k3 KL to the frozen reference.

    Attributes:
        group_size: G, samples per prompt (≥ 2: the group's mean is the baseline).
        clip: ε of the ratio clipping (``None``: none; with one update per batch the ratio is 1 in value).
        kl_coef: β, weight of the k3 KL to the reference (0 skips the reference forward).
        updates_per_batch: μ, optimizer steps on each batch of rollouts (> 1 reuses it; that is where the clip acts).
        scale_advantages: Divide the group advantages by the group's std (GRPO); ``False`` keeps the mean baseline.
        baseline: Subtract the group's mean reward (GRPO). ``False`` makes the reward itself the advantage: with the
            answer checker's 0/1 reward, ``kl_coef: 0`` and ``clip: null`` that is Online RFT (Shao et al., 2024,
            §5.2.1); with GRPO's KL and clip, GRPO without group baseline. It needs ``scale_advantages: false``.
        micro_batch: Rows per forward of the policy with gradients (0: all at once).
        logprob_micro_batch: Rows per forward without gradients (reference and sampling policy; 0: all at once).
        max_tokens_per_micro_batch: Padded tokens per forward, with or without gradients (0: no limit; docs/scaling.md).
        tis_cap: C of truncated importance sampling for rollouts an engine sampled (``lm.decode: vllm``): each token's
            loss weighted by ``min(exp(log π_trainer − log π_engine), C)`` (:func:`truncated_is_weights`); null: off.

    Raises:
        ValueError: for a value out of range, naming the field.
    """

    group_size: int = 4
    clip: float | None = 0.2
    kl_coef: float = 0.0
    updates_per_batch: int = 1
    scale_advantages: bool = True
    baseline: bool = True
    micro_batch: int = 0
    logprob_micro_batch: int = 0
    max_tokens_per_micro_batch: int = 0
    tis_cap: float | None = None

    def __post_init__(self) -> None:
        minima = (("group_size", 2), ("updates_per_batch", 1), ("micro_batch", 0), ("max_tokens_per_micro_batch", 0))
        require_at_least(**{f"policy_gradient.{name}": (getattr(self, name), least) for name, least in minima})
        if not self.logprob_micro_batch >= 0 or not self.kl_coef >= 0:
            raise ValueError(
                f"policy_gradient.kl_coef ({self.kl_coef!r}) and logprob_micro_batch ({self.logprob_micro_batch!r}) "
                "must be at least 0"
            )
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"policy_gradient.clip must be positive or null, got {self.clip!r}")
        if self.tis_cap is not None and not self.tis_cap >= 1:
            raise ValueError(f"policy_gradient.tis_cap must be at least 1 or null, got {self.tis_cap!r}")
        if not self.baseline and self.scale_advantages:
            raise ValueError("policy_gradient.scale_advantages must be false when policy_gradient.baseline is false")

    def advantages(self, rewards: Tensor) -> Tensor:
        """:func:`group_advantages` of ``rewards`` ``[N]`` in groups of :attr:`group_size`."""
        return group_advantages(rewards, self.group_size, scale=self.scale_advantages, baseline=self.baseline)

    def loss(
        self,
        logprobs: Tensor,
        mask: Tensor,
        advantages: Tensor,
        old: Tensor | None = None,
        ref: Tensor | None = None,
        sampled: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """:func:`grpo_loss` (old, reference and engine log-probabilities optional) with this clip, KL and TIS cap."""
        settings = {"clip": self.clip, "beta": self.kl_coef, "tis_cap": self.tis_cap}
        return grpo_loss(logprobs, mask, advantages, old, ref, sampled=sampled, **settings)


def group_advantages(
    rewards: Tensor, group_size: int, scale: bool = True, eps: float = 1e-4, baseline: bool = True
) -> Tensor:
    """Group-relative advantages of rows ``[g·G, (g+1)·G)``: reward minus group mean, over ``std + eps`` if ``scale``.

    ``baseline=False`` returns the rewards themselves (Online RFT with a 0/1 reward).

    Raises:
        ValueError: ``group_size`` < 2, ``N`` not a multiple of it, or ``scale`` without a baseline.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2 for a group baseline, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by group_size={group_size}, got {tuple(rewards.shape)}"
        )
    # float64: a float32 mean of rewards far from zero (a composite reward of ~100) is off by an ulp of the
    # rewards, which skews a near-tied group's advantages; in float64 a pair's are exact negatives
    if not baseline:
        if scale:
            raise ValueError("scaling by the group's std needs its mean as the baseline (baseline=True)")
        return rewards.clone()
    grouped = rewards.view(-1, group_size).double()
    adv = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (grouped.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1).to(rewards.dtype)


def grpo_loss(
    token_logprobs: Tensor,
    completion_mask: Tensor,
    advantages: Tensor,
    old_token_logprobs: Tensor | None = None,
    ref_token_logprobs: Tensor | None = None,
    clip: float | None = 0.2,
    beta: float = 0.0,
    sampled: Tensor | None = None,
    tis_cap: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped GRPO surrogate (Shao et al., 2024), per token, averaged over each sequence then over sequences.

    Per token ``min(ρ_t A, clip(ρ_t, 1 ± ε) A) − β·KL_t``, ``ρ_t = exp(log π_θ − log π_old)``, with the k3 estimator
    ``KL_t = exp(r_t) − r_t − 1``, ``r_t = log π_ref − log π_θ``; ``old_token_logprobs=None`` is on-policy (``ρ = 1``).
    ``sampled``: the log-probs the tokens were sampled with by an engine; ``tis_cap`` then weights each token's term
    by :func:`truncated_is_weights` of the trainer's sampling-time log-probs (``old``) against them, as TRL does.
    Returns ``(loss, stats)``, stats detached: ``kl`` (mean per-token k3), ``clip_fraction``, ``ratio`` (mean), and
    with ``sampled`` ``logprob_gap`` (mean ``|log π_old − log π_engine|`` over completion tokens).

    Raises:
        ValueError: mismatched shapes, or ``beta > 0`` without reference log-probabilities.
    """
    if token_logprobs.shape != completion_mask.shape or advantages.shape != token_logprobs.shape[:1]:
        raise ValueError(
            f"token_logprobs {tuple(token_logprobs.shape)}, completion_mask {tuple(completion_mask.shape)} and "
            f"advantages {tuple(advantages.shape)} must be [N, C], [N, C], [N]"
        )
    if beta > 0 and ref_token_logprobs is None:
        raise ValueError("beta > 0 needs ref_token_logprobs")
    mask = completion_mask.to(token_logprobs.dtype)
    old = token_logprobs.detach() if old_token_logprobs is None else old_token_logprobs
    ratio = torch.exp(token_logprobs - old)
    adv = advantages.unsqueeze(1).to(token_logprobs.dtype)
    unclipped = ratio * adv
    if clip is not None:
        clipped = torch.clamp(ratio, 1.0 - clip, 1.0 + clip) * adv
        per_token = torch.minimum(unclipped, clipped)
        clipped_frac = ((ratio - 1.0).abs() > clip).to(mask.dtype)
    else:
        per_token = unclipped
        clipped_frac = torch.zeros_like(mask)
    kl = torch.zeros_like(token_logprobs)
    if ref_token_logprobs is not None:
        r = ref_token_logprobs - token_logprobs
        kl = torch.exp(r) - r - 1.0
    per_token = per_token - beta * kl
    if sampled is not None and tis_cap is not None:
        per_token = per_token * truncated_is_weights(old, sampled, tis_cap)
    lengths = mask.sum(dim=1).clamp_min(1.0)
    loss = -((per_token * mask).sum(dim=1) / lengths).mean()
    n_tokens = mask.sum().clamp_min(1.0)
    per_token_stats = {"kl": kl, "clip_fraction": clipped_frac, "ratio": ratio}
    if sampled is not None:
        per_token_stats["logprob_gap"] = (old.detach() - sampled).abs()
    return loss, {k: ((v * mask).sum() / n_tokens).detach() for k, v in per_token_stats.items()}


def truncated_is_weights(trainer: Tensor, engine: Tensor, cap: float) -> Tensor:
    """Per-token ``min(exp(trainer − engine), cap)``, detached: truncated importance sampling (TRL, verl).

    The engine samples with its own kernels, so its probabilities of the sampled tokens differ a little from the
    trainer's for the same weights; this reweights each token towards the trainer's policy, capped so that a token
    the engine found unlikely cannot dominate the gradient.
    """
    return torch.exp(trainer.detach() - engine).clamp(max=cap)


PAIRWISE_LOSS_TYPES = ("dpo", "ipo", "rpo", "simpo")


@dataclass(frozen=True)
class PairwiseLoss:
    """A preference loss on a chosen and a rejected reply's sequence log-probabilities, named as TRL's ``loss_type``.

    Attributes:
        loss_type: ``dpo`` (:func:`dpo_loss`), ``ipo`` (:func:`ipo_loss`), ``rpo`` (DPO plus ``alpha`` times the
            chosen reply's NLL per token, Pang et al., 2024) or ``simpo`` (:func:`simpo_loss`).
        beta: β of DPO, RPO and SimPO; τ of IPO (target margin 1/(2τ)), which TRL also names ``beta``.
        gamma: γ, SimPO's target reward margin.
        alpha: α, RPO's weight of the NLL term (the paper's 1).

    Raises:
        ValueError: for a value out of range, naming the field.
    """

    loss_type: str = "dpo"
    beta: float = 0.1
    gamma: float = 0.5
    alpha: float = 1.0

    def __post_init__(self) -> None:
        require_positive(**{"pairwise.beta": self.beta})
        require_at_least(**{"pairwise.gamma": (self.gamma, 0.0), "pairwise.alpha": (self.alpha, 0.0)})
        if self.loss_type not in PAIRWISE_LOSS_TYPES:
            raise ValueError(f"pairwise.loss_type must be one of {PAIRWISE_LOSS_TYPES}, got {self.loss_type!r}")

    @property
    def uses_reference(self) -> bool:
        """Whether the loss reads the reference's log-probabilities (all but SimPO)."""
        return self.loss_type != "simpo"

    def __call__(
        self, chosen: Tensor, rejected: Tensor, ref: tuple[Tensor, Tensor] | None, lengths: tuple[Tensor, Tensor]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Per-pair loss ``[N]`` and the detached implicit rewards of the chosen and the rejected replies.

        ``ref``: the reference's log-probabilities of both (``None`` for SimPO); ``lengths``: their token counts.
        """
        if self.loss_type == "simpo":
            return simpo_loss(chosen, rejected, lengths, self.beta, self.gamma)
        if self.loss_type == "ipo":
            return ipo_loss(chosen, rejected, ref, lengths, self.beta)
        loss, chosen_reward, rejected_reward = dpo_loss(chosen, rejected, *ref, self.beta)
        if self.loss_type == "rpo":  # the NLL keeps the chosen replies likely; DPO alone lowers them with the rejected
            loss = loss - self.alpha * per_token(chosen, lengths[0])
        return loss, chosen_reward, rejected_reward


def dpo_loss(
    policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor, beta: float = 0.1
) -> tuple[Tensor, Tensor, Tensor]:
    """Sigmoid DPO (Rafailov et al., 2023) on sequence log-probabilities: per-pair loss, detached implicit rewards."""
    require_positive(beta=beta)
    chosen = policy_chosen - ref_chosen
    rejected = policy_rejected - ref_rejected
    loss = -F.logsigmoid(beta * (chosen - rejected))
    return loss, (beta * chosen).detach(), (beta * rejected).detach()


def ipo_loss(
    chosen: Tensor, rejected: Tensor, ref: tuple[Tensor, Tensor], lengths: tuple[Tensor, Tensor], tau: float = 0.1
) -> tuple[Tensor, Tensor, Tensor]:
    """IPO (Azar et al., 2023, eq. 17): ``(h − 1/(2τ))²``, ``h`` the difference of per-token log-ratios (the rewards).

    Sequence log-probabilities of the chosen and rejected replies, the reference's (``ref``) and their token counts.
    Per token, as TRL and the paper's authors compute it: summed log-ratios would make the squared loss grow with
    the replies' length, so that no single τ suits short and long replies.
    """
    require_positive(tau=tau)
    chosen_ratio = per_token(chosen - ref[0], lengths[0])
    rejected_ratio = per_token(rejected - ref[1], lengths[1])
    # squared, not logistic: the margin is pulled to 1/(2τ) and no further, so a deterministic preference cannot
    # drive the policy's ratio to infinity as DPO's loss does
    return (chosen_ratio - rejected_ratio - 1 / (2 * tau)) ** 2, chosen_ratio.detach(), rejected_ratio.detach()


def simpo_loss(
    chosen: Tensor, rejected: Tensor, lengths: tuple[Tensor, Tensor], beta: float = 2.0, gamma: float = 0.5
) -> tuple[Tensor, Tensor, Tensor]:
    """SimPO (Meng et al., 2024): ``−log σ(β log π(y_c)/|y_c| − β log π(y_r)/|y_r| − γ)``; rewards ``β log π/|y|``.

    No reference model: the implicit reward is the policy's mean token log-probability (what sampling ranks by), and
    the margin γ asks the chosen reply to beat the rejected one by more than a tie.
    """
    require_positive(beta=beta)
    chosen_reward = beta * per_token(chosen, lengths[0])
    rejected_reward = beta * per_token(rejected, lengths[1])
    return -F.logsigmoid(chosen_reward - rejected_reward - gamma), chosen_reward.detach(), rejected_reward.detach()


def per_token(logprobs: Tensor, lengths: Tensor) -> Tensor:
    """Sequence log-probabilities (or log-ratios) ``[N]`` over their token counts ``lengths`` ``[N]``.

    Raises:
        ValueError: for a length below 1 or shapes that differ.
    """
    if logprobs.shape != lengths.shape:
        raise ValueError(f"{tuple(logprobs.shape)} log-probabilities for {tuple(lengths.shape)} lengths")
    if bool((lengths < 1).any()):
        raise ValueError(f"reply lengths must be at least 1 token, got {lengths.tolist()}")
    return logprobs / lengths.to(logprobs.dtype)
