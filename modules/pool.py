"""Multi-LLM Stackelberg alignment (Hahn et al.): an EXP3 leader, a pool of followers that duel, judge and learn.

One training batch is one game iteration in seven phases, numbered so in the methods: 1. choose, 2. match, 3. answer,
4. judge, 5. aggregate, 6. lead, 7. follow (docs/pool.md). Evaluation: greedy answers' exact match, per model and mean.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torchmetrics.aggregation import MeanMetric
from typing_extensions import override

from alignment_games.callbacks import EloRating
from alignment_games.callbacks.items import ItemRecords
from alignment_games.modules.algorithms import pool as rules
from alignment_games.modules.algorithms.answers import answers_match
from alignment_games.modules.algorithms.checks import require_at_least, require_in_range
from alignment_games.modules.algorithms.exp3 import SCORE_MIN, CompositeReward, Exp3
from alignment_games.modules.base import LanguageModelGame
from alignment_games.modules.distributed import collectives
from alignment_games.modules.evaluation.audit import run_provenance
from alignment_games.modules.evaluation.pool_figures import make_pool_figures, write_pool_artifacts
from alignment_games.modules.games.pool_followers import FollowerTraining, FollowerUpdates
from alignment_games.modules.games.pool_members import PoolMembers
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.scorers.peer_judges import PeerJudging
from alignment_games.modules.training.faults import forget_earlier_step_values, reset_stale_epoch_metrics
from alignment_games.modules.training.schedules import schedule_length

# what a config may set of the pool's EloRating (the players are the pool's, and the module applies and logs it)
ELO_SETTINGS = {"initial_rating", "k_factor", "k_decay", "volatility_window", "scale"}


class StackelbergPool(PoolMembers, LanguageModelGame):
    """A pool of follower LMs trained by multi-LLM Stackelberg alignment (module docstring).

    The Elo ratings are the module's own (a trainer callback's epoch-end gather could hang DDP). Under DDP rank ``r``
    plays the duels ``d % world == r``, and texts and scores are gathered, so every rank updates alike.

    Args:
        lm: The base model and its LoRA adapters (:class:`ModelConfig`): ``num_players`` adapters over one base.
        num_players: m, the pool size with a shared base (≥ 3, or 1 for the self-rewarding baseline).
        models: Separate members (a name or path, or a dict of :class:`ModelConfig` fields over ``lm``); overrides m.
        elo: Settings of the pool's :class:`alignment_games.callbacks.EloRating` (``k_factor``, ``scale``, ...;
          ``None``: defaults).
        leader: ``"exp3"`` (Stackelberg) or ``"uniform"`` (SPARTA baseline).
        duels_per_iteration: D, duels drawn per iteration (paper: 64).
        num_iterations: Iterations the annealing schedules span (paper: 8; ``None``: the iterations the trainer plays).
        gamma: EXP3 exploration rate γ (also the probability floor γ/K).
        leader_reward: The leader's composite reward of a duel (:class:`CompositeReward`).
        matchmaking: Opponent matching by reputation (:class:`~alignment_games.modules.algorithms.pool.Matchmaking`).
        sampling: How responses are sampled (:class:`Sampling`; the paper's temperature 0.7 and top-p 0.9).
        system_prompt: System message of responses and evaluation answers.
        judging: How a member judges a response (:class:`PeerJudging`: template, mode, prefill, token budget).
        reputation: How Elo ratings weight the judges
          (:class:`~alignment_games.modules.algorithms.pool.ReputationWeighting`).
        followers: How each follower learns (:class:`FollowerTraining`: DPO or GRPO and its settings).
        eval_max_new_tokens: Tokens per evaluation answer (greedy).
        seed: Seed of the leader's and the matching's generator (saved in checkpoints).
        **game: :class:`~alignment_games.modules.base.LanguageModelGame`'s arguments, per follower (``train/duels``).
    """

    family = "multi-LLM pool"
    kept_state_prefixes = ("epoch_means.",)  # the per-epoch means' running sums (persistent metrics)

    def __init__(
        self,
        lm: ModelConfig,
        num_players: int = 3,
        models: list[str | dict[str, Any]] | None = None,
        elo: dict[str, Any] | None = None,
        leader: str = "exp3",
        duels_per_iteration: int = 64,
        num_iterations: int | None = None,
        gamma: float = 0.2,
        leader_reward: CompositeReward = CompositeReward(),
        matchmaking: rules.Matchmaking = rules.Matchmaking(),
        sampling: Sampling = Sampling(temperature=0.7, top_p=0.9, max_new_tokens=512),
        system_prompt: str = "You are a helpful assistant.",
        judging: PeerJudging = PeerJudging(),
        reputation: rules.ReputationWeighting = rules.ReputationWeighting(),
        followers: FollowerTraining = FollowerTraining(),
        eval_max_new_tokens: int = 256,
        seed: int = 0,
        **game: Any,
    ) -> None:
        super().__init__(**game)
        m = len(models) if models else num_players
        lm = ModelConfig.coerce(lm)
        groups = {"leader_reward": CompositeReward, "matchmaking": rules.Matchmaking, "sampling": Sampling}
        groups |= {"judging": PeerJudging, "reputation": rules.ReputationWeighting, "followers": FollowerTraining}
        self.save_arguments(lm, **groups)
        _check_settings(m, self.hparams)
        self.player_names = [f"m{i}" for i in range(m)]
        if models:
            fields = [{"name_or_path": x} if isinstance(x, str) else x for x in models]  # a name or path, or fields
            configs = [ModelConfig.coerce({**lm.as_dict(), **f}) for f in fields]
            self.banks = nn.ModuleList([PolicyBank(c, players=[p]) for c, p in zip(configs, self.player_names)])
            self._bank_of = {p: i for i, p in enumerate(self.player_names)}
        else:
            configs = [lm] * m
            self.banks = nn.ModuleList([PolicyBank(lm, players=self.player_names)])
            self._bank_of = dict.fromkeys(self.player_names, 0)
        self.model_names = [c.name_or_path for c in configs]
        self.elo = EloRating(self.player_names, **(elo or {})) if m > 1 else None
        self.leader_bandit: Exp3 | None = None
        self.generator = torch.Generator().manual_seed(seed)
        # each model's per-prompt correctness, gathered at the epoch's end with each prompt once across ranks
        self.eval_items = ItemRecords(tuple(self.player_names))
        # persistent, so a checkpoint taken mid-epoch carries the epoch's running sums
        self.epoch_means = nn.ModuleDict({k: MeanMetric() for k in ("leader_reward", "score_gap", "follower_loss")})
        for metric in self.epoch_means.values():
            metric.persistent(True)
        self.iteration = 0  # game iterations played (training batches)
        self.num_iterations = num_iterations  # None: the trainer's, fixed at train start (schedule_length)
        self.history: dict[str, list[Any]] = {"weights": [], "ratings": [], "selection": [], "rewards": []}
        self.counters = {"judgements": 0, "parse_failures": 0, "empty_responses": 0, "iterations_without_pairs": 0}
        self.judge_counts = {p: [0, 0] for p in self.player_names}  # judgements, failures
        self.categories: list[str | None] | None = None  # the instructions' categories, when the data have them
        args = (self.followers, self.bank, self, self.epoch_means["follower_loss"])
        self.follow = FollowerUpdates(*args, system_prompt, self.sampling.temperature)

    @override
    def policy_banks(self) -> dict[str, PolicyBank]:
        """Every bank by its state-dict prefix (``banks.<i>``)."""
        return {f"banks.{i}": bank for i, bank in enumerate(self.banks)}

    @override
    def setup(self, stage: str) -> None:
        collectives.check_replicated_strategy(self.trainer, self.family)  # before the base fits the banks to it
        super().setup(stage)
        if any(isinstance(c, EloRating) for c in self.trainer.callbacks):
            rank_zero_warn(
                "trainer.callbacks: the pool rates its own players (model.init_args.elo); the EloRating "
                "callback given to the trainer receives no duels"
            )

    @override
    def on_fit_start(self) -> None:
        """TensorBoard's custom-scalars tab: all Elo ratings in one chart."""
        if self.elo is not None:
            self.board.write_layout(self, self.elo.tensorboard_layout())

    @override
    def num_optimizers(self) -> int:
        return len(self.player_names)

    @override
    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.make_optimizer(self.bank(p).player_parameters(p), self.followers.lr) for p in self.player_names]

    @override
    def on_train_start(self) -> None:
        """Fix the annealing schedules' length (:func:`schedule_length`) once the epoch's batches are known."""
        super().on_train_start()
        self.num_iterations = schedule_length(
            self.hparams.num_iterations, self.trainer.max_epochs, self.trainer.num_training_batches
        )

    @override
    def on_train_epoch_start(self) -> None:
        reset_stale_epoch_metrics(self.trainer, self.epoch_means.values())

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # a follower that sits out this iteration logs nothing, rather than its last loss again (resumed or not)
        forget_earlier_step_values(self.trainer)
        super().on_train_batch_start(batch, batch_idx)

    def _ensure_leader(self, k: int) -> None:
        if self.leader_bandit is None:
            self.leader_bandit = Exp3(k, gamma=self.hparams.gamma)
        elif self.leader_bandit.num_arms != k:
            raise ValueError(
                f"the instruction pool has {k} instructions but the leader was built for "
                f"{self.leader_bandit.num_arms} (a checkpoint of another pool?)"
            )

    def leader_probabilities(self) -> Tensor:
        """The leader's current distribution over instructions (uniform for the SPARTA baseline)."""
        k = self.leader_bandit.num_arms
        if self.hparams.leader == "uniform":
            return torch.full((k,), 1.0 / k, dtype=torch.float64)
        return self.leader_bandit.probabilities()

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """One game iteration, phase by phase (module docstring); every rank plays it (class docstring)."""
        instructions = list(batch["prompt"])
        self.categories = list(batch["category"]) if "category" in batch else None
        self._ensure_leader(len(instructions))
        # the annealing schedules' position: iterations played before this one / (num_iterations - 1)
        progress, iteration = self.iteration / max(1, self.num_iterations - 1), self.iteration
        self.iteration += 1
        chosen = self._choose_instructions(len(instructions))
        duels, target_gap = self._match(progress, len(chosen))
        questions, judges = [instructions[i] for i in chosen], rules.duel_judges(duels, len(self.player_names))
        g = self.followers.policy_gradient.group_size if self.followers.algorithm == "grpo" else 1
        with self._timed("answer"):
            texts, rollouts = self._answer(duels, questions, g)
        with self._timed("judge"):
            refs = [batch.get("reference", [None] * len(instructions))[i] for i in chosen]
            scores = self._judge_duels(judges, questions, texts, g, iteration, refs)
        if scores is None:
            return
        side_scores, rollout_scores = self._aggregate(duels, judges, scores, g)
        self._log_reference_agreement(texts, rollout_scores, refs)
        rewards, probs = self._update_leader(chosen, side_scores, progress)
        self._show_duels(questions, duels, judges, texts, scores, side_scores, rewards)
        with self._timed("followers"):
            stats = self._follow(questions, duels, texts, side_scores, rollouts, rollout_scores, iteration)
        # here, where every rank is in step (in an epoch-end hook rank 0's progress bar runs collectives of its own)
        state = (collectives.trainable_checksum(self.banks), probs.tolist(), self.iteration)
        collectives.check_ranks_agree(self._trainer, state, f"{self.family}: adapters, leader or iteration")
        self._log_iteration(probs, rewards, side_scores, target_gap, stats)

    def _choose_instructions(self, k: int) -> list[int]:
        """1. D instruction indices drawn with replacement by the leader (uniformly for SPARTA)."""
        d = self.hparams.duels_per_iteration
        if self.hparams.leader == "uniform":
            return torch.randint(k, (d,), generator=self.generator).tolist()
        return self.leader_bandit.sample(d, self.generator).tolist()

    def _match(self, progress: float, num_duels: int) -> tuple[list[tuple[int, int]], float]:
        """2. The duels ``(a, b)`` by reputation-based soft matching, and the annealed target gap (ratings kept)."""
        names = self.player_names
        ratings = [self.elo.rating(p) for p in names] if self.elo is not None else [0.0] * len(names)
        if not self.history["weights"]:
            self.history["weights"].append(self.leader_probabilities().tolist())
        self.history["ratings"].append(list(ratings))
        gap = self.matchmaking.target_gap(progress)
        duels = self.matchmaking.duels(ratings, num_duels, gap, self.generator)
        if len(ratings) > 1:
            weights = self.matchmaking.selection_weights(ratings, gap)
            self.history["selection"].append(weights)
            self.log_dict({f"match/selection_weight/{p}": w for p, w in zip(self.player_names, weights)}, batch_size=1)
        return duels, gap

    def _answer(self, duels: list[tuple[int, int]], questions: list[str], g: int) -> tuple[dict, dict]:
        """3. Every duel's texts ``{(duel, side): [g texts]}``, this rank's ``{player: (rollout, slots)}``."""
        texts, rollouts = {}, {}
        mine = [d for d in range(len(duels)) if collectives.owns(self._trainer, d)]
        slots = {
            p: [(d, s) for d in mine for s in (0, 1) if duels[d][s] == pi] for pi, p in enumerate(self.player_names)
        }
        asked = {p: [questions[d] for d, _ in slots[p]] for p in self.player_names if slots[p]}
        for p, out in self.respond_all(asked, g).items():
            texts.update({slot: out.texts[k * g : (k + 1) * g] for k, slot in enumerate(slots[p])})
            rollouts[p] = (out, slots[p])
        texts = {slot: t for part in collectives.gather_objects(self._trainer, texts) for slot, t in part.items()}
        return texts, rollouts

    def _judge_duels(self, judges: list[list[int]], questions: list[str], texts: dict, g: int, iteration: int, refs):
        """4. ``{(duel, side, rollout): {judge: score}}``; ``None`` if one is not finite; an empty reply scores 1."""
        responses = [(d, s, r) for d in range(len(judges)) for s in (0, 1) for r in range(g)]
        shown = [x for x in responses if texts[x[:2]][x[2]].strip() and collectives.owns(self._trainer, x[0])]
        work = [[x for x in shown if j in judges[x[0]]] for j in range(len(self.player_names))]
        scores, counts = {}, {}
        for j, (items, verdicts) in enumerate(zip(work, self._verdicts(work, questions, texts, refs))):
            counts[j] = (len(verdicts), sum(1 for _, ok in verdicts if not ok))
            for item, (score, _) in zip(items, verdicts):
                scores.setdefault(item, {})[j] = score
        gathered = collectives.gather_objects(self._trainer, (scores, counts))
        scores = dict(sorted({k: v for part, _ in gathered for k, v in part.items()}.items()))
        self._count_judgements([c for _, c in gathered], iteration)
        empty = [x for x in responses if not texts[x[:2]][x[2]].strip()]
        scores.update({x: dict.fromkeys(judges[x[0]], SCORE_MIN) for x in empty})
        self.counters["empty_responses"] += len(empty)
        raw = torch.tensor([v for per_judge in scores.values() for v in per_judge.values()], dtype=torch.float64)
        # only a failure is reported: a good score check must not end a streak of skipped follower updates
        if not bool(torch.isfinite(raw).all()) and not self.check_finite(raw, "peer scores (rewards)"):
            return None
        return scores

    def _verdicts(self, work: list[list], questions: list[str], texts: dict, refs) -> list[list[tuple[float, bool]]]:
        """Each judge's ``(score, read)`` of its items ``(duel, side, rollout)``, in player order (``judge_all``)."""
        reference = self.judging.mode == "reference"
        asked = {
            name: (
                [questions[d] for d, *_ in items],
                [texts[(d, s)][r] for d, s, r in items],
                [refs[d] for d, *_ in items] if reference else None,
            )
            for name, items in zip(self.player_names, work)
        }
        verdicts = self.judge_all(asked)
        return [verdicts[name] for name in self.player_names]

    def _count_judgements(self, per_rank: list[dict[int, tuple[int, int]]], iteration: int) -> None:
        """Add every rank's judgements and parse failures per judge; warn about a judge whose answers never parse."""
        for j, name in enumerate(self.player_names):
            judged, fails = sum(c[j][0] for c in per_rank), sum(c[j][1] for c in per_rank)
            self.judge_counts[name][0] += judged
            self.judge_counts[name][1] += fails
            self.counters["judgements"] += judged
            self.counters["parse_failures"] += fails
            if judged and fails == judged and self.judging.mode == "generate":
                msg = f"iteration {iteration}: none of judge {name}'s {judged} judgements parsed; each counts as 5.0"
                warnings.warn(f"{msg} (App. G)", stacklevel=3)

    def _aggregate(self, duels: list[tuple[int, int]], judges: list[list[int]], scores: dict, g: int):
        """5. Each side's and rollout's reputation-weighted score; the duels' verdicts applied to the Elo ratings."""
        names, elo = self.player_names, self.elo
        side_scores, rollout_scores = [], {}
        for d, (a, b) in enumerate(duels):
            ratings = [elo.rating(names[j]) for j in judges[d]] if elo is not None else None
            weights = self.reputation.weights(ratings) if ratings is not None else [1.0] * len(judges[d])
            table = [[[scores[(d, s, r)][j] for j in judges[d]] for r in range(g)] for s in (0, 1)]
            per_rollout, verdicts = rules.aggregate_duel(table, weights)
            rollout_scores[(d, 0)], rollout_scores[(d, 1)] = per_rollout
            side_scores.append((sum(per_rollout[0]) / g, sum(per_rollout[1]) / g))
            if elo is not None and collectives.owns(self._trainer, d):  # reported once, by the rank that played it
                elo.report(names[a], names[b], verdicts, weights=weights)
        if elo is not None:  # every rank's duels, in rank order, on every rank
            elo.apply_pending(self._trainer)
        return side_scores, rollout_scores

    def _log_reference_agreement(self, texts: dict, rollout_scores: dict, refs: list) -> None:
        """Peer judging against the references, where all exist (a diagnostic: no reward reads it; docs/pool.md)."""
        if not refs or any(r is None for r in refs) or self.judging.mode == "reference":
            return
        sides = [[(d, s) for s in (0, 1)] for d in range(len(refs))]
        scores = [[x for slot in duel for x in rollout_scores[slot]] for duel in sides]
        right = [
            [answers_match(rules.final_answer(t), refs[d]) for d, s in duel for t in texts[(d, s)]] for duel in sides
        ]
        agreement, pairs = rules.reference_agreement(scores, right)
        logs = {"duel/reference_accuracy": sum(map(sum, right)) / sum(map(len, right)), "judge/reference_pairs": pairs}
        self.log_dict({**logs, **({"judge/reference_agreement": agreement} if pairs else {})}, batch_size=1)

    def _update_leader(self, chosen: list[int], side_scores: list, progress: float) -> tuple[list[float], Tensor]:
        """6. The duels' composite rewards and the EXP3 update; the leader's new distribution."""
        rewards = [self.leader_reward(sa, sb, progress) for sa, sb in side_scores]
        if self.hparams.leader == "exp3":
            self.leader_bandit.update(chosen, rewards)
        probs = self.leader_probabilities()
        self.history["weights"].append(probs.tolist())
        self.history["rewards"].append(sum(rewards) / len(rewards))
        return rewards, probs

    def _show_duels(self, questions, duels, judges, texts, scores, side_scores, rewards) -> None:
        """Keep the iteration's first duels for TensorBoard's text tab (written at the next validation)."""
        names, g = self.player_names, len(texts[(0, 0)])
        rollout = f", rollout 1 of {g}" if g > 1 else ""

        def row(d: int) -> dict[str, Any]:
            a, b = duels[d]
            mean = [[sum(scores[(d, s, r)][j] for r in range(g)) / g for s in (0, 1)] for j in judges[d]]
            votes = "; ".join(f"{names[j]}: {x:.3g} vs {y:.3g}" for j, (x, y) in zip(judges[d], mean))
            return {
                "instruction": questions[d],
                f"reply a ({names[a]}{rollout})": texts[(d, 0)][0],
                f"reply b ({names[b]}{rollout})": texts[(d, 1)][0],
                "judge scores, a vs b": votes,
                "reputation-weighted scores, a and b": side_scores[d],
                "leader reward": rewards[d],
            }

        self.board.add_samples(self, "train/duels", map(row, range(len(duels))), replace=True)

    def _follow(self, questions, duels, texts, side_scores, rollouts, rollout_scores, iteration: int) -> dict:
        """7. The followers' steps (:class:`~alignment_games.modules.games.pool_followers.FollowerUpdates`): stats."""
        opts = self.optimizers()
        trainer, opts = self._trainer, dict(zip(self.player_names, opts if isinstance(opts, list) else [opts]))
        if self.followers.algorithm != "dpo":
            return self.follow.grpo(trainer, opts, rollouts, rollout_scores, duels)
        stats = self.follow.dpo(trainer, opts, questions, duels, texts, side_scores, iteration)
        self.counters["iterations_without_pairs"] += not stats["duel/pairs"]
        return stats

    def _log_iteration(self, probs: Tensor, rewards: list, side_scores: list, target_gap: float, stats: dict) -> None:
        """The iteration's leader, duel, judge and follower numbers, the epoch means and the phase times."""
        names, k = self.player_names, probs.numel()
        mean_reward = sum(rewards) / len(rewards)
        score_gap = sum(abs(x - y) for x, y in side_scores) / len(side_scores)
        self.epoch_means["leader_reward"].update(mean_reward)
        self.epoch_means["score_gap"].update(score_gap)
        epoch = {"leader/reward_epoch": "leader_reward", "duel/score_gap_epoch": "score_gap"}
        for name, metric in {**epoch, "follower/loss_epoch": "follower_loss"}.items():
            self.log(name, self.epoch_means[metric], on_step=False, on_epoch=True, batch_size=1)
        judged, failures = sum(self.judge_counts[p][0] for p in names), self.counters["parse_failures"]
        top5, bottom5 = rules.weight_extremes(probs.tolist())  # §5's sharpening: mean weights against uniform
        logs = {
            "leader/reward": mean_reward,
            "leader/entropy": float(-(probs * probs.log()).sum()),
            "leader/max_weight_ratio": float(probs.max() * k),
            "leader/min_weight_ratio": float(probs.min() * k),
            "leader/top5_weight_ratio": top5,
            "leader/bottom5_weight_ratio": bottom5,
            "match/target_gap": target_gap,
            "duel/score_gap": score_gap,
            "duel/ties": float(sum(1 for x, y in side_scores if x == y)),
            "judge/parse_failures": float(failures),
            "judge/parse_failure_rate": failures / max(1, judged),
            "train/empty_responses": float(self.counters["empty_responses"]),
            "train/nonfinite_skipped": float(self.nonfinite_skipped),
        }
        for p, (count, fails) in self.judge_counts.items():
            logs[f"judge/parse_failure_rate/{p}"] = fails / max(1, count)
            if self.elo is not None:
                logs.update({f"elo/{p}": self.elo.rating(p), f"elo_volatility/{p}": self.elo.volatility(p)})
        if self.categories is not None:  # the curriculum by category: the leader's mass on each
            for c, w in rules.category_weights(probs.tolist(), self.categories).items():
                logs[f"leader/category_weight/{c.replace('/', '_')}"] = w
        self.log_dict({**logs, **stats}, batch_size=1)
        self.log_phase_times(1)
        self.board.write_distribution(self, "leader/exp3_probs", probs)  # every iteration: the leader's distribution
        self.board.add_values(self, {"leader/reward_hist": rewards, "duel/score_hist": side_scores})

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Each model's greedy answers scored by exact final-answer match: ``val/acc/<model>`` (``test/`` in test)."""
        refs = list(batch["reference"])
        if any(r is None for r in refs):
            raise ValueError("evaluation needs a reference answer for every prompt (data.reference_column)")
        index, correct = self.item_ids(batch, len(refs)), {}
        sampling = Sampling(max_new_tokens=self.hparams.eval_max_new_tokens)
        for p in self.player_names:
            prompts = [self.chat(p, x, self.hparams.system_prompt) for x in batch["prompt"]]
            out = self.bank(p).generate(p, prompts, 1, sampling, greedy=True)
            hits = [float(answers_match(rules.final_answer(t), r)) for t, r in zip(out.texts, refs)]
            correct[p] = torch.tensor(hits, device=self.device)
        self.eval_items.update(index, **correct)

    @override
    def on_validation_epoch_end(self) -> None:
        """Each model's share of prompts answered right, every prompt once across ranks (the sampler's repeats out)."""
        stage = "test" if self.trainer.testing else "val"
        ids, correct = self.eval_items.compute(self.device)
        self.eval_items.reset()
        if ids.numel() == 0:
            return
        accs = {p: correct[p].mean() for p in self.player_names}
        self.log_dict({f"{stage}/acc/{p}": v for p, v in accs.items()}, sync_dist=True)
        self.log(f"{stage}/acc_macro", torch.stack(list(accs.values())).mean(), sync_dist=True)

    test_step = validation_step
    on_test_epoch_end = on_validation_epoch_end

    @override
    def on_train_end(self) -> None:
        """``pool_history.json`` and the figures of §5 beside the logs (rank 0; not in a ``fast_dev_run``)."""
        if self.elo is not None:
            self.history["ratings"].append([self.elo.rating(p) for p in self.player_names])
        record = {
            "players": self.player_names,
            "models": self.model_names,
            **self.history,
            "counters": {**self.counters, "nonfinite_skipped": self.nonfinite_skipped},
            "judge_counts": {p: {"judgements": c[0], "parse_failures": c[1]} for p, c in self.judge_counts.items()},
            "categories": self.categories,
        }
        # not write_artifact: it reads the trainer's log_dir on rank 0 alone, and under DDP that is a broadcast
        folder = self.artifact_dir()
        if self.trainer.is_global_zero and not self.trainer.fast_dev_run:
            record["provenance"] = run_provenance(self.trainer, self)
            figures = make_pool_figures(self.history, self.player_names)
            write_pool_artifacts(folder, record, figures, self.trainer, self.global_step)

    @override
    def game_state(self) -> dict[str, Any]:
        """The leader, iteration, histories, counters, the game's generator and the Elo ratings."""
        return {
            "leader": None if self.leader_bandit is None else self.leader_bandit.state_dict(),
            "iteration": self.iteration,
            "history": self.history,
            "counters": dict(self.counters),
            "judge_counts": {p: list(c) for p, c in self.judge_counts.items()},
            "generator": self.generator.get_state(),
            "elo": None if self.elo is None else self.elo.state_dict(),
        }

    @override
    def load_game_state(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if state["leader"] is not None:
            self.leader_bandit = Exp3(state["leader"]["num_arms"], gamma=self.hparams.gamma)
            self.leader_bandit.load_state_dict(state["leader"])
        self.iteration = int(state["iteration"])
        self.history = {k: list(v) for k, v in state["history"].items()}
        self.counters = dict(state["counters"])
        self.judge_counts = {p: list(c) for p, c in state["judge_counts"].items()}
        self.generator.set_state(state["generator"])
        if self.elo is not None and state["elo"] is not None:
            self.elo.load_state_dict(state["elo"])


def _check_settings(m: int, hp: Any) -> None:
    """Refuse a pool without a non-competing judge and settings out of range, naming the argument."""
    if m == 2 or m < 1:
        raise ValueError(
            f"num_players/models: a pool of {m} model(s) has no non-competing judge for its duels; use at least 3 "
            "(or 1 for the self-rewarding baseline, where the model judges itself)"
        )
    if hp.leader not in ("exp3", "uniform"):
        raise ValueError(f"leader must be one of ('exp3', 'uniform'), got {hp.leader!r}")
    if hp.duels_per_iteration < 1 or (hp.num_iterations is not None and hp.num_iterations < 1):
        raise ValueError("duels_per_iteration and num_iterations must be positive")
    require_in_range("gamma", hp.gamma, 0.0, 1.0, open_low=True)  # EXP3's exploration rate (checked again by Exp3)
    require_at_least(eval_max_new_tokens=(hp.eval_max_new_tokens, 1))
    if unknown := sorted(set(hp.elo or {}) - ELO_SETTINGS):
        raise ValueError(f"elo: unknown setting(s) {unknown}; known: {sorted(ELO_SETTINGS)}")
