"""Debate self-play (debate RLAIF): one policy plays Alice and Bob against a frozen judge, trained GRPO-style.

Per training step, for B problems (``protocol`` one of RLAIF-A, Debate-AB, Debate-ABA, RLVR):

1. **Fork after a prefix.** Each problem draws a trainable ply uniformly (:func:`modules.algorithms.debate.choose_fork_plies`);
   plies before it are sampled once, the forked ply ``G`` times, later plies once per branch. Every ply is ONE
   ``generate`` call for the whole batch (Alice's and Bob's replies come from the same weights, so one call per
   ply holds both roles' rows).
2. **Judge.** The ``B·G`` finished transcripts (visible parts only) go to the frozen judge in one call that
   returns ``num_votes`` votes each; Alice's share ``r`` of the parseable votes is her verdict, Bob's ``1 − r``.
3. **Rewards** of the forked plies (:func:`modules.algorithms.debate.ply_rewards`): verdict, word-limit penalty on critique
   and rebuttal, ``−1`` for an invalid thinking format, a negative override for a missing ``\\boxed{}``; RLVR
   uses the answer checker instead of the judge.
4. **Policy gradient on the forked ply only**, with the group baseline over the ``G`` branches
   (:func:`modules.algorithms.rl_losses.group_advantages`) and the clipped GRPO surrogate, optionally KL to the reference
   (the disabled adapter) (:func:`modules.algorithms.rl_losses.grpo_loss`). Tokens outside the forked ply are only context.

The single-player learning rate ``lr`` is used by RLAIF-A and RLVR; the debate protocols use
``lr · multi_player_lr_scale`` (paper: 1/4). Validation plays each held-out problem once per ply without forking,
logs Alice's accuracy (``val/correct``, ``val/total`` as sums, for :class:`callbacks.PeakCheckpoint`) and returns
the judge's verdicts and the truth for :class:`callbacks.MCCTracker` (the training steps return them too), and
appends one line per evaluation to ``debate_evals.jsonl`` in the log folder (read by :mod:`modules.evaluation.debate_compare`).

Bad input never crashes a run: a problem without a reference answer is played (the LLM-judge protocols do not use
ground truth) but left out of accuracy and MCC and counted (``train/no_reference``); RLVR gives its group reward 0
(advantage 0). Unparseable judge outputs are counted (``train/judge_unparseable``) and left out of the share; so are
garbage votes (``train/judge_invalid``) and the votes of a judge call past its ``timeout_s`` (``train/judge_timeouts``,
in transcripts; a transcript with no vote left gets the share 0.5, which moves neither player); empty
replies are counted (``train/empty_replies``) and scored as they are (an empty answer has no ``\\boxed{}``). A step
whose rewards or loss are not finite is skipped, logged and counted (:class:`modules.training.faults.NonFiniteGuard`); after
``max_consecutive_nonfinite`` in a row training stops.

Resume: sampling is seeded from ``(seed, batches_seen)`` (players and fork choice), and a checkpoint holds the
adapter, the counters, the judge's generator state, the non-finite counters and the running per-epoch averages
(``train/reward_epoch``, ``train/accuracy_epoch``: persistent torchmetrics), so a run resumed from a checkpoint, even
mid-epoch, draws and logs what the uninterrupted run would have.
"""

from __future__ import annotations

import json
import math
import os
import random
from contextlib import contextmanager
from typing import Any

import lightning as L
import torch
import torchmetrics
from lightning.pytorch.utilities import rank_zero_only

from callbacks.functional import matthews_corrcoef_from_counts
from modules.algorithms.debate import (
    PLAYER_OF_PLY,
    PLIES,
    PROMPTS,
    PROTOCOLS,
    Transcript,
    branch_rows,
    choose_fork_plies,
    fill_fields,
    fork_counts,
    ply_rewards,
    split_reply,
)
from modules.algorithms.rl_losses import group_advantages, grpo_loss
from modules.lm.policy_bank import (
    PolicyBank,
    Rollout,
    engine_grad_norm,
    fit_manual_backward_strategy,
    shard_for_strategy,
    sharded_strategy_kind,
)
from modules.scorers.judges import DebateJudge, ProgrammaticJudge
from modules.training.faults import NonFiniteGuard, require_trainable_tensors, reset_stale_epoch_metrics
from modules.training.timing import PhaseTimer

__all__ = ["DebateSelfPlay", "ForkedRollout"]

PLAYER = "policy"


class ForkedRollout:
    """What one forked step produced: the transcripts and, per ply, the rows that were forked there.

    Attributes:
        transcripts: ``[B·G]`` transcripts in ``[problem, branch]`` order.
        fork_plies: The forked ply of each problem.
        chunks: Per ply index, ``(rollout of the forked rows, their indices into transcripts)``; plies where no
            problem forked are absent.
        rollouts: The full generate output of every ply (for token counts and benchmarks).
    """

    def __init__(self, transcripts, fork_plies, chunks, rollouts) -> None:
        self.transcripts: list[Transcript] = transcripts
        self.fork_plies: list[int] = fork_plies
        self.chunks: dict[int, tuple[Rollout, list[int]]] = chunks
        self.rollouts: list[Rollout] = rollouts


def _derived_seed(*key: object) -> int:
    """A seed that depends only on ``key`` (unlike ``hash`` of a string, which changes between processes)."""
    return random.Random("/".join(map(str, key))).getrandbits(62)


def _rows(rollout: Rollout, idx: list[int]) -> Rollout:
    sel = torch.tensor(idx, dtype=torch.long, device=rollout.sequences.device)
    return Rollout(
        rollout.sequences[sel],
        rollout.attention_mask[sel],
        rollout.prompt_width,
        rollout.completion_mask[sel],
        [rollout.texts[i] for i in idx],
    )


class DebateSelfPlay(PhaseTimer, NonFiniteGuard, L.LightningModule):
    """One set of weights plays Alice and Bob in RLAIF-A, Debate-AB, Debate-ABA or RLVR against a frozen judge.

    Args:
        policy: Causal LM (hub name or local path) the player starts from; its frozen weights are the reference.
        protocol: ``rlaif_a``, ``debate_ab``, ``debate_aba`` or ``rlvr``.
        judge: The frozen judge; ``None`` builds a :class:`modules.scorers.judges.ProgrammaticJudge` with its defaults.
        players: ``"lora"`` (one adapter over the frozen base; the disabled adapter is the reference) or
            ``"separate"`` (full fine-tuning of a copy, a frozen copy as reference).
        group_size: ``G``, branches sampled at the forked ply (≥ 2; the group baseline needs two).
        lr: Single-player learning rate (RLAIF-A, RLVR).
        multi_player_lr_scale: Debate protocols train at ``lr`` times this (paper: 1/4).
        clip: ε of the ratio clipping (``None``: none; with one update per batch the ratio is 1).
        kl_beta: Weight of the k3 KL to the reference on the forked ply (0: no reference pass).
        updates_per_batch: Optimizer steps on each batch of rollouts (> 1 makes the ratio clipping act).
        scale_advantages: Divide group advantages by the group's std (GRPO) or not (mean baseline only).
        temperature: Sampling temperature of the players, also used for the log-probabilities.
        top_p: Nucleus mass.
        max_new_tokens: Tokens of Alice's answer turn.
        reply_max_new_tokens: Tokens of critique and rebuttal turns (``None``: ``max_new_tokens``).
        word_limit: Words allowed in critique and rebuttal, stated in the prompt and enforced by the penalty
            (paper: 50, 100 or 150; ``None``: no limit).
        word_penalty_coef: Penalty per word over the limit.
        missing_answer_reward: Alice's reward when her answer has no ``\\boxed{}`` (strictly negative).
        format_reward: Reward of a ply with an invalid thinking format (paper: −1).
        think_open: Opening delimiter of the hidden chain of thought (``""``: no hidden part).
        think_close: Closing delimiter.
        require_thinking: Whether a reply without a thinking block has an invalid format.
        system_prompt: System message of every turn (``None``: none).
        alice_prompt: Alice's answer prompt: a name in :data:`modules.algorithms.debate.PROMPTS` (``alice``,
            ``alice_misaligned``) or a template with ``{problem}``.
        bob_prompt: Bob's prompt: ``bob_honest_broker``, ``bob_incentive_aligned``, ``bob_misaligned`` or a template
            with ``{problem}`` and ``{solution}``.
        rebuttal_prompt: Alice's rebuttal prompt: ``alice_rebuttal`` or a template with ``{critique}``.
        trainable_plies: Plies that may be forked (``None``: all plies of the protocol), e.g. ``["critique"]``.
        grad_clip: Gradient norm clip.
        max_consecutive_nonfinite: Stop after this many skipped steps in a row.
        seed: Seed of fork choice and sampling (per batch, so resumes draw the same).
        lora_r: LoRA rank.
        lora_alpha: LoRA alpha.
        lora_target_modules: Modules to adapt.
        dtype: Policy weights dtype.
        gradient_checkpointing: Activation checkpointing of the policy.
        trust_remote_code: Off unless turned on.
        max_prompt_tokens: Prompt tokens kept (cut from the left, counted).
        logprob_micro_batch: Sequences per log-probability forward (0: all at once).
    """

    def __init__(
        self,
        policy: str,
        protocol: str = "debate_ab",
        judge: DebateJudge | None = None,
        players: str = "lora",
        group_size: int = 4,
        lr: float = 1e-4,
        multi_player_lr_scale: float = 0.25,
        clip: float | None = 0.2,
        kl_beta: float = 0.0,
        updates_per_batch: int = 1,
        scale_advantages: bool = True,
        temperature: float = 0.6,
        top_p: float = 1.0,
        max_new_tokens: int = 512,
        reply_max_new_tokens: int | None = None,
        word_limit: int | None = 100,
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
        grad_clip: float = 1.0,
        max_consecutive_nonfinite: int = 10,
        seed: int = 0,
        lora_r: int = 16,
        lora_alpha: int = 32,
        lora_target_modules: list[str] | None = None,
        dtype: str = "float32",
        gradient_checkpointing: bool = False,
        trust_remote_code: bool = False,
        max_prompt_tokens: int = 2048,
        logprob_micro_batch: int = 0,
    ) -> None:
        super().__init__()
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        if group_size < 2:
            raise ValueError(f"group_size (G) must be at least 2 for the group baseline, got {group_size}")
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        if lr <= 0 or multi_player_lr_scale <= 0:
            raise ValueError(f"lr and multi_player_lr_scale must be positive, got {lr}, {multi_player_lr_scale}")
        if updates_per_batch < 1:
            raise ValueError(f"updates_per_batch must be at least 1, got {updates_per_batch}")
        if missing_answer_reward >= 0:
            raise ValueError(f"missing_answer_reward must be strictly negative, got {missing_answer_reward}")
        if kl_beta < 0:
            raise ValueError(f"kl_beta must be >= 0, got {kl_beta}")
        plies = PLIES[protocol]
        trainable = list(plies) if trainable_plies is None else list(trainable_plies)
        unknown = [p for p in trainable if p not in plies]
        if unknown or not trainable:
            raise ValueError(f"trainable_plies: {trainable} must be a non-empty subset of {protocol}'s plies {plies}")
        self.templates = {
            "answer": self._template("alice_prompt", alice_prompt, ["{problem}"]),
            "critique": self._template("bob_prompt", bob_prompt, ["{problem}", "{solution}"]),
            "rebuttal": self._template("rebuttal_prompt", rebuttal_prompt, ["{critique}"]),
        }
        self.save_hyperparameters(ignore=["judge"])
        self.automatic_optimization = False
        self.plies = plies
        self.trainable = [plies.index(p) for p in trainable]
        self.bank = PolicyBank(
            policy,
            players=(PLAYER,),
            mode=players,
            lora_r=lora_r,
            lora_alpha=lora_alpha,
            lora_target_modules=lora_target_modules,
            dtype=dtype,
            gradient_checkpointing=gradient_checkpointing,
            trust_remote_code=trust_remote_code,
            max_prompt_tokens=max_prompt_tokens,
        )
        self.judge = judge if judge is not None else ProgrammaticJudge()
        self.strict_loading = False  # the frozen base and the judge are not stored; on_load_checkpoint checks the rest
        self.init_nonfinite_guard(max_consecutive_nonfinite)
        # the epoch's running averages travel in checkpoints, so a run resumed mid-epoch reports the whole epoch
        self.epoch_reward = torchmetrics.MeanMetric()
        self.epoch_accuracy = torchmetrics.MeanMetric()
        for metric in (self.epoch_reward, self.epoch_accuracy):
            metric.persistent(True)
        self.counters = {
            "batches_seen": 0,
            "no_reference": 0,
            "judge_unparseable": 0,
            "judge_timeouts": 0,
            "judge_invalid": 0,
            "empty_replies": 0,
        }
        self.phase_times: dict[str, float] = {}
        self._val: dict[str, float] = {}
        self.eval_history: list[dict[str, float]] = []

    @staticmethod
    def _template(field: str, value: str, needs: list[str]) -> str:
        template = PROMPTS.get(value, value)
        missing = [k for k in needs if k not in template]
        if missing:
            raise ValueError(
                f"{field}: {value!r} is neither a prompt name ({sorted(PROMPTS)}) nor a template containing {missing}"
            )
        return template

    @property
    def learning_rate(self) -> float:
        """The rate in use: ``lr`` for one player, ``lr · multi_player_lr_scale`` for the debates."""
        hp = self.hparams
        return hp.lr * (hp.multi_player_lr_scale if self.hparams.protocol in ("debate_ab", "debate_aba") else 1.0)

    # ------------------------------------------------------------------------------------------------ playing
    def render(self, ply: str, transcript: Transcript) -> str:
        """The chat-formatted prompt of ``ply`` given the transcript so far (visible parts only)."""
        hp = self.hparams
        fields = transcript.prompt_fields(hp.word_limit, hp.think_open, hp.think_close)
        return self.bank.chat(hp.system_prompt, fill_fields(self.templates[ply], **fields))

    def _split(self, text: str):
        hp = self.hparams
        return split_reply(text, hp.think_open, hp.think_close, hp.require_thinking)

    def play(
        self, problems: list[str], references: list[str | None], group_size: int, fork_plies: list[int] | None = None
    ) -> ForkedRollout:
        """Play every problem to the verdict, forking ``group_size`` branches at ``fork_plies`` (one per problem).

        ``fork_plies=None`` plays one transcript per problem with one sample per ply (evaluation; ``group_size``
        must then be 1). One ``generate`` call per ply holds every row of that ply, Alice's and Bob's alike.
        """
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
            tokens = hp.max_new_tokens if ply == "answer" else (hp.reply_max_new_tokens or hp.max_new_tokens)
            with self._timed(f"generate_{ply}"):
                out = self.bank.generate(PLAYER, prompts, 1, hp.temperature, hp.top_p, tokens)
            rollouts.append(out)
            rows = branch_rows(counts, g) if g > 1 else list(range(b))
            replies = [self._split(text) for text in out.texts]
            for i in range(b):
                for k in range(g):
                    branches[i][k].replies.append(replies[rows[i * g + k]])
            forked = [i for i in range(b) if fork_plies[i] == j]
            if forked:
                flat = [i * g + k for i in forked for k in range(g)]
                chunks[j] = (_rows(out, [rows[x] for x in flat]), flat)
        transcripts = [t for per_problem in branches for t in per_problem]
        return ForkedRollout(transcripts, list(fork_plies), chunks, rollouts)

    def rewards(self, transcripts: list[Transcript], shares: list[float]) -> list[list]:
        """:func:`modules.algorithms.debate.ply_rewards` of every transcript with this module's settings."""
        hp = self.hparams
        return [
            ply_rewards(
                t,
                s,
                word_limit=hp.word_limit,
                word_penalty_coef=hp.word_penalty_coef,
                missing_answer_reward=hp.missing_answer_reward,
                format_reward=hp.format_reward,
            )
            for t, s in zip(transcripts, shares)
        ]

    def policy_loss(
        self,
        rollout: ForkedRollout,
        advantages: torch.Tensor,
        old: dict[int, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[int, torch.Tensor]]:
        """GRPO loss on the forked plies only: per ply, the forked rows' completion tokens; weighted by rows.

        Returns ``(loss, stats, token_logprobs per ply)`` (the latter detached, as the next update's ``old``).
        """
        hp = self.hparams
        n = sum(len(idx) for _, idx in rollout.chunks.values())
        loss = torch.zeros((), device=self.device)
        stats = {"kl": 0.0, "clip_fraction": 0.0}
        current = {}
        for j, (chunk, idx) in rollout.chunks.items():
            lp = self.bank.token_logprobs(PLAYER, chunk, hp.temperature, hp.logprob_micro_batch)
            ref = None
            if hp.kl_beta > 0:
                with torch.no_grad():
                    ref = self.bank.token_logprobs(None, chunk, hp.temperature, hp.logprob_micro_batch)
            mask = chunk.completion_mask.to(lp.device)
            adv = advantages[torch.tensor(idx, device=advantages.device)].to(lp.device)
            part, st = grpo_loss(lp, mask, adv, None if old is None else old[j], ref, clip=hp.clip, beta=hp.kl_beta)
            w = len(idx) / n
            loss = loss + w * part
            for k in stats:
                stats[k] += w * float(st[k])
            current[j] = lp.detach()
        return loss, {k: torch.tensor(v) for k, v in stats.items()}, current

    # ------------------------------------------------------------------------------------------------ training
    @contextmanager
    def _seeded(self, *key: int) -> Any:
        """Seed the players' sampling from ``(seed, *key)`` without touching the caller's global RNG state."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(_derived_seed(self.hparams.seed, "sample", *key))
            yield

    def _judge(self, transcripts: list[Transcript]) -> tuple[list[float], dict[str, int]]:
        votes = self.judge.vote(transcripts)
        counts = {"judge_unparseable": votes.unparseable, "judge_timeouts": votes.timed_out}
        counts["judge_invalid"] = votes.invalid
        return votes.shares, counts

    def on_train_epoch_start(self) -> None:  # noqa: D102
        reset_stale_epoch_metrics(self.trainer, [self.epoch_reward, self.epoch_accuracy])

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, torch.Tensor] | None:  # noqa: D102
        hp = self.hparams
        opt = self.optimizers()
        problems, refs = list(batch["prompt"]), list(batch["reference"])
        b, g = len(problems), hp.group_size
        step_key = self.counters["batches_seen"]
        self.counters["batches_seen"] += 1
        self.phase_times = {}
        forks = choose_fork_plies(b, self.trainable, random.Random(_derived_seed(hp.seed, "fork", step_key)))
        with self._seeded(0, step_key):
            roll = self.play(problems, refs, g, forks)
        transcripts = roll.transcripts
        with self._timed("judge"):
            shares, judge_counts = self._judge(transcripts)
        rewards = self.rewards(transcripts, shares)
        forked = [rewards[i][forks[i // g]] for i in range(b * g)]
        r = torch.tensor([x.reward for x in forked], dtype=torch.float32, device=self.device)
        metrics = self._rollout_metrics("train", transcripts, shares, judge_counts)
        metrics.update(self._forked_metrics(transcripts, forks, forked))
        skipped = dict.fromkeys(("train/loss", "train/kl", "train/clip_fraction", "train/grad_norm"), math.nan)
        streak = self.consecutive_nonfinite
        if not self.check_finite(r, "rewards"):  # same decision on every rank: nobody steps
            self.log_dict({**metrics, **skipped}, batch_size=b)
            return self._mcc_outputs(transcripts, shares)
        self.consecutive_nonfinite = streak  # the streak ends only when the loss is finite too
        adv = group_advantages(r, g, scale=hp.scale_advantages)
        old = None
        for update in range(hp.updates_per_batch):
            with self._timed("logprob"):
                loss, stats, current = self.policy_loss(roll, adv, old)
            if not self.check_finite(loss.detach(), "losses"):  # e.g. an infinite log-probability
                if update == 0:
                    self.log_dict({**metrics, **skipped}, batch_size=b)
                    return self._mcc_outputs(transcripts, shares)
                break  # the earlier updates of this batch stand; the next batch starts fresh
            old = current if old is None else old
            with self._timed("backward"):
                opt.zero_grad()
                self.manual_backward(loss)
            with self._timed("optimizer"):
                deepspeed = sharded_strategy_kind(self.trainer.strategy) == "DeepSpeedStrategy"
                if not deepspeed:  # DeepSpeed's engine clips in step (see fit_manual_backward_strategy)
                    norm = torch.nn.utils.clip_grad_norm_(self.bank.player_parameters(PLAYER), hp.grad_clip)
                opt.step()
                if deepspeed:
                    norm = engine_grad_norm(self.trainer.strategy)
        self._update_epoch_averages(r, transcripts)
        metrics.update(
            {
                "train/loss": float(loss.detach()),
                "train/kl": float(stats["kl"]),
                "train/clip_fraction": float(stats["clip_fraction"]),
                "train/grad_norm": float(norm),
                "train/advantage_abs": float(adv.abs().mean()),
            }
        )
        self.phase_times["generated_tokens"] = float(sum(int(x.completion_mask.sum()) for x in roll.rollouts))
        metrics.update({f"time/{k}": float(v) for k, v in self.phase_times.items()})
        self.log_dict(metrics, batch_size=b)
        return self._mcc_outputs(transcripts, shares)

    def _mcc_outputs(self, transcripts: list[Transcript], shares: list[float]) -> dict[str, torch.Tensor]:
        """Verdicts (Alice's vote share; MCCTracker accepts above 0.5) and truth, for rows with a reference."""
        keep = [i for i, t in enumerate(transcripts) if t.correct is not None]
        return {
            "judge": torch.tensor([shares[i] for i in keep], dtype=torch.float32, device=self.device),
            "truth": torch.tensor([bool(transcripts[i].correct) for i in keep], dtype=torch.long, device=self.device),
        }

    def _rollout_metrics(
        self, stage: str, transcripts: list[Transcript], shares: list[float], judge_counts: dict[str, int]
    ) -> dict[str, float]:
        n = len(transcripts)
        known = [t.correct for t in transcripts if t.correct is not None]
        no_ref = n - len(known)
        empty = sum(r.empty for t in transcripts for r in t.replies)
        if stage == "train":
            self.counters["no_reference"] += no_ref
            for key, value in judge_counts.items():
                self.counters[key] = self.counters.get(key, 0) + value
            self.counters["empty_replies"] += empty
        out = {
            f"{stage}/verdict_share": sum(shares) / n,
            **{f"{stage}/{key}": float(value) for key, value in judge_counts.items()},
            f"{stage}/empty_replies": float(empty),
            f"{stage}/no_reference": float(no_ref),
            f"{stage}/missing_answer": sum(t.final_answer is None for t in transcripts) / n,
            f"{stage}/format_invalid": sum(not r.format_ok for t in transcripts for r in t.replies)
            / max(1, sum(len(t.replies) for t in transcripts)),
        }
        if known:
            out[f"{stage}/accuracy"] = sum(known) / len(known)
        elif stage == "train":
            out["train/accuracy"] = math.nan  # every step logs every key (Lightning repeats a missing one's last value)
        out.update({f"{stage}/judge_{k}": float(v) for k, v in self.judge.stats(transcripts).items()})
        for j, ply in enumerate(self.plies):
            out[f"{stage}/words_{ply}"] = sum(t.replies[j].words for t in transcripts) / n
        if self.hparams.protocol in ("debate_ab", "debate_aba"):
            out[f"{stage}/bob_win_rate"] = sum(s < 0.5 for s in shares) / n
        return out

    def _forked_metrics(self, transcripts, forks, forked) -> dict[str, float]:
        g = self.hparams.group_size
        out: dict[str, float] = {"train/reward": sum(x.reward for x in forked) / len(forked)}
        for who in sorted({PLAYER_OF_PLY[self.plies[j]] for j in self.trainable}):  # the roles that may fork
            rows = [x for i, x in enumerate(forked) if PLAYER_OF_PLY[self.plies[forks[i // g]]] == who]
            # NaN when no problem forked at this role's plies: Lightning would repeat the last value of a missing key
            out[f"train/reward_{who}"] = sum(x.reward for x in rows) / len(rows) if rows else math.nan
        penalised = [x for i, x in enumerate(forked) if self.plies[forks[i // g]] != "answer"]
        if any(self.plies[j] != "answer" for j in self.trainable):  # critique or rebuttal may fork
            out["train/word_penalty"] = (
                sum(x.word_penalty for x in penalised) / len(penalised) if penalised else math.nan
            )
        out["train/format_override"] = sum(x.format_override for x in forked) / len(forked)
        out["train/missing_answer_override"] = sum(
            x.missing_answer for i, x in enumerate(forked) if self.plies[forks[i // g]] != "critique"
        ) / max(1, sum(self.plies[forks[i // g]] != "critique" for i in range(len(forked))))
        out["train/fork_alice_share"] = sum(PLAYER_OF_PLY[self.plies[k]] == "alice" for k in forks) / len(forks)
        return out

    def _update_epoch_averages(self, rewards: torch.Tensor, transcripts: list[Transcript]) -> None:
        """Feed the persistent per-epoch means (forked-ply reward; Alice's accuracy on referenced rows)."""
        self.epoch_reward.update(rewards)
        self.log("train/reward_epoch", self.epoch_reward, on_step=False, on_epoch=True, batch_size=rewards.numel())
        known = [float(t.correct) for t in transcripts if t.correct is not None]
        if known:
            self.epoch_accuracy.update(torch.tensor(known, dtype=torch.float32, device=self.device))
            self.log("train/accuracy_epoch", self.epoch_accuracy, on_step=False, on_epoch=True, batch_size=len(known))

    def configure_model(self) -> None:
        """Under FSDP2 (``ModelParallelStrategy``) shard the policy over the data-parallel mesh; elsewhere nothing."""
        shard_for_strategy(self, self.bank, "debate self-play")

    def setup(self, stage: str) -> None:  # noqa: D102
        if stage == "fit":  # FSDP refused; DeepSpeed clips by grad_clip in its engine
            fit_manual_backward_strategy(self.trainer.strategy, "debate self-play", self.hparams.grad_clip)
        # ZeRO-3: every ply's generate call gathers the policy once, not once per token
        self.bank.use_strategy(self.trainer.strategy)

    def configure_optimizers(self):  # noqa: D102
        return torch.optim.AdamW(self.bank.player_parameters(PLAYER), lr=self.learning_rate, weight_decay=0.0)

    def on_fit_start(self) -> None:  # noqa: D102
        self.judge.to(self.device)

    # ------------------------------------------------------------------------------------------------ evaluation
    def _evaluate(self, stage: str, batch: dict[str, Any], batch_idx: int) -> dict[str, torch.Tensor]:
        problems, refs = list(batch["prompt"]), list(batch["reference"])
        with self._seeded(1, self.counters["batches_seen"], batch_idx):
            roll = self.play(problems, refs, 1, None)
        transcripts = roll.transcripts
        shares, judge_counts = self._judge(transcripts)
        metrics = self._rollout_metrics(stage, transcripts, shares, judge_counts)
        rewards = self.rewards(transcripts, shares)
        metrics[f"{stage}/reward"] = sum(r[0].reward for r in rewards) / len(rewards)
        b = len(problems)
        self.log_dict(metrics, batch_size=b, sync_dist=True)
        known = [t.correct for t in transcripts if t.correct is not None]
        self.log(f"{stage}/correct", float(sum(known)), reduce_fx="sum", sync_dist=True, batch_size=1)
        self.log(f"{stage}/total", float(len(known)), reduce_fx="sum", sync_dist=True, batch_size=1)
        out = self._mcc_outputs(transcripts, shares)
        if stage == "val":
            acc = self._val
            for key, v in (("successes", sum(known)), ("trials", len(known))):
                acc[key] = acc.get(key, 0.0) + float(v)
            verdict = out["judge"] > 0.5
            truth = out["truth"].bool()
            for key, v in (
                ("tp", verdict & truth),
                ("fp", verdict & ~truth),
                ("tn", ~verdict & ~truth),
                ("fn", ~verdict & truth),
            ):
                acc[key] = acc.get(key, 0.0) + float(v.sum())
            acc["reward_sum"] = acc.get("reward_sum", 0.0) + metrics[f"{stage}/reward"] * b
            acc["n"] = acc.get("n", 0.0) + b
        return out

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, torch.Tensor]:  # noqa: D102
        return self._evaluate("val", batch, batch_idx)

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, torch.Tensor]:  # noqa: D102
        return self._evaluate("test", batch, batch_idx)

    def on_validation_epoch_start(self) -> None:  # noqa: D102
        self._val = {}

    def on_validation_epoch_end(self) -> None:  # noqa: D102
        if self.trainer.sanity_checking or not self._val:
            return
        keys = sorted(self._val)
        totals = self.all_gather(torch.tensor([self._val[k] for k in keys], dtype=torch.float64, device=self.device))
        totals = totals.reshape(-1, len(keys)).sum(0).tolist()
        v = dict(zip(keys, totals))
        record = {
            "step": int(self.global_step),
            "batches_seen": int(self.counters["batches_seen"]),
            "successes": v["successes"],
            "trials": v["trials"],
            "accuracy": v["successes"] / v["trials"] if v["trials"] else float("nan"),
            "mcc": matthews_corrcoef_from_counts(v["tp"], v["fp"], v["tn"], v["fn"]),
            "tp": v["tp"],
            "fp": v["fp"],
            "tn": v["tn"],
            "fn": v["fn"],
            "reward": v["reward_sum"] / v["n"] if v["n"] else float("nan"),
            "protocol": self.hparams.protocol,
        }
        self.eval_history.append(record)
        self._write_eval(record, self.trainer.log_dir or self.trainer.default_root_dir)

    @rank_zero_only
    def _write_eval(self, record: dict[str, Any], log_dir: str) -> None:
        if self.trainer.fast_dev_run:
            return
        os.makedirs(log_dir, exist_ok=True)
        with open(os.path.join(log_dir, "debate_evals.jsonl"), "a") as f:
            f.write(json.dumps({k: (None if isinstance(x, float) and math.isnan(x) else x) for k, x in record.items()}))
            f.write("\n")

    # ------------------------------------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the adapter (or trained copy), counters, evaluation history and the judge's sampling state."""
        sd = checkpoint["state_dict"]
        keep = {f"bank.{n}" for n, p in self.bank.named_parameters() if p.requires_grad}
        for name in list(sd):
            if name not in keep and not name.startswith(("epoch_reward.", "epoch_accuracy.")):
                del sd[name]
        checkpoint["debate_state"] = {
            "counters": dict(self.counters),
            "nonfinite": self.nonfinite_state(),
            "eval_history": [dict(e) for e in self.eval_history],
            "judge": self.judge.state_dict(),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint missing a trainable tensor; restore counters and the judge's sampling state."""
        trainable = {f"bank.{n}" for n, p in self.bank.named_parameters() if p.requires_grad}
        require_trainable_tensors(checkpoint, trainable)
        state = checkpoint.get("debate_state", {})
        self.counters.update(state.get("counters", {}))
        self.load_nonfinite_state(state.get("nonfinite"))
        self.eval_history = [dict(e) for e in state.get("eval_history", [])]
        self.judge.load_state_dict(state.get("judge", {}))
