"""Policy-optimisation losses shared by the games: GRPO-style group advantages and clipped loss, and sigmoid DPO.

Log-probabilities come from :meth:`modules.lm.policy_bank.PolicyBank.token_logprobs` (completion tokens only).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

__all__ = ["dpo_loss", "group_advantages", "grpo_loss", "length_normalized_nll"]


def group_advantages(rewards: Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> Tensor:
    """Group-relative advantages: each reward minus its group's mean, optionally divided by the group's std.

    Rows ``[g·G, (g+1)·G)`` form group ``g`` (the layout of ``PolicyBank.generate``); the std is the unbiased one.

    Args:
        rewards: ``[N]`` with ``N`` a multiple of ``group_size``.
        group_size: ``G`` ≥ 2.
        scale: Divide by the group std (GRPO); ``False`` keeps the plain mean baseline (Dr. GRPO / RLOO-style).
        eps: Added to the std.

    Raises:
        ValueError: ``group_size`` < 2, or ``N`` not a multiple of it.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2 for a group baseline, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by group_size={group_size}, got {tuple(rewards.shape)}"
        )
    # float64: a float32 mean of rewards far from zero (a composite reward of ~100) is off by an ulp of the
    # rewards, which skews a near-tied group's advantages; in float64 a pair's are exact negatives
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
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped GRPO surrogate (Shao et al., 2024), per token, averaged over each sequence then over sequences.

    ``ρ_t = exp(log π_θ(o_t) − log π_old(o_t))``; the per-token objective is
    ``min(ρ_t A, clip(ρ_t, 1 − ε, 1 + ε) A) − β·KL_t`` with the k3 estimator
    ``KL_t = exp(r_t) − r_t − 1``, ``r_t = log π_ref(o_t) − log π_θ(o_t)`` (unbiased and non-negative). With
    ``old_token_logprobs=None`` the rollout is on-policy (``π_old`` is ``π_θ`` detached, so ``ρ = 1`` in value).

    Args:
        token_logprobs: ``[N, C]`` log π_θ of each completion token (with gradients).
        completion_mask: ``[N, C]``, 1 on completion tokens.
        advantages: ``[N]``.
        old_token_logprobs: ``[N, C]`` from the sampling policy, or ``None`` (on-policy).
        ref_token_logprobs: ``[N, C]`` from the frozen reference; needed when ``beta > 0``.
        clip: ε of the ratio clipping, or ``None`` for no clipping.
        beta: KL coefficient.

    Returns:
        ``(loss, stats)`` with ``stats``: ``kl`` (mean per-token k3 KL, 0 without a reference), ``clip_fraction``
        (share of tokens whose ratio was clipped), ``ratio`` (mean ratio).

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
    lengths = mask.sum(dim=1).clamp_min(1.0)
    loss = -((per_token * mask).sum(dim=1) / lengths).mean()
    n_tokens = mask.sum().clamp_min(1.0)
    stats = {
        "kl": ((kl * mask).sum() / n_tokens).detach(),
        "clip_fraction": ((clipped_frac * mask).sum() / n_tokens).detach(),
        "ratio": ((ratio * mask).sum() / n_tokens).detach(),
    }
    return loss, stats


def dpo_loss(
    policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor, beta: float = 0.1
) -> tuple[Tensor, Tensor, Tensor]:
    """Sigmoid DPO (Rafailov et al., 2023): ``−log σ(β[(log π_c − log π_ref,c) − (log π_r − log π_ref,r)])``.

    Inputs are sequence log-probabilities (sums over completion tokens), ``[N]`` each.

    Returns:
        ``(loss per pair [N], chosen implicit reward β(log π_c − log π_ref,c) [N], rejected reward [N])``; the
        rewards are detached, for logging margins and accuracies.
    """
    if beta <= 0:
        raise ValueError(f"beta must be positive, got {beta}")
    chosen = policy_chosen - ref_chosen
    rejected = policy_rejected - ref_rejected
    loss = -F.logsigmoid(beta * (chosen - rejected))
    return loss, (beta * chosen).detach(), (beta * rejected).detach()


def length_normalized_nll(policy_chosen: Tensor, chosen_lengths: Tensor) -> Tensor:
    """The NLL term of RPO (Pang et al., 2024, iterative reasoning preference optimisation): ``−log π(y_c) / |y_c|``.

    Added to DPO's loss with a weight (``α = 1`` in the paper), it keeps the chosen solutions likely: on GSM8K the
    paper found DPO alone lowers the chosen sequences' likelihood along with the rejected ones and gains little, while
    DPO + NLL raised accuracy over iterations. Inputs are sequence log-probabilities ``[N]`` and completion token
    counts ``[N]``; returns ``[N]``.

    Raises:
        ValueError: for a length below 1 or shapes that differ.
    """
    if policy_chosen.shape != chosen_lengths.shape:
        raise ValueError(f"{tuple(policy_chosen.shape)} log-probabilities for {tuple(chosen_lengths.shape)} lengths")
    if bool((chosen_lengths < 1).any()):
        raise ValueError(f"chosen lengths must be at least 1 token, got {chosen_lengths.tolist()}")
    return -policy_chosen / chosen_lengths.to(policy_chosen.dtype)
