"""The followers' updates of the multi-LLM pool (:class:`modules.pool.StackelbergPool`): DPO or GRPO per member.

Every rank forms the same batches (the iteration's texts and scores are gathered first) and computes a contiguous
share of each; the gradients of one follower's adapter are summed over the ranks by
:func:`~modules.distributed.collectives.sum_gradients` (DDP's own reducer expects every adapter's gradient from one
backward per forward, which a step that trains one of several adapters from unequal shares cannot give).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from alignment_games.modules.algorithms import pool as rules
from alignment_games.modules.algorithms.rl_losses import PolicyGradient, dpo_loss, length_normalized_nll
from alignment_games.modules.distributed import collectives
from alignment_games.modules.lm.micro_batches import micro_batches, row_lengths
from alignment_games.modules.lm.rollout import Rollout

__all__ = ["FollowerTraining", "FollowerUpdates"]


@dataclass(frozen=True)
class FollowerTraining:
    """Phase 7 of the pool: how each follower learns from the iteration's duels (one AdamW per follower).

    Attributes:
        algorithm: ``"dpo"`` (on the non-tied duels) or ``"grpo"`` (on the peer scores of its rollouts).
        lr: Learning rate of every follower (paper: 1e-6).
        batch_size: Effective batch of an update (pairs for DPO, rollouts for GRPO; paper: 16).
        micro_batch: Sequences per DPO forward inside a batch (0: the whole batch); gradients are accumulated.
        dpo_beta: β of DPO.
        dpo_pairs: ``"all"`` (every follower learns from every non-tied pair) or ``"own"`` (from its own duels).
        dpo_nll_weight: α of RPO's length-normalised NLL of the chosen response added to DPO
            (:func:`~modules.algorithms.rl_losses.length_normalized_nll`; 0: plain DPO, the paper's).
        policy_gradient: The GRPO update (:class:`PolicyGradient`): ``group_size`` G is the rollouts per combatant
            and duel (paper: 4), ``kl_coef`` > 0 uses the disabled adapter as reference (paper: 0); each of the
            ``updates_per_batch`` steps takes one batch of ``batch_size`` rollouts.

    Raises:
        ValueError: naming a field out of range.
    """

    algorithm: str = "dpo"
    lr: float = 1e-6
    batch_size: int = 16
    micro_batch: int = 0
    dpo_beta: float = 0.1
    dpo_pairs: str = "all"
    dpo_nll_weight: float = 0.0
    policy_gradient: PolicyGradient = PolicyGradient()

    def __post_init__(self) -> None:
        if isinstance(self.policy_gradient, dict):  # as a checkpoint's hparams hold it
            known = {f.name for f in dataclasses.fields(PolicyGradient)}
            if unknown := sorted(set(self.policy_gradient) - known):
                raise ValueError(f"followers.policy_gradient: unknown field(s) {unknown}; known: {sorted(known)}")
            object.__setattr__(self, "policy_gradient", PolicyGradient(**self.policy_gradient))
        for field, allowed in (("algorithm", ("dpo", "grpo")), ("dpo_pairs", ("all", "own"))):
            if getattr(self, field) not in allowed:
                raise ValueError(f"followers.{field} must be one of {allowed}, got {getattr(self, field)!r}")
        if not self.lr > 0:
            raise ValueError(f"followers.lr must be positive, got {self.lr}")
        if self.batch_size < 1 or self.micro_batch < 0:
            raise ValueError(
                f"followers.batch_size must be positive and micro_batch >= 0, got {self.batch_size}, {self.micro_batch}"
            )
        if self.dpo_nll_weight < 0:
            raise ValueError(f"followers.dpo_nll_weight must be non-negative, got {self.dpo_nll_weight}")
        if not self.dpo_beta > 0:
            raise ValueError(f"followers.dpo_beta must be positive, got {self.dpo_beta}")


class FollowerUpdates:
    """Mixin of :class:`modules.pool.StackelbergPool`: phase 7, the followers' optimizer steps.

    It uses the pool's ``player_names``, ``bank``/``chat``/``encode``, ``counters`` and ``epoch_means``, its
    :class:`FollowerTraining` (``followers``), ``sampling`` and ``system_prompt``, and
    :class:`modules.base.LanguageModelGame`'s step machinery and TensorBoard ``board``. Each method returns the numbers
    to log.
    """

    def _train_dpo(self, questions, duels, texts, side_scores, iteration: int) -> dict[str, float]:
        """7. DPO steps of every follower on the non-tied duels (all of them, or its own with ``dpo_pairs="own"``)."""
        pairs = rules.preference_pairs([a for a, _ in side_scores], [b for _, b in side_scores])
        if not pairs:
            self.counters["iterations_without_pairs"] += 1
            warnings.warn(f"iteration {iteration}: every duel tied; no DPO pair, followers not updated", stacklevel=3)
        stats: dict[str, float] = {"duel/pairs": float(len(pairs))}
        for (pi, p), opt in zip(enumerate(self.player_names), self._optimizer_list()):
            mine = pairs if self.followers.dpo_pairs == "all" else [(d, w) for d, w in pairs if pi in duels[d]]
            if mine:
                stats.update(self._dpo_follower(p, opt, mine, questions, texts))
        return stats

    def _dpo_follower(self, p: str, opt: Any, pairs: list[tuple[int, bool]], questions, texts) -> dict[str, float]:
        """Follower ``p``'s DPO steps on ``pairs`` in batches; each rank computes a contiguous share of each batch."""
        hp = self.followers
        owned = collectives.shared_rows(self._trainer, len(pairs), hp.batch_size)
        local = [x for x, mine in zip(pairs, owned) if mine]
        both, ref = self._dpo_rows(p, local, questions, texts) if local else (None, None)
        acc, margin = [], []
        loss_fn = partial(self._dpo_rows_loss, p, both, ref, acc, margin)
        micro = max(1, hp.micro_batch // 2) if hp.micro_batch else 0  # pairs: two sequences each
        losses = self._steps(p, opt, loss_fn, collectives.local_batches(owned, hp.batch_size), micro)
        acc, margin = (sum(part, []) for part in zip(*collectives.gather_objects(self._trainer, (acc, margin))))
        stats = {f"follower/steps/{p}": float(len(losses))}
        if losses:
            # The first batch has margin 0 by construction (policy = reference), so with one batch per iteration the
            # loss always reads ln 2; the margin after the updates, on the same pairs, shows what was learned.
            after = []
            if local:
                with torch.no_grad():
                    lp = self.bank(p).logprobs(p, both, 1.0, hp.micro_batch).view(-1, 2)
                _, cr, rr = dpo_loss(lp[:, 0], lp[:, 1], ref[:, 0], ref[:, 1], hp.dpo_beta)
                after = (cr - rr).tolist()
            after = sum(collectives.gather_objects(self._trainer, after), [])
            stats[f"follower/dpo_loss/{p}"] = sum(losses) / len(losses)
            stats[f"follower/reward_accuracy/{p}"] = sum(acc) / len(acc)
            stats[f"follower/reward_margin/{p}"] = sum(margin) / len(margin)
            stats[f"follower/margin_after/{p}"] = sum(after) / len(after)
            stats[f"follower/accuracy_after/{p}"] = sum(x > 0 for x in after) / len(after)
        return stats

    def _dpo_rows(self, p: str, pairs: list[tuple[int, bool]], questions, texts) -> tuple[Rollout, Tensor]:
        """Pair ``i`` as rows ``2i`` (chosen) and ``2i + 1`` (rejected), its prompt run once, and its reference.

        The reference log-probabilities ``[pairs, 2]`` are this follower's as it starts the iteration.
        """
        prompts = [self.chat(p, questions[d], self.hparams.system_prompt) for d, _ in pairs]
        rows = [texts[(d, side)][0] for d, a_wins in pairs for side in ((0, 1) if a_wins else (1, 0))]
        both = self.encode(p, [x for x in prompts for _ in (0, 1)], rows, group_size=2)
        with torch.no_grad():
            ref = self.bank(p).logprobs(p, both, 1.0, self.followers.micro_batch).view(-1, 2)
        return both, ref

    def _dpo_rows_loss(self, p: str, both: Rollout, ref: Tensor, acc: list, margin: list, a: int, b: int) -> Tensor:
        """Summed DPO loss (and RPO's NLL term when weighted) of this rank's pairs ``a … b`` of ``p``."""
        rows = both.rows(slice(2 * a, 2 * b))
        lp = self.bank(p).logprobs(p, rows, 1.0).view(-1, 2)
        loss, cr, rr = dpo_loss(lp[:, 0], lp[:, 1], ref[a:b, 0], ref[a:b, 1], self.followers.dpo_beta)
        acc.extend((cr > rr).float().tolist())
        margin.extend((cr - rr).tolist())
        if self.followers.dpo_nll_weight:
            lengths = rows.completion_mask.sum(dim=1).view(-1, 2)[:, 0]
            loss = loss + self.followers.dpo_nll_weight * length_normalized_nll(lp[:, 0], lengths)
        return loss.sum()

    def _train_grpo(self, rollouts: dict, rollout_scores: dict, duels: list[tuple[int, int]]) -> dict[str, float]:
        """7. GRPO steps of every combatant on batches of its rollouts in duel order (all ranks' rollouts)."""
        stats: dict[str, float] = {}
        for (pi, p), opt in zip(enumerate(self.player_names), self._optimizer_list()):
            slots = [(d, s) for d, duel in enumerate(duels) for s in (0, 1) if duel[s] == pi]
            if slots:
                stats.update(self._grpo_follower(p, opt, slots, *rollouts.get(p, (None, [])), rollout_scores))
        return stats

    def _grpo_follower(self, p: str, opt: Any, slots: list, out: Rollout | None, own: list, rollout_scores: dict):
        """Follower ``p``'s GRPO steps over its ``slots`` (every rank's); this rank holds the rollouts of ``own``.

        A batch's rows owned by this rank are a contiguous run of its rollout (both orders follow the duels).
        """
        pg = self.followers.policy_gradient
        old = ref = adv = None
        if own:
            rewards = torch.tensor([x for slot in own for x in rollout_scores[slot]], dtype=torch.float32)
            adv = rules.peer_score_advantages(rewards, pg.group_size, pg.scale_advantages).to(self.device)
            self.board.add_values(self, {"follower/reward_hist": rewards, "follower/advantage_hist": adv})
            budget = pg.max_tokens_per_micro_batch
            with torch.no_grad():  # the sampling policy, for the clipped ratio of later mini-batches
                old = self.bank(p).token_logprobs(p, out, self.sampling.temperature, pg.logprob_micro_batch, budget)
                if pg.kl_coef > 0:
                    ref = self.bank(p).token_logprobs(
                        None, out, self.sampling.temperature, pg.logprob_micro_batch, budget
                    )
        owned = [collectives.owns(self._trainer, d) for d, _ in slots for _ in range(pg.group_size)]  # as `out`
        clipped: list[float] = []
        loss_fn = partial(self._grpo_rows_loss, p, out, adv, old, ref, clipped)
        batches = collectives.local_batches(owned, self.followers.batch_size)
        batches = [batch for batch in batches for _ in range(pg.updates_per_batch)]  # μ steps on each batch
        lengths = row_lengths(out.attention_mask, out.prompt_width, out.completion_mask) if own else None
        losses = self._steps(p, opt, loss_fn, batches, pg.micro_batch, lengths, pg.max_tokens_per_micro_batch)
        clipped = sum(collectives.gather_objects(self._trainer, clipped), [])
        everyone = [x for slot in slots for x in rollout_scores[slot]]
        stats = {f"follower/reward/{p}": sum(everyone) / len(everyone)}
        if losses:
            stats[f"follower/grpo_loss/{p}"] = sum(losses) / len(losses)
            if clipped:
                stats[f"follower/clip_fraction/{p}"] = sum(clipped) / len(clipped)
        return stats

    def _grpo_rows_loss(self, p: str, out: Rollout, adv: Tensor, old: Tensor, ref: Tensor | None, clipped: list, a, b):
        """GRPO loss of rollouts ``a … b`` of ``p``, times their number (a sum over rows)."""
        rows = slice(a, b)
        sub = out.rows(rows)
        lp = self.bank(p).token_logprobs(p, sub, self.sampling.temperature)
        mask, ref_rows = sub.completion_mask.to(lp.dtype), None if ref is None else ref[rows]
        loss, st = self.followers.policy_gradient.loss(lp, mask, adv[rows], old[rows], ref_rows)
        clipped.append(float(st["clip_fraction"]))
        return loss * (b - a)

    def _steps(
        self,
        p: str,
        opt: Any,
        loss_fn: Any,
        batches: list,
        micro: int | None = None,
        lengths: tuple[list[int], list[int]] | None = None,
        max_tokens: int = 0,
    ) -> list[float]:
        """Follower ``p``'s optimizer steps, one per batch ``(global size, this rank's rows)``; the finite losses."""
        totals = [self._step(p, opt, loss_fn, n, rows, micro, lengths, max_tokens) for n, rows in batches]
        return [t for t in totals if t is not None]

    def _step(
        self,
        player: str,
        opt: Any,
        loss_fn: Any,
        n: int,
        rows: tuple[int, int],
        micro: int | None,
        lengths: tuple[list[int], list[int]] | None = None,
        max_tokens: int = 0,
    ) -> float | None:
        """One optimizer step of ``player`` on a batch of ``n`` items; ``loss_fn(lo, hi)`` gives their summed loss.

        This rank computes its items ``rows`` in chunks (:func:`~modules.lm.micro_batches.micro_batches`) of at most
        ``micro`` items (default ``micro_batch``; 0: all) and, given the items' ``(prompt spans, completion lengths)``,
        ``max_tokens`` padded tokens, each chunk's loss divided by the global ``n``; the gradients of every rank's
        share are summed over this player's adapter alone. Not the base's ``accumulate``: DDP's reducer, which it
        relies on, expects every adapter's gradient from one backward per forward, and the ranks' shares differ in
        size. Returns the loss, or ``None`` when it was not finite on some rank (the step is skipped and counted).
        """
        a0, b0 = rows
        spans, counts = lengths or ([0] * b0, [0] * b0)
        micro = self.followers.micro_batch if micro is None else micro
        chunks = micro_batches(spans[a0:b0], counts[a0:b0], max_tokens if lengths else 0, micro)
        opt.zero_grad()
        total, finite = 0.0, True
        with self.gradient_sync(last=False):
            for lo, hi in chunks:
                loss = loss_fn(a0 + lo, a0 + hi) / n
                if not bool(torch.isfinite(loss.detach()).all()):
                    finite = False
                    break
                self.manual_backward(loss)
                total += float(loss.detach())
        params = self.bank(player).player_parameters(player)
        total, finite = collectives.sum_gradients(self._trainer, params, total, finite)
        # counts, warns, logs; raises after max_consecutive_nonfinite skips in a row; a good step ends a streak
        if not self.check_finite(torch.tensor(total if finite else float("nan")), f"losses of follower {player}"):
            opt.zero_grad()
            return None
        self.optimizer_step(opt, params)
        self.epoch_means["follower_loss"].update(total)
        return total
