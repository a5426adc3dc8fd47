"""The followers' updates of the pool (:class:`~alignment_games.modules.pool.StackelbergPool`): DPO or GRPO each.

Every rank forms the same batches and computes a contiguous share of each; a follower's adapter gradients are summed
over the ranks by hand (DDP's reducer expects every adapter's gradient from each backward).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
from torch import Tensor
from torchmetrics.aggregation import MeanMetric

from alignment_games.modules.algorithms import pool as rules
from alignment_games.modules.algorithms.checks import require_at_least, require_positive
from alignment_games.modules.algorithms.rl_losses import PairwiseLoss, PolicyGradient
from alignment_games.modules.distributed import collectives
from alignment_games.modules.lm.micro_batches import micro_batches, row_lengths
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.rollout import Rollout
from alignment_games.modules.scorers.peer_judges import encode_texts


@dataclass(frozen=True)
class FollowerTraining:
    """Phase 7 of the pool: how each follower learns from the iteration's duels (one optimizer per follower).

    Attributes:
        algorithm: ``"dpo"`` (on the non-tied duels) or ``"grpo"`` (on the peer scores of its rollouts).
        lr: Learning rate of every follower (paper: 1e-6).
        batch_size: Effective batch of an update (pairs for DPO, rollouts for GRPO; paper: 16).
        micro_batch: Sequences per DPO forward inside a batch (0: the whole batch); gradients are accumulated.
        dpo_pairs: ``"all"`` (every follower learns from every non-tied pair) or ``"own"`` (from its own duels).
        pairwise: The loss on the non-tied duels (:class:`PairwiseLoss`: DPO, IPO, RPO or SimPO, and its β, γ, α).
        policy_gradient: The GRPO update (:class:`PolicyGradient`; ``group_size``: rollouts per combatant and duel).

    Raises:
        ValueError: naming a field out of range.
    """

    algorithm: str = "dpo"
    lr: float = 1e-6
    batch_size: int = 16
    micro_batch: int = 0
    dpo_pairs: str = "all"
    pairwise: PairwiseLoss = PairwiseLoss()
    policy_gradient: PolicyGradient = PolicyGradient()

    def __post_init__(self) -> None:
        for name, group in (("pairwise", PairwiseLoss), ("policy_gradient", PolicyGradient)):
            if isinstance(fields := getattr(self, name), dict):  # as a checkpoint's hparams hold it
                known = {f.name for f in dataclasses.fields(group)}
                if unknown := sorted(set(fields) - known):
                    raise ValueError(f"followers.{name}: unknown field(s) {unknown}; known: {sorted(known)}")
                object.__setattr__(self, name, group(**fields))
        for field, allowed in (("algorithm", ("dpo", "grpo")), ("dpo_pairs", ("all", "own"))):
            if getattr(self, field) not in allowed:
                raise ValueError(f"followers.{field} must be one of {allowed}, got {getattr(self, field)!r}")
        require_positive(**{"followers.lr": self.lr})
        least = {"batch_size": 1, "micro_batch": 0}
        require_at_least(**{f"followers.{k}": (getattr(self, k), m) for k, m in least.items()})


class Stepper(Protocol):
    """The step machinery of :class:`alignment_games.modules.base.LanguageModelGame` that the followers' updates use."""

    device: torch.device
    board: Any
    update: Callable[..., tuple[dict[str, Any], list[Tensor]] | None]
    accumulate: Callable[..., dict[str, Any] | None]


@dataclass(eq=False)
class FollowerUpdates:
    """Phase 7 of :class:`~alignment_games.modules.pool.StackelbergPool`: the followers' optimizer steps and logs.

    Attributes:
        bank: The :class:`~alignment_games.modules.lm.policy_bank.PolicyBank` holding a player, by name.
        host: The step machinery (:class:`Stepper`): the module that owns this.
        loss_mean: The epoch mean that every applied step's loss updates.
    """

    settings: FollowerTraining
    bank: Callable[[str], PolicyBank]
    host: Stepper
    loss_mean: MeanMetric
    system_prompt: str
    temperature: float

    def dpo(self, trainer, optimizers: dict, questions, duels, texts, side_scores, iteration: int) -> dict[str, float]:
        """7. DPO steps of every follower on the non-tied duels (all of them, or its own with ``dpo_pairs="own"``)."""
        pairs = rules.preference_pairs([a for a, _ in side_scores], [b for _, b in side_scores])
        if not pairs:
            warnings.warn(f"iteration {iteration}: every duel tied; no DPO pair, followers not updated", stacklevel=3)
        stats: dict[str, float] = {"duel/pairs": float(len(pairs))}
        for pi, (p, opt) in enumerate(optimizers.items()):
            mine = pairs if self.settings.dpo_pairs == "all" else [(d, w) for d, w in pairs if pi in duels[d]]
            if mine:
                stats.update(self._dpo_follower(trainer, p, opt, mine, questions, texts))
        return stats

    def _dpo_follower(self, trainer, p: str, opt, pairs: list[tuple[int, bool]], questions, texts) -> dict[str, float]:
        """Follower ``p``'s DPO steps on ``pairs`` in batches; each rank computes a contiguous share of each batch."""
        hp = self.settings
        owned = collectives.shared_rows(trainer, len(pairs), hp.batch_size)
        local = [x for x, mine in zip(pairs, owned) if mine]
        both, ref = self._dpo_rows(p, local, questions, texts) if local else (None, None)
        acc, margin = [], []
        loss_fn = partial(self._dpo_rows_loss, p, both, ref, acc, margin)
        micro = max(1, hp.micro_batch // 2) if hp.micro_batch else 0  # pairs: two sequences each
        batches = collectives.local_batches(owned, hp.batch_size)
        steps = (self._step(trainer, p, opt, loss_fn, n, rows, micro) for n, rows in batches)
        losses = [t for t in steps if t is not None]
        acc, margin = (sum(part, []) for part in zip(*collectives.gather_objects(trainer, (acc, margin))))
        stats = {f"follower/steps/{p}": float(len(losses))}
        if losses:
            # DPO's first loss is ln 2 (policy = reference); the margin after the updates shows what was learned
            after = []
            if local:
                with torch.no_grad():
                    lp = self.bank(p).logprobs(p, both, 1.0, hp.micro_batch).view(-1, 2)
                _, cr, rr = self._pair_loss(lp, ref, both)
                after = (cr - rr).tolist()
            after = sum(collectives.gather_objects(trainer, after), [])
            stats[f"follower/dpo_loss/{p}"] = sum(losses) / len(losses)
            stats[f"follower/reward_accuracy/{p}"] = sum(acc) / len(acc)
            stats[f"follower/reward_margin/{p}"] = sum(margin) / len(margin)
            stats[f"follower/margin_after/{p}"] = sum(after) / len(after)
            stats[f"follower/accuracy_after/{p}"] = sum(x > 0 for x in after) / len(after)
        return stats

    def _dpo_rows(self, p: str, pairs: list[tuple[int, bool]], questions, texts) -> tuple[Rollout, Tensor | None]:
        """Pair ``i`` as rows ``2i`` (chosen) and ``2i + 1`` (rejected); ``p``'s reference ``[pairs, 2]`` if used."""
        bank = self.bank(p)
        prompts = [bank.chat(self.system_prompt, questions[d]) for d, _ in pairs]
        rows = [texts[(d, side)][0] for d, a_wins in pairs for side in ((0, 1) if a_wins else (1, 0))]
        both = encode_texts(bank, [x for x in prompts for _ in (0, 1)], rows, group_size=2)
        if not self.settings.pairwise.uses_reference:
            return both, None
        with torch.no_grad():
            return both, bank.logprobs(p, both, 1.0, self.settings.micro_batch).view(-1, 2)

    def _dpo_rows_loss(self, p: str, both: Rollout, ref, acc: list, margin: list, a: int, b: int) -> Tensor:
        """Summed pairwise loss of this rank's pairs ``a … b`` of ``p``."""
        rows = both.rows(slice(2 * a, 2 * b))
        loss, cr, rr = self._pair_loss(self.bank(p).logprobs(p, rows, 1.0).view(-1, 2), ref, rows, slice(a, b))
        acc.extend((cr > rr).float().tolist())
        margin.extend((cr - rr).tolist())
        return loss.sum()

    def _pair_loss(self, lp: Tensor, ref: Tensor | None, rows: Rollout, pairs=slice(None)) -> tuple[Tensor, ...]:
        """:class:`PairwiseLoss` of the pairs' log-probs ``lp`` ``[n, 2]`` (the reference's: ``ref[pairs]``)."""
        lengths = rows.completion_mask.sum(dim=1).view(-1, 2)
        ref = None if ref is None else (ref[pairs, 0], ref[pairs, 1])
        return self.settings.pairwise(lp[:, 0], lp[:, 1], ref, (lengths[:, 0], lengths[:, 1]))

    def grpo(self, trainer, optimizers: dict, rollouts: dict, rollout_scores: dict, duels: list) -> dict[str, float]:
        """7. GRPO steps of every combatant on batches of its rollouts in duel order (all ranks' rollouts)."""
        stats: dict[str, float] = {}
        gaps: list[float] = []  # every loss's engine log-prob gap, when an engine sampled (lm.decode: vllm)
        for pi, (p, opt) in enumerate(optimizers.items()):
            slots = [(d, s) for d, duel in enumerate(duels) for s in (0, 1) if duel[s] == pi]
            if slots:
                out, own = rollouts.get(p, (None, []))
                stats.update(self._grpo_follower(trainer, p, opt, slots, out, own, rollout_scores, gaps))
        if gaps:
            stats["rollout/logprob_gap"] = sum(gaps) / len(gaps)
        return stats

    def _grpo_follower(
        self, trainer, p: str, opt, slots: list, out: Rollout | None, own: list, rollout_scores: dict, gaps: list
    ) -> dict[str, float]:
        """Follower ``p``'s GRPO steps over its ``slots`` (this rank holds ``own``'s); loss gaps to ``gaps``."""
        pg, temperature = self.settings.policy_gradient, self.temperature
        old = ref = adv = None
        if own:
            rewards = torch.tensor([x for slot in own for x in rollout_scores[slot]], dtype=torch.float32)
            adv = rules.peer_score_advantages(rewards, pg.group_size, pg.scale_advantages, pg.baseline)
            adv = adv.to(self.host.device)
            self.host.board.add_values(self.host, {"follower/reward_hist": rewards, "follower/advantage_hist": adv})
            budget = pg.max_tokens_per_micro_batch
            with torch.no_grad():  # the sampling policy, for the clipped ratio of later mini-batches
                old = self.bank(p).token_logprobs(p, out, temperature, pg.logprob_micro_batch, budget)
                if pg.kl_coef > 0:
                    ref = self.bank(p).token_logprobs(None, out, temperature, pg.logprob_micro_batch, budget)
        owned = [collectives.owns(trainer, d) for d, _ in slots for _ in range(pg.group_size)]  # as `out`
        per_loss: dict[str, list[float]] = {"clip_fraction": [], "logprob_gap": []}
        loss_fn = partial(self._grpo_rows_loss, p, out, adv, old, ref, per_loss)
        batches = collectives.local_batches(owned, self.settings.batch_size)
        batches = [batch for batch in batches for _ in range(pg.updates_per_batch)]  # μ steps on each batch
        lengths = row_lengths(out.attention_mask, out.prompt_width, out.completion_mask) if own else None
        budget = (pg.micro_batch, lengths, pg.max_tokens_per_micro_batch)
        steps = (self._step(trainer, p, opt, loss_fn, n, rows, *budget) for n, rows in batches)
        losses = [t for t in steps if t is not None]
        parts = collectives.gather_objects(trainer, per_loss)
        clipped, gap = ([x for part in parts for x in part[key]] for key in per_loss)
        gaps.extend(gap)
        everyone = [x for slot in slots for x in rollout_scores[slot]]
        stats = {f"follower/reward/{p}": sum(everyone) / len(everyone)}
        if losses:
            stats[f"follower/grpo_loss/{p}"] = sum(losses) / len(losses)
            if clipped:
                stats[f"follower/clip_fraction/{p}"] = sum(clipped) / len(clipped)
        return stats

    def _grpo_rows_loss(
        self, p: str, out: Rollout, adv: Tensor, old: Tensor, ref: Tensor | None, per_loss: dict, a: int, b: int
    ) -> Tensor:
        """GRPO loss of rollouts ``a … b`` of ``p``, times their number (a sum over rows); its stats to ``per_loss``."""
        sub = out.rows(slice(a, b))
        lp = self.bank(p).token_logprobs(p, sub, self.temperature)
        mask, ref_rows = sub.completion_mask.to(lp.dtype), None if ref is None else ref[a:b]
        # the sampling engine's log-probs go with the rows, for the gap and truncated importance sampling
        loss, st = self.settings.policy_gradient.loss(lp, mask, adv[a:b], old[a:b], ref_rows, sub.sample_logprobs)
        for key in per_loss.keys() & st.keys():
            per_loss[key].append(float(st[key]))
        return loss * (b - a)

    def _step(self, trainer, player: str, opt, loss_fn, n: int, rows: tuple, micro, lengths=None, max_tokens=0):
        """One step of ``player`` on ``n`` items (this rank: ``rows``, in chunks); its loss, or None if not taken."""
        (a0, b0), params = rows, self.bank(player).player_parameters(player)
        spans, counts = lengths or ([0] * b0, [0] * b0)
        micro = self.settings.micro_batch if micro is None else micro
        chunks = micro_batches(spans[a0:b0], counts[a0:b0], max_tokens if lengths else 0, micro)
        reduce = partial(collectives.sum_gradients, trainer, params)  # each rank's rows: the adapter's sum over ranks

        def loss_of(lo: int, hi: int) -> tuple[Tensor, dict[str, Tensor]]:
            return loss_fn(a0 + lo, a0 + hi) / n, {}

        backward = partial(self.host.accumulate, chunks, loss_of, reduce=reduce, what=f"losses of follower {player}")
        if (step := self.host.update(backward, opt, [params], timed=False)) is None:  # the pool times it as a whole
            return None
        self.loss_mean.update(step[0]["loss"])
        return step[0]["loss"]
