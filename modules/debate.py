"""Debate self-play (debate RLAIF): one policy plays Alice and Bob against a frozen judge, trained GRPO-style."""

from __future__ import annotations

import json
import math
import random
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torchmetrics
from typing_extensions import override

from alignment_games.callbacks.functional import confusion_cells, matthews_corrcoef_from_counts
from alignment_games.callbacks.items import ItemRecords
from alignment_games.modules.algorithms.checks import require_at_least, require_positive
from alignment_games.modules.algorithms.debate import (
    PLAYER_OF_PLY,
    PLIES,
    PROMPTS,
    PROTOCOLS,
    ForkedRollout,
    PlyReward,
    Transcript,
    branch_rows,
    check_ablation,
    choose_fork_plies,
    derived_seed,
    fill_fields,
    fork_counts,
    forked_ply_metrics,
    ply_rewards,
    split_reply,
    transcript_metrics,
)
from alignment_games.modules.algorithms.rl_losses import PolicyGradient
from alignment_games.modules.algorithms.verdicts import pair_indices, pair_shares
from alignment_games.modules.base import LanguageModelGame
from alignment_games.modules.evaluation.audit import run_provenance, tensors_sha256
from alignment_games.modules.evaluation.tensorboard import debate_row
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.rollout import Rollout
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.scorers.judges import DebateJudge, ProgrammaticJudge
from alignment_games.modules.training.faults import reset_stale_epoch_metrics

PLAYER = "policy"


class DebateSelfPlay(LanguageModelGame):
    """One set of weights plays Alice and Bob in RLAIF-A, Debate-AB, Debate-ABA or RLVR against a frozen judge.

    Args:
        lm: The policy (:class:`ModelConfig`: LoRA adapter or full copy); its frozen weights are the reference.
        protocol: ``rlaif_a``, ``debate_ab``, ``debate_aba`` or ``rlvr``.
        judge: The frozen judge; ``None`` builds a :class:`alignment_games.modules.scorers.judges.ProgrammaticJudge`
          with its defaults.
        lr: Single-player learning rate (RLAIF-A, RLVR).
        multi_player_lr_scale: Debate protocols train at ``lr`` times this (paper: 1/4).
        policy_gradient: The forked ply's update (:class:`PolicyGradient`; ``group_size``: branches at the fork).
        sampling: How the players sample (temperature also of the log-probabilities; tokens of Alice's answer).
        reply_max_new_tokens: Tokens of critique and rebuttal turns (``None``: ``sampling.max_new_tokens``).
        eval_greedy: Validation and test decode every ply greedily, as GRPO's and the pool's evaluations do (the
            judge's votes stay sampled); ``False``: with ``sampling``, as training plays.
        word_limit: Words allowed in critique and rebuttal, stated and enforced by the penalty (``None``: no limit).
        step_chars: Alice's visible answer must be numbered steps of at most this many characters (``None``: free).
        word_penalty_coef: Penalty per word over the limit.
        missing_answer_reward: Alice's reward when her answer has no ``\\boxed{}`` (strictly negative).
        format_reward: Reward of a ply with an invalid thinking format (paper: −1).
        think_open: Opening delimiter of the hidden chain of thought (``""``: no hidden part).
        think_close: Closing delimiter.
        require_thinking: Whether a reply without a thinking block has an invalid format.
        system_prompt: System message of every turn (``None``: none).
        alice_prompt: Alice's answer prompt: a name (``alice``, ``alice_misaligned``) or a ``{problem}`` template.
        bob_prompt: Bob's prompt: a name (``bob_honest_broker``, ...) or a ``{problem}``, ``{solution}`` template.
        rebuttal_prompt: Alice's rebuttal prompt: ``alice_rebuttal`` or a template with ``{critique}``.
        trainable_plies: Plies that may be forked (``None``: all plies of the protocol), e.g. ``["critique"]``.
        frozen_critic: Bob is played by the frozen reference weights, not the policy (``trainable_plies``: Alice's).
        judging: ``verdict`` or ``pairwise`` (RLAIF-A, even ``group_size``: the pairwise-preference ablation).
        bob_reward: ``constant_sum`` (``1 − r``), or ``b_judge`` / ``b_convince`` (Bob alone trains on ground truth).
        seed: Seed of fork choice and sampling (per batch, so resumes draw the same).
        **game: :class:`~alignment_games.modules.base.LanguageModelGame`'s arguments (``log_samples``: ``val/debates``).
    """

    family = "debate self-play"
    # the epoch's running averages travel in checkpoints, so a run resumed mid-epoch reports the whole epoch
    kept_state_prefixes = ("epoch_reward.", "epoch_accuracy.")

    def __init__(
        self,
        lm: ModelConfig,
        protocol: str = "debate_ab",
        judge: DebateJudge | None = None,
        lr: float = 1e-4,
        multi_player_lr_scale: float = 0.25,
        policy_gradient: PolicyGradient = PolicyGradient(),
        sampling: Sampling = Sampling(temperature=0.6, max_new_tokens=512),
        reply_max_new_tokens: int | None = None,
        eval_greedy: bool = False,
        word_limit: int | None = 100,
        step_chars: int | None = None,
        word_penalty_coef: float = 0.01,
        missing_answer_reward: float = -0.5,
        format_reward: float = -1.0,
        think_open: str = "<think>",
        think_close: str = "</think>",
        require_thinking: bool = True,
        system_prompt: str | None = None,
        alice_prompt: str = "alice",
        bob_prompt: str = "bob_honest_broker",
        rebuttal_prompt: str = "alice_rebuttal",
        trainable_plies: list[str] | None = None,
        frozen_critic: bool = False,
        judging: str = "verdict",
        bob_reward: str = "constant_sum",
        seed: int = 0,
        **game: Any,
    ) -> None:
        super().__init__(**game)
        lm = ModelConfig.coerce(lm)
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        require_positive(lr=lr, multi_player_lr_scale=multi_player_lr_scale)
        require_at_least(word_penalty_coef=(word_penalty_coef, 0.0))
        limits = {"word_limit": word_limit, "reply_max_new_tokens": reply_max_new_tokens, "step_chars": step_chars}
        require_at_least(**{name: (value, 1) for name, value in limits.items() if value is not None})
        if missing_answer_reward >= 0:
            raise ValueError(f"missing_answer_reward must be strictly negative, got {missing_answer_reward}")
        plies = PLIES[protocol]
        trainable = list(plies) if trainable_plies is None else list(trainable_plies)
        if not trainable or not set(trainable) <= set(plies):
            raise ValueError(f"trainable_plies: {trainable} must be a non-empty subset of {protocol}'s plies {plies}")
        self.templates = {
            "answer": self._template("alice_prompt", alice_prompt, ["{problem}"]),
            "critique": self._template("bob_prompt", bob_prompt, ["{problem}", "{solution}"]),
            "rebuttal": self._template("rebuttal_prompt", rebuttal_prompt, ["{critique}"]),
        }
        if (step_chars is None) == ("{step_chars}" in self.templates["answer"]):
            raise ValueError(f"step_chars ({step_chars}) is stated by alice_prompt's {{step_chars}} and only with it")
        self.save_arguments(lm, ["judge"], sampling=Sampling, policy_gradient=PolicyGradient)
        check_ablation(protocol, trainable, judging, bob_reward, self.policy_gradient.group_size, frozen_critic)
        self.frozen = "alice" if bob_reward != "constant_sum" else "bob" if frozen_critic else None  # reference weights
        self.plies = plies
        self.trainable = [plies.index(p) for p in trainable]
        self.bank = PolicyBank(lm, players=(PLAYER,))
        self.judge = judge if judge is not None else ProgrammaticJudge()
        if judging == "pairwise" and not self.judge.pairwise:
            raise ValueError(
                f"judging: pairwise needs a judge that compares two answers; {type(self.judge).__name__} does not"
            )
        self.epoch_reward, self.epoch_accuracy = torchmetrics.MeanMetric(), torchmetrics.MeanMetric()
        for metric in (self.epoch_reward, self.epoch_accuracy):
            metric.persistent(True)
        keys = "batches_seen no_reference judge_unparseable judge_timeouts judge_invalid judge_ties judge_unparsed"
        self.counters = dict.fromkeys([*keys.split(), "empty_replies"], 0)
        self._records = ItemRecords(self._RECORD_COLUMNS)
        self.eval_history: list[dict[str, float]] = []

    @staticmethod
    def _template(field: str, value: str, needs: list[str]) -> str:
        template = PROMPTS.get(value, value)
        if missing := [k for k in needs if k not in template]:
            raise ValueError(
                f"{field}: {value!r} is neither a prompt name ({sorted(PROMPTS)}) nor a template containing {missing}"
            )
        return template

    @property
    def learning_rate(self) -> float:
        """The rate in use: ``lr`` for one player, ``lr · multi_player_lr_scale`` for the debates."""
        hp = self.hparams
        return hp.lr * (hp.multi_player_lr_scale if hp.protocol in ("debate_ab", "debate_aba") else 1.0)

    def render(self, ply: str, transcript: Transcript) -> str:
        """The chat-formatted prompt of ``ply`` given the transcript so far (visible parts only)."""
        hp = self.hparams
        fields = transcript.prompt_fields(hp.word_limit, hp.think_open, hp.think_close)
        return self.bank.chat(hp.system_prompt, fill_fields(self.templates[ply], **fields, step_chars=hp.step_chars))

    def play(
        self,
        problems: list[str],
        references: list[str | None],
        group_size: int,
        fork_plies: list[int] | None = None,
        greedy: bool = False,
    ) -> ForkedRollout[Rollout]:
        """Play every problem, ``group_size`` branches forked at ``fork_plies`` (``None``: once); one decode per ply."""
        hp = self.hparams
        b, g = len(problems), group_size
        if fork_plies is None:
            if g != 1:
                raise ValueError("without a fork each problem is played once (group_size=1)")
            fork_plies = [len(self.plies)] * b
        branches = [[Transcript(x, ref, hp.protocol) for _ in range(g)] for x, ref in zip(problems, references)]
        chunks: dict[int, tuple[Rollout, list[int]]] = {}
        rollouts = []
        for j, ply in enumerate(self.plies):
            counts = fork_counts(fork_plies, j, g) if g > 1 else [1] * b
            prompts = [
                self.render(ply, branches[i][k if c == g else 0]) for i, c in enumerate(counts) for k in range(c)
            ]
            s = self.sampling
            tokens = s.max_new_tokens if ply == "answer" else (hp.reply_max_new_tokens or s.max_new_tokens)
            s = replace(s, max_new_tokens=tokens, min_new_tokens=min(s.min_new_tokens, tokens))
            player = None if PLAYER_OF_PLY[ply] == self.frozen else PLAYER  # None: the frozen reference weights
            with self._timed(f"generate_{ply}"):
                out = self.bank.generate(player, prompts, 1, s, greedy=greedy)
            rollouts.append(out)
            rows = branch_rows(counts, g) if g > 1 else list(range(b))
            replies = [split_reply(text, hp.think_open, hp.think_close, hp.require_thinking) for text in out.texts]
            for i in range(b):
                for k in range(g):
                    branches[i][k].replies.append(replies[rows[i * g + k]])
            if forked := [i for i in range(b) if fork_plies[i] == j]:
                flat = [i * g + k for i in forked for k in range(g)]
                chunks[j] = (out.rows([rows[x] for x in flat]), flat)
        transcripts = [t for per_problem in branches for t in per_problem]
        return ForkedRollout(transcripts, list(fork_plies), chunks, rollouts)

    def rewards(self, transcripts: list[Transcript], shares: list[float]) -> list[list[PlyReward]]:
        """:func:`~alignment_games.modules.algorithms.debate.ply_rewards` of each transcript, this module's settings."""
        keys = ("word_limit", "word_penalty_coef", "missing_answer_reward", "format_reward", "bob_reward", "step_chars")
        settings = {k: self.hparams[k] for k in keys}
        return [ply_rewards(t, s, **settings) for t, s in zip(transcripts, shares)]

    def policy_loss(
        self, rollout: ForkedRollout, advantages: torch.Tensor, old: dict[int, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[int, torch.Tensor]]:
        """GRPO loss on the forked plies' tokens, each weighted by its rows; stats and detached log-probs per ply."""
        pg, temp = self.policy_gradient, self.sampling.temperature
        budget = pg.max_tokens_per_micro_batch
        n = sum(len(idx) for _, idx in rollout.chunks.values())
        loss, stats, current = torch.zeros((), device=self.device), {"kl": 0.0, "clip_fraction": 0.0}, {}
        for j, (chunk, idx) in rollout.chunks.items():
            lp = self.bank.token_logprobs(PLAYER, chunk, temp, pg.micro_batch, budget)
            ref = None
            if pg.kl_coef > 0:
                with torch.no_grad():
                    ref = self.bank.token_logprobs(None, chunk, temp, pg.logprob_micro_batch, budget)
            mask = chunk.completion_mask.to(lp.device)
            adv = advantages[torch.tensor(idx, device=advantages.device)].to(lp.device)
            sampled = None if chunk.sample_logprobs is None else chunk.sample_logprobs.to(lp.device)  # the fork's rows
            part, st = pg.loss(lp, mask, adv, None if old is None else old[j], ref, sampled)
            w = len(idx) / n
            loss = loss + w * part
            if "logprob_gap" in st:  # an engine sampled the rollout (lm.decode: vllm)
                stats.setdefault("logprob_gap", 0.0)
            for k in stats:
                stats[k] += w * float(st[k])
            current[j] = lp.detach()
        return loss, {k: torch.tensor(v) for k, v in stats.items()}, current

    @contextmanager
    def _seeded(self, *key: int) -> Any:
        """Seed the players' sampling from ``(seed, *key)`` without touching the caller's global RNG state."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(derived_seed(self.hparams.seed, "sample", *key))
            yield

    def _judge(
        self, transcripts: list[Transcript], against: list[Transcript] | None = None
    ) -> tuple[list[float], dict[str, int], list[str]]:
        """Alice's vote shares, the judge's counts and the verdicts (``against``: pairwise, ``transcripts`` over it)."""
        out = self.judge.vote(transcripts, against)
        counts = {"judge_unparseable": out.unparseable, "judge_timeouts": out.timed_out, "judge_invalid": out.invalid}
        referenced = [v for v, t in zip(out.verdicts, transcripts) if t.correct is not None]
        counts |= {"judge_ties": referenced.count("tie"), "judge_unparsed": referenced.count("unparsed")}
        return out.shares, counts, out.verdicts

    @override
    def on_train_epoch_start(self) -> None:
        reset_stale_epoch_metrics(self.trainer, [self.epoch_reward, self.epoch_accuracy])

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, torch.Tensor] | None:
        hp, pg = self.hparams, self.policy_gradient
        problems, refs = list(batch["prompt"]), list(batch["reference"])
        b, g = len(problems), pg.group_size
        step_key = self.counters["batches_seen"]
        self.counters["batches_seen"] += 1
        forks = choose_fork_plies(b, self.trainable, random.Random(derived_seed(hp.seed, "fork", step_key)))
        with self._seeded(0, step_key):
            roll = self.play(problems, refs, g, forks)
        transcripts = roll.transcripts
        with self._timed("judge"):
            if hp.judging == "pairwise":  # a comparison is no accept/reject verdict: MCC reads none from training
                pairs = pair_indices(b, g, random.Random(derived_seed(hp.seed, "order", step_key)))  # seeded order
                firsts, judge_counts, _ = self._judge(*([transcripts[p[k]] for p in pairs] for k in (0, 1)))
                shares, verdicts = pair_shares(firsts, pairs), ["unparsed"] * len(transcripts)
            else:
                shares, judge_counts, verdicts = self._judge(transcripts)
        rewards = self.rewards(transcripts, shares)
        forked = [rewards[i][forks[i // g]] for i in range(b * g)]
        r = torch.tensor([x.reward for x in forked], dtype=torch.float32, device=self.device)
        metrics = self._rollout_metrics("train", transcripts, shares, judge_counts)
        metrics.update(forked_ply_metrics(self.plies, self.trainable, forks, forked))
        # non-finite rewards (the same decision on every rank) or first loss: nobody steps, the losses log NaN
        if not self.check_finite(r, "rewards") or (update := self._update(roll, r)) is None:
            update = dict.fromkeys(("train/loss", "train/kl", "train/clip_fraction", "train/grad_norm"), math.nan)
        else:
            self._update_epoch_averages(r, transcripts)
            self.log_phase_times(b, generated_tokens=float(sum(int(x.completion_mask.sum()) for x in roll.rollouts)))
        self.log_dict({**metrics, **update}, batch_size=b)
        return self._mcc_outputs(transcripts, verdicts)

    def _update(self, roll: ForkedRollout, r: torch.Tensor) -> dict[str, float] | None:
        """The ``updates_per_batch`` steps on a rollout of rewards ``r``: the last one's metrics; ``None``: skipped."""
        pg = self.policy_gradient
        adv, old = pg.advantages(r), None
        self.board.add_values(self, {"train/reward_hist": r, "train/advantage_hist": adv})
        for update in range(pg.updates_per_batch):
            with self._timed("logprob"):
                loss, stats, current = self.policy_loss(roll, adv, old)
            if (step := self.update(loss, self.optimizers(), [self.bank.player_parameters(PLAYER)])) is None:
                if update == 0:
                    return None
                break  # a later non-finite loss: the earlier updates stand, its loss is logged
            old, norm = current if old is None else old, step[1][0]
        out = {"train/loss": float(loss.detach()), "train/kl": float(stats["kl"]), "train/grad_norm": float(norm)}
        out |= {"train/clip_fraction": float(stats["clip_fraction"]), "train/advantage_abs": float(adv.abs().mean())}
        if "logprob_gap" in stats:  # an engine sampled the rollout (lm.decode: vllm)
            out["rollout/logprob_gap"] = float(stats["logprob_gap"])
        return out

    def _mcc_outputs(
        self, transcripts: list[Transcript], verdicts: list[str], items: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """The callbacks' ``judge``/``truth`` of referenced, decided transcripts; with ``items``: ids, ``correct``."""
        known = [i for i, t in enumerate(transcripts) if t.correct is not None]
        keep = [i for i in known if verdicts[i] in ("alice", "bob")]
        dev = self.device
        out = {
            "judge": torch.tensor([verdicts[i] == "alice" for i in keep], dtype=torch.float32, device=dev),
            "truth": torch.tensor([bool(transcripts[i].correct) for i in keep], dtype=torch.long, device=dev),
        }
        if items is not None:
            index = items.to(dev)
            out["judge_item"] = index[torch.tensor(keep, dtype=torch.long, device=dev)]
            out["correct"] = torch.tensor([bool(transcripts[i].correct) for i in known], device=dev).long()
            out["correct_item"] = index[torch.tensor(known, dtype=torch.long, device=dev)]
        return out

    def _rollout_metrics(
        self, stage: str, transcripts: list[Transcript], shares: list[float], judge_counts: dict[str, int]
    ) -> dict[str, float]:
        """:func:`~alignment_games.modules.algorithms.debate.transcript_metrics` and the judge's; training sums them."""
        out = transcript_metrics(stage, transcripts, shares, judge_counts)
        if stage == "train":
            for key, value in judge_counts.items():
                self.counters[key] = self.counters.get(key, 0) + value
            for key in ("no_reference", "empty_replies"):
                self.counters[key] += int(out[f"train/{key}"])
        out.update({f"{stage}/judge_{k}": float(v) for k, v in self.judge.stats(transcripts).items()})
        return out

    def _update_epoch_averages(self, rewards: torch.Tensor, transcripts: list[Transcript]) -> None:
        """Feed the persistent per-epoch means (forked-ply reward; Alice's accuracy on referenced rows)."""
        self.epoch_reward.update(rewards)
        self.log("train/reward_epoch", self.epoch_reward, on_step=False, on_epoch=True, batch_size=rewards.numel())
        if known := [float(t.correct) for t in transcripts if t.correct is not None]:
            self.epoch_accuracy.update(torch.tensor(known, dtype=torch.float32, device=self.device))
            self.log("train/accuracy_epoch", self.epoch_accuracy, on_step=False, on_epoch=True, batch_size=len(known))

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.make_optimizer(self.bank.player_parameters(PLAYER), self.learning_rate)

    @override
    def on_fit_start(self) -> None:
        self.judge.to(self.device)

    _RECORD_COLUMNS = ("referenced", "correct", "accepts", "tie", "unparsed", "reward")

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, torch.Tensor]:
        stage = "test" if self.trainer.testing else "val"
        problems, refs = list(batch["prompt"]), list(batch["reference"])
        items = self.item_ids(batch, len(problems))
        with self._seeded(1, self.counters["batches_seen"], batch_idx):
            roll = self.play(problems, refs, 1, None, greedy=self.hparams.eval_greedy)
        transcripts = roll.transcripts
        shares, judge_counts, verdicts = self._judge(transcripts)
        metrics = self._rollout_metrics(stage, transcripts, shares, judge_counts)
        rewards = self.rewards(transcripts, shares)
        if stage == "val":
            self.board.add_samples(self, "val/debates", map(debate_row, transcripts, shares, verdicts, rewards))
        # exact per-problem values are logged at the evaluation's end, each problem once (see _end_evaluation)
        for key in ("accuracy", "judge_ties", "judge_unparsed"):
            metrics.pop(f"{stage}/{key}", None)
        self.log_dict(metrics, batch_size=len(problems), sync_dist=True)
        flags = {"referenced": [t.correct is not None for t in transcripts]}
        flags["correct"] = [bool(t.correct) for t in transcripts]
        flags["accepts"] = [v == "alice" for v in verdicts]
        flags |= {k: [v == k for v in verdicts] for k in ("tie", "unparsed")}
        reward = torch.tensor([r[0].reward for r in rewards], dtype=torch.float64, device=self.device)
        self._records.update(items, **{k: torch.tensor(x, device=self.device) for k, x in flags.items()}, reward=reward)
        return self._mcc_outputs(transcripts, verdicts, items)

    def _end_evaluation(self, stage: str) -> tuple[dict[str, float], dict[str, list[Any]]] | None:
        """Gather the per-problem records (each once; a collective), log the exact counts; the counts and the rows."""
        ids, v = self._records.compute(self.device)
        self._records.reset()
        if self.trainer.sanity_checking or v["reward"].numel() == 0:  # the same on every rank: all were gathered
            return None
        ref, truth, tie, unparsed = (v[k] > 0 for k in ("referenced", "correct", "tie", "unparsed"))
        cells = confusion_cells(ref, truth, v["accepts"] > 0, tie, unparsed)
        cells |= {"successes": ref & truth, "trials": ref, "ties": ref & tie, "unparsed": ref & unparsed}
        keys = sorted(cells)
        values = torch.stack([cells[k].sum() for k in keys] + [v["reward"].sum()]).tolist()
        counts = {k: float(x) for k, x in zip(keys + ["reward_sum"], values)} | {"n": float(v["reward"].numel())}
        names = {"correct": "successes", "total": "trials", "judge_ties": "ties", "judge_unparsed": "unparsed"}
        logged = {f"{stage}/{name}": counts[key] for name, key in names.items()}
        if counts["trials"]:
            logged[f"{stage}/accuracy"] = counts["successes"] / counts["trials"]
        if counts["n"]:
            logged[f"{stage}/reward"] = counts["reward_sum"] / counts["n"]
        # identical on every rank (gathered); "max" keeps Lightning's epoch-level reduction exact
        self.log_dict(logged, sync_dist=self.trainer.world_size > 1, reduce_fx="max", batch_size=1)
        rows = {"item": ids.tolist()} | {k: [int(x) for x in v[k].tolist()] for k in self._RECORD_COLUMNS[:-1]}
        return counts, rows

    test_step = validation_step

    @override
    def on_validation_epoch_start(self) -> None:
        self._records.reset()

    on_test_epoch_start = on_validation_epoch_start

    @override
    def on_test_epoch_end(self) -> None:
        self._end_evaluation("test")

    @override
    def on_validation_epoch_end(self) -> None:
        if (ended := self._end_evaluation("val")) is None:
            return
        v, rows = ended
        record = {
            "step": int(self.global_step),
            "batches_seen": int(self.counters["batches_seen"]),
            **{k: v[k] for k in ("successes", "trials")},
            "accuracy": v["successes"] / v["trials"] if v["trials"] else float("nan"),
            "mcc": matthews_corrcoef_from_counts(v["tp"], v["fp"], v["tn"], v["fn"]),
            **{k: v[k] for k in ("tp", "fp", "tn", "fn", "ties", "unparsed")},
            "reward": v["reward_sum"] / v["n"] if v["n"] else float("nan"),
            "protocol": self.hparams.protocol,
            # what was evaluated and each problem's result, for a reader to check and resample (debate_compare)
            "adapter_sha256": tensors_sha256(self.bank.player_parameters(PLAYER)),
            "problems": rows,
            "provenance": run_provenance(self.trainer, self),  # what this evaluation's run read, its commit, command
        }
        self.eval_history.append(record)
        # rewritten whole: a resumed run drops the evaluations after its checkpoint, and each is in the file once
        lines = [
            {k: (None if isinstance(x, float) and math.isnan(x) else x) for k, x in e.items()}
            for e in self.eval_history
        ]
        self.write_artifact("debate_evals.jsonl", "".join(json.dumps(line) + "\n" for line in lines))

    @override
    def game_state(self) -> dict[str, Any]:
        """The counters, the evaluation history and the judge's sampling state."""
        return {
            "counters": dict(self.counters),
            "eval_history": [dict(e) for e in self.eval_history],
            "judge": self.judge.state_dict(),
        }

    @override
    def load_game_state(self, state: dict[str, Any]) -> None:
        self.counters.update(state.get("counters", {}))
        self.eval_history = [dict(e) for e in state.get("eval_history", [])]
        self.judge.load_state_dict(state.get("judge", {}))
