"""GRPO (Shao et al., 2024): one LM policy, G samples per prompt, group-relative advantages; docs/grpo.md."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from alignment_games.callbacks.items import ItemRecords
from alignment_games.modules.algorithms.checks import require_at_least, require_in_range, require_positive
from alignment_games.modules.algorithms.rl_losses import PairwiseLoss, PolicyGradient
from alignment_games.modules.base import LanguageModelGame
from alignment_games.modules.lm.micro_batches import micro_batches, row_lengths
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.precision import resolve_dtype
from alignment_games.modules.lm.rollout import Rollout
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.scorers.reward_models import RewardModels, answer_rewards

PLAYER = "policy"


class GRPO(LanguageModelGame):
    """Group Relative Policy Optimization of one LM policy (LoRA over a frozen base, or a full copy).

    Args:
        lm: The policy (:class:`ModelConfig`: LoRA adapter or full copy); its frozen weights are the reference.
        reward_models: Sequence-classification reward models (paths), each one scalar, loaded like the policy.
        answer_reward: Add the RLVR reward: 1 when the reply's last ``\\boxed{}`` matches the prompt's reference.
        reward_weights: One weight per reward model, then one for the answer reward (default: all 1).
        reward_batch_size: Rows per reward-model forward (0: the whole batch at once).
        reward_max_length: Tokens per reward-model input (cut from the left).
        policy_gradient: The update (:class:`PolicyGradient`); default G = 4, β = 0.04.
        pairwise: Train instead by this pairwise loss (:class:`PairwiseLoss`) on each group's best and worst reply by
            reward, as online DPO (Guo et al., 2024) and online IPO (Calandriello et al., 2024) do; groups that tie
            give no pair; ``policy_gradient`` then sets G only (its ``kl_coef`` must be 0: the loss holds the KL).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        adam_betas: AdamW betas.
        sampling: How replies are sampled (:class:`Sampling`; temperature also of the log-probabilities).
        system_prompt: System message of the chat template (``None``: none).
        chat_template: Render prompts with the tokenizer's chat template; ``False`` feeds them as they are.
        skip_uniform_groups: Skip the forward of groups with equal rewards (exact with β = 0, a group baseline and one
            process only).
        eval_max_new_tokens: Tokens per greedy reply on validation (``None``: ``sampling.max_new_tokens``).
        **game: :class:`~alignment_games.modules.base.LanguageModelGame`'s arguments (samples: ``val/generations``).
    """

    family = "GRPO"

    def __init__(
        self,
        lm: ModelConfig,
        reward_models: list[str] | None = None,
        answer_reward: bool = True,
        reward_weights: list[float] | None = None,
        reward_batch_size: int = 0,
        reward_max_length: int = 1024,
        policy_gradient: PolicyGradient = PolicyGradient(kl_coef=0.04),
        pairwise: PairwiseLoss | None = None,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        adam_betas: tuple[float, float] = (0.9, 0.999),
        sampling: Sampling = Sampling(),
        system_prompt: str | None = None,
        chat_template: bool = True,
        skip_uniform_groups: bool = True,
        eval_max_new_tokens: int | None = None,
        **game: Any,
    ) -> None:
        super().__init__(**game)
        lm = ModelConfig.coerce(lm)
        reward_models = list(reward_models or [])
        if not reward_models and not answer_reward:
            raise ValueError("no reward: give reward_models, or answer_reward: true, or both")
        n_rewards = len(reward_models) + int(answer_reward)
        if reward_weights is not None and len(reward_weights) != n_rewards:
            raise ValueError(
                f"reward_weights has {len(reward_weights)} entries but there are {n_rewards} rewards "
                f"({len(reward_models)} reward models{' + the answer reward' if answer_reward else ''})"
            )
        require_positive(lr=lr)
        limits = {"weight_decay": (weight_decay, 0.0), "reward_batch_size": (reward_batch_size, 0)}
        limits |= {"reward_max_length": (reward_max_length, 1), "eval_max_new_tokens": (eval_max_new_tokens, 1)}
        require_at_least(**{k: v for k, v in limits.items() if v[0] is not None})
        for i, b in enumerate(adam_betas):
            require_in_range(f"adam_betas[{i}]", b, 0.0, 1.0, open_high=True)
        self.save_arguments(lm, sampling=Sampling, policy_gradient=PolicyGradient, pairwise=PairwiseLoss)
        if self.pairwise is not None and self.policy_gradient.kl_coef:
            raise ValueError("policy_gradient.kl_coef must be 0 with pairwise (the pairwise loss holds the KL term)")
        self.players = PolicyBank(lm, players=(PLAYER,))
        scoring = (reward_batch_size, reward_max_length, resolve_dtype(lm.dtype, frozen=True), lm.trust_remote_code)
        self.reward_models = RewardModels(reward_models, *scoring) if reward_models else None
        weights = torch.tensor(reward_weights or [1.0] * n_rewards, dtype=torch.float32)
        self.register_buffer("reward_weight", weights, persistent=False)
        # per held-out prompt: reward and answer match (NaN without a reference), each prompt once across ranks
        self.eval_items = ItemRecords(("reward", "accuracy"))

    def format_prompts(self, prompts: Sequence[str]) -> list[str]:
        """The policy's inputs: chat-rendered (with the system prompt) or the prompts as they are."""
        hp = self.hparams
        return [self.players.chat(hp.system_prompt, x) for x in prompts] if hp.chat_template else list(prompts)

    def rewards(
        self, inputs: Sequence[str], completions: Sequence[str], references: Sequence[str | None], group_size: int = 1
    ) -> Tensor:
        """Per-reward scores ``[N, K]`` (reward models, then the answer reward) of rows in groups of ``group_size``."""
        cols = []
        if self.reward_models is not None:
            texts = [x + y for x, y in zip(inputs, completions)]
            cols.append(self.reward_models(texts, group_size=group_size).to(self.device))
        if self.hparams.answer_reward:
            cols.append(answer_rewards(completions, references).to(self.device).unsqueeze(1))
        return torch.cat(cols, dim=1)

    def _policy_loss(
        self, rollout: Rollout, advantages: Tensor, ref: Tensor | None, old: Tensor | None, groups: Tensor | None = None
    ) -> dict[str, Tensor] | None:
        """Forward and backward of ``groups`` (default: all; others count 0) by micro-batch; ``None``: not finite."""
        if self.pairwise is not None:
            return self._pairwise_loss(rollout, advantages)
        pg = self.policy_gradient
        total, g = rollout.sequences.shape[0], rollout.group_size

        def select(rows: Tensor) -> tuple[Rollout, Tensor, Tensor | None, Tensor | None]:
            return rollout.rows(rows, g), advantages[rows], *(None if t is None else t[rows] for t in (ref, old))

        if groups is not None and len(groups) < total // g:
            rollout, advantages, ref, old = select(_group_rows(groups, g, advantages.device))

        def chunks() -> list[tuple[int, int]]:
            spans, lengths = row_lengths(rollout.attention_mask, rollout.prompt_width, rollout.completion_mask)
            return micro_batches(spans, lengths, pg.max_tokens_per_micro_batch, pg.micro_batch, g)

        bounds = chunks()
        if len(bounds) > 1:
            # groups by their longest completion: each chunk then runs to its own longest reply, not the batch's
            rollout, advantages, ref, old = select(_groups_by_length(rollout.completion_mask, g))
            bounds = chunks()

        def loss_of(start: int, stop: int) -> tuple[Tensor, dict[str, Tensor]]:
            part = rollout.rows(slice(start, stop))
            lp = self.players.token_logprobs(PLAYER, part, self.sampling.temperature)
            old_ref = (None if t is None else t[start:stop] for t in (old, ref))
            return pg.loss(
                lp, part.completion_mask.to(lp.dtype), advantages[start:stop], *old_ref, part.sample_logprobs
            )

        return self.accumulate(bounds, loss_of, total_rows=total)

    def _pairwise_loss(self, rollout: Rollout, advantages: Tensor) -> dict[str, Tensor] | None:
        """Forward and backward of :attr:`pairwise` on each group's best and worst reply (all tied: one at weight 0)."""
        grouped = advantages.view(-1, rollout.group_size)
        first = torch.arange(grouped.shape[0], device=grouped.device) * rollout.group_size
        pairs = torch.stack([first + grouped.argmax(dim=1), first + grouped.argmin(dim=1)], dim=1)
        untied = grouped.amax(dim=1) > grouped.amin(dim=1)
        weight = float(untied.any())
        both = rollout.rows((pairs[untied] if weight else pairs[:1]).flatten(), 2)  # chosen 2i, rejected 2i + 1
        lengths = both.completion_mask.sum(dim=1).view(-1, 2)  # each counts its EOS
        pg, ref = self.policy_gradient, None
        if self.pairwise.uses_reference:
            with torch.no_grad():  # at temperature 1: the loss compares the policy itself with the reference
                ref = self.players.logprobs(None, both, 1.0, pg.logprob_micro_batch).view(-1, 2)

        def loss_of(start: int, stop: int) -> tuple[Tensor, dict[str, Tensor]]:
            a, b = start // 2, stop // 2
            lp = self.players.logprobs(PLAYER, both.rows(slice(start, stop)), 1.0).view(-1, 2)
            refs = None if ref is None else (ref[a:b, 0], ref[a:b, 1])
            loss, chosen, rejected = self.pairwise(lp[:, 0], lp[:, 1], refs, (lengths[a:b, 0], lengths[a:b, 1]))
            stats = {"pair_margin": (chosen - rejected).mean(), "pair_accuracy": (chosen > rejected).float().mean()}
            return weight * loss.mean(), {k: weight * v for k, v in stats.items()}  # of the implicit rewards

        spans, counts = row_lengths(both.attention_mask, both.prompt_width, both.completion_mask)
        chunks = micro_batches(spans, counts, pg.max_tokens_per_micro_batch, pg.micro_batch, 2)
        return self.accumulate(chunks, loss_of, total_rows=len(counts))

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        pg = self.policy_gradient
        prompts, refs = list(batch["prompt"]), list(batch["reference"])
        b, g = len(prompts), pg.group_size
        inputs = self.format_prompts(prompts)
        with self._timed("generate"):
            roll = self.players.generate(PLAYER, inputs, g, self.sampling)
        with self._timed("score"):
            per_reward = self.rewards(
                [x for x in inputs for _ in range(g)], roll.texts, [r for r in refs for _ in range(g)], group_size=g
            )
            reward = (per_reward * self.reward_weight).sum(dim=1)
        if not self.check_finite(reward, "rewards"):  # same decision on every rank: nobody steps
            return
        advantages, groups = pg.advantages(reward), self._groups_to_run(reward.view(b, g))
        self.board.add_values(self, {"train/reward_hist": reward, "train/advantage_hist": advantages})
        ref, old = self._frozen_logprobs(roll)
        for _ in range(pg.updates_per_batch):
            step = self.update(lambda: self._policy_loss(roll, advantages, ref, old, groups), self.optimizers())
            if step is None:
                return
        self.log_phase_times(b, step_total=True, generated_tokens=float(roll.completion_mask.sum()))
        self._log_step(step[0], reward, per_reward, roll)

    def _groups_to_run(self, grouped: Tensor) -> Tensor | None:
        """With ``skip_uniform_groups`` (one process, a baseline, no KL): the groups whose rewards differ; else all."""
        pg = self.policy_gradient
        if not (self.hparams.skip_uniform_groups and pg.baseline and pg.kl_coef == 0 and self.trainer.world_size == 1):
            return None
        informative = (grouped != grouped[:, :1]).any(dim=1)
        # at least one group, so the optimizer still steps on a (zero) gradient as it would without the skip
        return informative.nonzero().flatten() if informative.any() else torch.zeros(1, dtype=torch.long)

    def _frozen_logprobs(self, roll: Rollout) -> tuple[Tensor | None, Tensor | None]:
        """The reference's token log-probs (with a KL term) and the sampling policy's (with μ > 1 updates)."""
        pg, ref, old = self.policy_gradient, None, None
        budget = (self.sampling.temperature, pg.logprob_micro_batch, pg.max_tokens_per_micro_batch)
        with torch.no_grad():
            if pg.kl_coef > 0:
                with self._timed("ref_logprobs"):
                    ref = self.players.token_logprobs(None, roll, *budget)
            if pg.updates_per_batch > 1:
                with self._timed("old_logprobs"):
                    old = self.players.token_logprobs(PLAYER, roll, *budget)
        return ref, old

    def _log_step(self, out: dict[str, Tensor], reward: Tensor, per_reward: Tensor, roll: Rollout) -> None:
        """The update's stats (loss, kl, ... or pair_margin, ...), the rewards (each source's too), the completions."""
        grouped = reward.view(-1, self.policy_gradient.group_size)
        logs = {
            **{f"train/{k}": v for k, v in out.items() if k != "logprob_gap"},
            "train/reward": reward.mean(),
            "train/reward_std": grouped.std(dim=1).mean(),
            "train/informative_groups": (grouped != grouped[:, :1]).any(dim=1).float().mean(),
            "train/completion_tokens": roll.completion_mask.sum(1).float().mean(),
            "train/empty_completions": float(roll.num_empty),
        }
        if "logprob_gap" in out:  # an engine sampled the rollout (lm.decode: vllm)
            logs["rollout/logprob_gap"] = out["logprob_gap"]
        names = [f"rm{i}" for i in range(len(self.reward_models or []))] + ["answer"] * self.hparams.answer_reward
        logs.update({f"train/reward_{n}": per_reward[:, i].mean() for i, n in enumerate(names)})
        self.log_dict(logs, batch_size=grouped.shape[0])

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        # trainable = the adapter (or the policy copy); selected by requires_grad, which survives FSDP flattening
        params = [p for p in self.players.parameters() if p.requires_grad]
        return self.make_optimizer(params, hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.adam_betas))

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Greedy reply per held-out prompt: its reward and, with a reference, its accuracy (each prompt once)."""
        hp = self.hparams
        prompts, refs = list(batch["prompt"]), list(batch["reference"])
        index = self.item_ids(batch, len(prompts))
        inputs = self.format_prompts(prompts)
        tokens = hp.eval_max_new_tokens or self.sampling.max_new_tokens
        roll = self.players.generate(PLAYER, inputs, 1, Sampling(max_new_tokens=tokens), greedy=True)
        per_reward = self.rewards(inputs, roll.texts, refs)
        reward = (per_reward * self.reward_weight).sum(dim=1)
        accuracy = torch.full((len(prompts),), float("nan"), device=self.device)
        if all(r is not None for r in refs):
            accuracy = answer_rewards(roll.texts, refs).to(self.device, torch.float32)
        self.eval_items.update(index, reward=reward.to(self.device), accuracy=accuracy)
        if not self.trainer.testing and self.board.wants_samples(self, "val/generations"):
            rows = zip(prompts, refs, roll.texts, reward.tolist())
            keys = ("prompt", "reference", "reply", "reward")
            self.board.add_samples(self, "val/generations", (dict(zip(keys, row)) for row in rows))

    @override
    def on_validation_epoch_end(self) -> None:
        """``val/reward`` and ``val/accuracy`` (over the prompts with a reference) of every prompt once."""
        _, values = self.eval_items.compute(self.device)
        self.eval_items.reset()
        if values["reward"].numel() == 0:
            return
        logs = {"val/reward": values["reward"].mean()}
        answered = values["accuracy"][~values["accuracy"].isnan()]
        if answered.numel():
            logs["val/accuracy"] = answered.mean()
        self.log_dict(logs, sync_dist=True)

    test_step = validation_step
    on_test_epoch_end = on_validation_epoch_end


def _group_rows(groups: Tensor, g: int, device: torch.device) -> Tensor:
    """The rows of ``groups`` of ``g`` rows each, in their order."""
    return (groups.cpu()[:, None] * g + torch.arange(g)).reshape(-1).to(device)


def _groups_by_length(completion_mask: Tensor, g: int) -> Tensor:
    """Row order that keeps groups of ``g`` whole and sorts them by their longest completion (stable)."""
    longest = completion_mask.sum(dim=1).view(-1, g).amax(dim=1)
    return _group_rows(torch.sort(longest.cpu(), stable=True).indices, g, completion_mask.device)
