"""Multi-LLM Stackelberg alignment (Hahn et al.): an EXP3 leader, a pool of followers that duel, judge and learn.

An EXP3 leader picks instructions; the pool's followers duel on them, judge each other and learn by DPO or GRPO.

One training batch is one game iteration (the datamodule yields the whole instruction pool once per iteration,
``iterations_per_epoch`` times per epoch; the paper's one iteration per epoch by default):

1. **Leader** (:class:`modules.algorithms.exp3.Exp3`, or uniform for the SPARTA baseline): D duel instructions drawn with
   replacement from its distribution.
2. **Matching** (:func:`modules.algorithms.pool.sample_opponent`): for each duel a uniformly drawn combatant meets an opponent
   chosen by reputation-based soft matching, target gap annealed 1 → 0, 20% uniform, 3 candidates.
3. **Responses**: each combatant answers its duels' instructions (temperature 0.7, top-p 0.9; G = 4 rollouts per
   combatant under GRPO, one under DPO), one batched ``generate`` per model.
4. **Peer judging**: every pool member outside the duel scores every response of the duel 1–10, greedily. In
   ``judge_mode="generate"`` (the paper) the answer is parsed (:func:`modules.algorithms.pool.parse_judgement`: JSON, regex,
   else 5.0, counted in ``judge/parse_failures``); ``judge_mode="constrained"`` instead reads the judge's
   distribution over the ten allowed answers and takes its mean (no text to parse: for models too small to write
   JSON, such as the CPU configs' tiny policy). An empty response is not shown to the judges: it scores 1.0 (the
   bottom of the scale) from every judge and is counted in ``train/empty_responses``.
5. **Aggregation**: a response's score is the mean of its judges' scores weighted by their current Elo reputations
   (:meth:`callbacks.EloRating.judge_weights`); each judge's verdict (1/½/0 on the two sides' mean scores) is
   reported to the :class:`callbacks.EloRating` callback, which applies the adapted Elo rule after the batch.
6. **Leader update**: reward ``0.3 r_diff + 0.7 r_pref`` of each duel's two scores
   (:func:`modules.algorithms.exp3.composite_reward`, ideal gap annealed 0.6 → 0.15), importance-weighted EXP3 update.
7. **Followers**: DPO (β 0.1) on the non-tied duels, the model at the start of the iteration (the previous
   iteration's model) as reference, effective batch 16; or GRPO with the rollouts' peer scores as rewards
   (group advantages over the G rollouts, clip 0.2, β 0). One epoch over the iteration's data, AdamW per follower.

Baselines by configuration: ``leader="uniform"`` is SPARTA (same duels, opponents and reputations, uniform
instructions); ``num_players=1`` is self-rewarding (one model answers twice and judges itself; no reputations).

Validation and test: each model answers greedily; accuracy by exact match of the final answer
(:func:`modules.algorithms.pool.final_answer`) per model (``val/acc/<model>``) and their macro-average (``val/acc_macro``).
At the end of fit the figures of §5 are written beside the logs and to TensorBoard: ``instruction_weights.png``
(top and bottom five instructions' weight relative to uniform, Fig. 5), ``reputations.png`` (Fig. 3) and
``opponent_selection.png`` (Fig. 4), with every trajectory in ``pool_history.json``.

Several processes (DDP, ``configs/overlays/ddp.yaml``) play one game together and split its work: every rank draws
the same duels (the leader's and the matching's generator is identical on all of them), rank ``r`` generates and
judges the duels ``d`` with ``d % world == r`` and reports their Elo verdicts, and the responses and scores are
gathered (``all_gather_object``: texts and floats) so that every rank takes the same leader update and forms the
same DPO pairs and GRPO batches. Each follower batch is split across the ranks (contiguous shares of its pairs, or
each rank's own rollouts), its loss divided by the *global* batch size, and the adapters' gradients are summed
over the ranks (one ``all_reduce`` per follower step; the DDP wrapper's own hooks are bypassed with ``no_sync``,
since one training step makes many backward passes over different adapters): each step is the full batch's, and
the adapters stay identical on every rank (checked after every iteration; a divergence raises).
Only the duels' order within an Elo flush differs from one process (rank 0's first). FSDP and DeepSpeed are refused:
they shard the base the ranks must each run whole, and the adapters are small enough to replicate.

Bad input: a pool of two models (no non-competing judge) is refused; a judge whose answers never parse scores
5.0 every time (the paper's rule), is counted per judge (``judge/parse_failure_rate/<model>``) and warned about.
Non-finite values (:class:`modules.training.faults.NonFiniteGuard`): a non-finite follower loss skips that follower's update;
a non-finite peer score (the judges' output, i.e. the rewards of the leader and of GRPO) skips the whole iteration
(no reputation, leader or follower update). Each skip is warned about and counted (``train/nonfinite_skipped``);
``max_consecutive_nonfinite`` skips in a row (a good follower step ends a streak) stop training with a clear error and
the last periodic checkpoint intact.

Per-epoch averages (``leader/reward_epoch``, ``duel/score_gap_epoch``, ``follower/loss_epoch``: the mean over the
epoch's iterations, or its follower updates) are persistent torchmetrics: their running sums travel in checkpoints,
so a run resumed mid-epoch reports the whole epoch. A checkpoint holds the adapters, every optimizer, the leader's
weights, the game iteration, the module's generator, the histories and counters (``pool_game``); the Elo reputations
are the callback's. The DPO reference (the model at the start of an iteration) is computed within the iteration's
batch, so no snapshot outlives a batch.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from contextlib import nullcontext
from functools import partial
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor, nn
from torchmetrics.aggregation import MeanMetric

from modules.algorithms.answers import answers_match
from modules.algorithms.exp3 import SCORE_MAX, SCORE_MIN, Exp3, composite_reward, linear_schedule
from modules.algorithms.pool import (
    DEFAULT_SCORE,
    final_answer,
    judge_verdicts,
    opponent_selection_weights,
    parse_judgement,
    peer_score_advantages,
    preference_pairs,
    reputation_weighted_mean,
    sample_opponent,
)
from modules.algorithms.rl_losses import dpo_loss, grpo_loss
from modules.lm.policy_bank import PolicyBank, Rollout
from modules.training.faults import NonFiniteGuard, require_trainable_tensors, reset_stale_epoch_metrics

__all__ = ["DEFAULT_JUDGE_TEMPLATE", "StackelbergPool"]

DEFAULT_SYSTEM = "You are a helpful assistant."
# App. G: the judge sees the question and one response and answers a 1-10 score as JSON.
DEFAULT_JUDGE_TEMPLATE = (
    "Please act as an impartial judge and evaluate the quality of the response provided by an AI assistant to the "
    "question below. Consider correctness, helpfulness and clarity. Rate the response on a scale of 1 to 10 and "
    'answer only with a JSON object of the form {"score": <integer from 1 to 10>}.\n\n'
    "[Question]\n{prompt}\n\n[Response]\n{response}"
)


def _fill(template: str, prompt: str, response: str) -> str:
    # one pass over the template, so text in the prompt is never re-read as a field
    return re.sub(r"\{(prompt|response)\}", lambda m: {"prompt": prompt, "response": response}[m.group(1)], template)


class StackelbergPool(NonFiniteGuard, L.LightningModule):
    """A pool of follower LMs trained by multi-LLM Stackelberg alignment (module docstring).

    Args:
        policy: Base causal LM (hub name or local path) of the shared-base pool: ``num_players`` LoRA adapters over
            it, switched without copying weights. Ignored when ``models`` is given.
        num_players: m, the pool size with a shared base (≥ 3, or 1 for the self-rewarding baseline).
        models: Separate pool members, one HF name or path each (a frozen copy with its own LoRA adapter each);
            overrides ``policy``/``num_players``.
        algorithm: ``"dpo"`` or ``"grpo"`` follower training.
        leader: ``"exp3"`` (Stackelberg) or ``"uniform"`` (SPARTA baseline).
        duels_per_iteration: D, duels drawn per iteration (paper: 64).
        num_iterations: Iterations the annealing schedules span (paper: 8); set ``trainer.max_epochs`` times the
            datamodule's ``iterations_per_epoch`` to match.
        gamma: EXP3 exploration rate γ (also the probability floor γ/K).
        difficulty_weight: λ1 of the composite reward.
        preference_weight: λ2.
        min_score: Threshold of the difficulty reward.
        reward_bandwidth: Width of the preference reward's Gaussian bump.
        ideal_gap_start: Ideal normalised score gap at the first iteration.
        ideal_gap_end: At the last iteration.
        match_gap_start: Target normalised reputation gap of opponent matching at the first iteration.
        match_gap_end: At the last iteration.
        match_bandwidth: Width of the matching kernel.
        uniform_opponent_share: Share of duels with a uniformly random opponent.
        num_candidates: Candidate opponents each combatant draws.
        temperature: Response sampling temperature.
        top_p: Response nucleus mass.
        max_new_tokens: Tokens per response.
        system_prompt: System message of responses and evaluation answers.
        judge_template: Judge prompt with ``{prompt}`` and ``{response}``.
        judge_mode: ``"generate"`` (greedy answer, parsed) or ``"constrained"`` (mean over the ten allowed answers).
        judge_prefill: Text the judge's answer is started with (e.g. ``{"score": ``), also prepended before parsing.
        judge_max_new_tokens: Tokens per generated judgement.
        lr: Learning rate of every follower (paper: 1e-6).
        dpo_beta: β of DPO.
        dpo_pairs: ``"all"`` (every follower learns from every non-tied pair) or ``"own"`` (from its own duels).
        batch_size: Effective batch of a follower update (pairs for DPO, rollouts for GRPO; paper: 16).
        micro_batch: Sequences per forward inside a batch (0: the whole batch); gradients are accumulated.
        grpo_rollouts: G, rollouts per combatant and duel under GRPO (paper: 4).
        grpo_beta: KL coefficient of GRPO (paper: 0; > 0 uses the disabled adapter as reference).
        grpo_clip: Ratio clip of GRPO.
        grad_clip: Per-follower gradient norm clip (``None``: none).
        eval_max_new_tokens: Tokens per evaluation answer (greedy).
        lora_r: LoRA rank.
        lora_alpha: LoRA alpha.
        lora_target_modules: Modules to adapt (``None``: peft's default).
        dtype: Weights dtype.
        gradient_checkpointing: Activation checkpointing.
        trust_remote_code: Off unless turned on.
        max_prompt_tokens: Prompts longer than this are cut from the left (counted).
        seed: Seed of the leader's and the matching's generator (saved in checkpoints).
        max_consecutive_nonfinite: Stop after this many skipped updates in a row (module docstring).
    """

    def __init__(
        self,
        policy: str | None = None,
        num_players: int = 3,
        models: list[str] | None = None,
        algorithm: str = "dpo",
        leader: str = "exp3",
        duels_per_iteration: int = 64,
        num_iterations: int = 8,
        gamma: float = 0.2,
        difficulty_weight: float = 0.3,
        preference_weight: float = 0.7,
        min_score: float = 3.0,
        reward_bandwidth: float = 0.15,
        ideal_gap_start: float = 0.6,
        ideal_gap_end: float = 0.15,
        match_gap_start: float = 1.0,
        match_gap_end: float = 0.0,
        match_bandwidth: float = 0.25,
        uniform_opponent_share: float = 0.2,
        num_candidates: int = 3,
        temperature: float = 0.7,
        top_p: float = 0.9,
        max_new_tokens: int = 512,
        system_prompt: str = DEFAULT_SYSTEM,
        judge_template: str = DEFAULT_JUDGE_TEMPLATE,
        judge_mode: str = "generate",
        judge_prefill: str = "",
        judge_max_new_tokens: int = 32,
        lr: float = 1e-6,
        dpo_beta: float = 0.1,
        dpo_pairs: str = "all",
        batch_size: int = 16,
        micro_batch: int = 0,
        grpo_rollouts: int = 4,
        grpo_beta: float = 0.0,
        grpo_clip: float = 0.2,
        grad_clip: float | None = 1.0,
        eval_max_new_tokens: int = 256,
        lora_r: int = 16,
        lora_alpha: int = 32,
        lora_target_modules: list[str] | None = None,
        dtype: str = "float32",
        gradient_checkpointing: bool = False,
        trust_remote_code: bool = False,
        max_prompt_tokens: int = 1024,
        seed: int = 0,
        max_consecutive_nonfinite: int = 10,
    ) -> None:
        super().__init__()
        m = len(models) if models else num_players
        if m == 2 or m < 1:
            raise ValueError(
                f"num_players/models: a pool of {m} model(s) has no non-competing judge for its duels; use at least 3 "
                "(or 1 for the self-rewarding baseline, where the model judges itself)"
            )
        if not models and policy is None:
            raise ValueError("policy: give a base model for the shared-base pool, or a list of `models`")
        checks = {
            "algorithm": (algorithm, ("dpo", "grpo")),
            "leader": (leader, ("exp3", "uniform")),
            "judge_mode": (judge_mode, ("generate", "constrained")),
            "dpo_pairs": (dpo_pairs, ("all", "own")),
        }
        for field, (value, allowed) in checks.items():
            if value not in allowed:
                raise ValueError(f"{field} must be one of {allowed}, got {value!r}")
        if duels_per_iteration < 1 or batch_size < 1 or num_iterations < 1:
            raise ValueError("duels_per_iteration, batch_size and num_iterations must be positive")
        if algorithm == "grpo" and grpo_rollouts < 2:
            raise ValueError(f"grpo_rollouts must be at least 2 for a group baseline, got {grpo_rollouts}")
        if "{prompt}" not in judge_template or "{response}" not in judge_template:
            raise ValueError("judge_template must contain {prompt} and {response}")
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        self.save_hyperparameters()
        self.init_nonfinite_guard(max_consecutive_nonfinite)
        self.automatic_optimization = False
        self.strict_loading = False  # frozen bases are not stored; on_load_checkpoint checks the adapters
        bank_kw = dict(
            lora_r=lora_r,
            lora_alpha=lora_alpha,
            lora_target_modules=lora_target_modules,
            dtype=dtype,
            gradient_checkpointing=gradient_checkpointing,
            trust_remote_code=trust_remote_code,
            max_prompt_tokens=max_prompt_tokens,
        )
        self.player_names = [f"m{i}" for i in range(m)]
        if models:
            self.banks = nn.ModuleList(
                [
                    PolicyBank(path, players=[name], mode="lora", **bank_kw)
                    for path, name in zip(models, self.player_names)
                ]
            )
            self._bank_of = {n: i for i, n in enumerate(self.player_names)}
        else:
            self.banks = nn.ModuleList([PolicyBank(policy, players=self.player_names, mode="lora", **bank_kw)])
            self._bank_of = dict.fromkeys(self.player_names, 0)
        self.leader_bandit: Exp3 | None = None
        self.generator = torch.Generator().manual_seed(seed)
        self.val_acc = nn.ModuleDict({p: MeanMetric() for p in self.player_names})
        self.test_acc = nn.ModuleDict({p: MeanMetric() for p in self.player_names})
        # per-epoch means; persistent, so a checkpoint taken mid-epoch carries the epoch's running sums
        self.epoch_means = nn.ModuleDict({k: MeanMetric() for k in ("leader_reward", "score_gap", "follower_loss")})
        for metric in self.epoch_means.values():
            metric.persistent(True)
        self.iteration = 0  # game iterations played (training batches), saved in checkpoints
        self.history: dict[str, list[Any]] = {"weights": [], "ratings": [], "selection": [], "rewards": []}
        self.counters = {"judgements": 0, "parse_failures": 0, "empty_responses": 0, "iterations_without_pairs": 0}
        self.judge_counts = {p: [0, 0] for p in self.player_names}  # judgements, failures

    # ------------------------------------------------------------------ models
    def bank(self, player: str) -> PolicyBank:
        """The :class:`PolicyBank` holding ``player``."""
        return self.banks[self._bank_of[player]]

    def chat(self, player: str, user: str, system: str | None = None) -> str:
        """``player``'s chat-formatted prompt (each model its own template)."""
        return self.bank(player).chat(system, user)

    def respond(self, player: str, instructions: list[str], n: int) -> Rollout:
        """``n`` sampled responses per instruction (rows ``i*n + s``), temperature and top-p of the config."""
        hp = self.hparams
        prompts = [self.chat(player, x, hp.system_prompt) for x in instructions]
        return self.bank(player).generate(
            player, prompts, n, temperature=hp.temperature, top_p=hp.top_p, max_new_tokens=hp.max_new_tokens
        )

    def encode(
        self, player: str, prompts: list[str], completions: list[str], eos: bool = True, group_size: int = 1
    ) -> Rollout:
        """A :class:`Rollout` of given texts in ``player``'s tokenizer (EOS appended unless ``eos=False``).

        ``group_size`` G > 1 declares that consecutive groups of G rows share one prompt, so log-probabilities run
        each prompt once (:meth:`PolicyBank.token_logprobs`).

        Raises:
            ValueError: when the rows do not come in groups of ``group_size`` with one prompt each.
        """
        if group_size > 1 and (
            len(prompts) % group_size or any(prompts[i] != prompts[i - i % group_size] for i in range(len(prompts)))
        ):
            raise ValueError(f"encode: the {len(prompts)} rows are not groups of {group_size} sharing one prompt")
        bank = self.bank(player)
        tok = bank.tokenizer
        enc = bank._encode_prompts(prompts)
        ids = tok(list(completions), add_special_tokens=False)["input_ids"]
        if eos:
            ids = [s + [tok.eos_token_id] for s in ids]
        width = max(1, max(len(s) for s in ids))
        comp = torch.full((len(ids), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, s in enumerate(ids):
            comp[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, : len(s)] = 1
        seq = torch.cat([enc["input_ids"], comp], dim=1).to(self.device)
        att = torch.cat([enc["attention_mask"], mask], dim=1).to(self.device)
        return Rollout(seq, att, enc["input_ids"].shape[1], mask.to(self.device), list(completions), group_size)

    # ------------------------------------------------------------------ judging
    def judge(self, judge: str, instructions: list[str], responses: list[str]) -> list[tuple[float, bool]]:
        """Scores in [1, 10] of ``judge`` for each (instruction, response), with whether each was parsed."""
        if not instructions:
            return []
        hp = self.hparams
        prompts = [
            self.chat(judge, _fill(hp.judge_template, x, y)) + hp.judge_prefill for x, y in zip(instructions, responses)
        ]
        if hp.judge_mode == "constrained":
            # a non-finite distribution (a diverged judge) counts like an unparseable answer: 5.0, counted
            return [
                (s, True) if math.isfinite(s) else (DEFAULT_SCORE, False)
                for s in self._constrained_scores(judge, prompts)
            ]
        out = self.bank(judge).generate(judge, prompts, 1, max_new_tokens=hp.judge_max_new_tokens, do_sample=False)
        parsed = [parse_judgement(hp.judge_prefill + t) for t in out.texts]
        return [(p.score, p.ok) for p in parsed]

    @torch.no_grad()
    def _constrained_scores(self, judge: str, prompts: list[str]) -> list[float]:
        """Mean score under the judge's distribution restricted to the answers ``1`` … ``10``.

        Each answer is closed by ``}`` when the prefill opens a JSON object (else by EOS), so that ``1`` is not a
        prefix of ``10``.
        """
        close = "}" if "{" in self.hparams.judge_prefill else ""
        values = list(range(int(SCORE_MIN), int(SCORE_MAX) + 1))
        rows_p = [p for p in prompts for _ in values]
        rows_c = [f"{v}{close}" for _ in prompts for v in values]
        rollout = self.encode(judge, rows_p, rows_c, eos=not close, group_size=len(values))
        lp = self.bank(judge).logprobs(judge, rollout, temperature=1.0).view(len(prompts), len(values))
        probs = torch.softmax(lp.double(), dim=1)
        return (probs @ torch.tensor(values, dtype=torch.float64, device=probs.device)).tolist()

    # ------------------------------------------------------------------ the game
    def _elo(self):
        if len(self.player_names) == 1:
            return None
        from callbacks import EloRating

        try:
            return EloRating.find(self.trainer)
        except LookupError as err:
            raise LookupError(
                "StackelbergPool needs an EloRating callback over its players "
                f"{self.player_names} (trainer.callbacks: class_path callbacks.EloRating, init_args.players)"
            ) from err

    def on_fit_start(self) -> None:  # noqa: D102
        from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

        strategy = self.trainer.strategy
        if self.trainer.world_size > 1 and (
            not isinstance(strategy, DDPStrategy) or isinstance(strategy, DeepSpeedStrategy)
        ):
            raise ValueError(
                f"trainer.strategy: StackelbergPool runs on several processes under DDP only "
                f"(configs/overlays/ddp.yaml), got {type(strategy).__name__} on {self.trainer.world_size} processes; "
                "every rank runs the whole base and the adapters are replicated (module docstring)"
            )
        self._elo()  # fail before any generation when the EloRating callback is missing

    # ------------------------------------------------------------------ ranks
    def _world(self) -> tuple[int, int]:
        """(rank, world size); (0, 1) outside a trainer."""
        trainer = self._trainer
        return (0, 1) if trainer is None else (trainer.global_rank, trainer.world_size)

    def _mine(self, duel: int) -> bool:
        """Whether this rank plays duel ``duel`` (duel d belongs to rank ``d % world``)."""
        rank, world = self._world()
        return duel % world == rank

    def _share(self, lo: int, hi: int) -> tuple[int, int]:
        """The contiguous share of the rows ``lo … hi`` of a follower batch that this rank computes."""
        rank, world = self._world()
        n = hi - lo
        return lo + n * rank // world, lo + n * (rank + 1) // world

    def _gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (``[obj]`` on one process)."""
        _, world = self._world()
        if world == 1:
            return [obj]
        out: list[Any] = [None] * world
        torch.distributed.all_gather_object(out, obj)
        return out

    def _no_sync(self) -> Any:
        """Keep the DDP wrapper's gradient hooks out of the manual backward passes (the sum is :meth:`_reduce`'s)."""
        wrapped = self.trainer.strategy.model if self._trainer is not None else None
        if wrapped is None or wrapped is self or not hasattr(wrapped, "no_sync"):
            return nullcontext()
        return wrapped.no_sync()

    def _reduce(self, params: list[Tensor], total: float, finite: bool) -> tuple[float, bool]:
        """Sum the gradients of ``params`` and the loss over the ranks; finite only if it is on every rank."""
        if self._world()[1] == 1:
            return total, finite
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])  # one buffer, summed in fp32 whatever the dtype
        torch.distributed.all_reduce(flat)
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset : offset + g.numel()].view_as(p).to(g.dtype)
            offset += g.numel()
        stats = torch.tensor([total, 0.0 if finite else 1.0], dtype=torch.float64, device=flat.device)
        torch.distributed.all_reduce(stats)
        return float(stats[0]), bool(stats[1] == 0)

    def _trainable_checksum(self) -> list[float]:
        sums = [p.detach().double().sum() for p in self.banks.parameters() if p.requires_grad]
        return torch.stack(sums).tolist() if sums else []  # one read-back, not one per tensor

    def _check_ranks_agree(self) -> None:
        """Under DDP, raise when a rank's adapters, leader or iteration differ from rank 0's (after each iteration).

        Called inside ``training_step``, where every rank is in step (not in an epoch-end hook, where rank 0's
        progress bar runs collectives of its own).
        """
        if self._world()[1] == 1:
            return
        leader = [] if self.leader_bandit is None else self.leader_probabilities().tolist()
        everyone = self._gather((self._trainable_checksum(), leader, self.iteration))
        bad = [r for r, other in enumerate(everyone) if other != everyone[0]]
        if bad:
            raise RuntimeError(f"StackelbergPool: ranks {bad} diverged from rank 0 (adapters, leader or iteration)")

    def on_train_epoch_start(self) -> None:  # noqa: D102
        reset_stale_epoch_metrics(self.trainer, self.epoch_means.values())

    def _progress(self) -> float:
        """The annealing schedules' position: game iterations played before this one / (num_iterations - 1)."""
        return self.iteration / max(1, self.hparams.num_iterations - 1)

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

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:  # noqa: D102
        hp = self.hparams
        instructions = list(batch["prompt"])
        self._ensure_leader(len(instructions))
        progress = self._progress()
        iteration = self.iteration
        self.iteration += 1
        names, m = self.player_names, len(self.player_names)
        elo = self._elo()
        ratings = [elo.rating(p) for p in names] if elo is not None else [0.0] * m
        if not self.history["weights"]:
            self.history["weights"].append(self.leader_probabilities().tolist())
        self.history["ratings"].append(list(ratings))

        # 1. leader: D instructions with replacement
        if hp.leader == "uniform":
            idx = torch.randint(len(instructions), (hp.duels_per_iteration,), generator=self.generator)
        else:
            idx = self.leader_bandit.sample(hp.duels_per_iteration, self.generator)
        idx_list = idx.tolist()
        # 2. matching
        target_gap = linear_schedule(hp.match_gap_start, hp.match_gap_end, progress)
        duels: list[tuple[int, int]] = []
        for _ in idx_list:
            if m == 1:
                duels.append((0, 0))
                continue
            a = int(torch.randint(m, (), generator=self.generator))
            b = sample_opponent(
                ratings, a, target_gap, self.generator, hp.num_candidates, hp.uniform_opponent_share, hp.match_bandwidth
            )
            duels.append((a, b))
        if m > 1:
            sel = opponent_selection_weights(
                ratings, target_gap, hp.num_candidates, hp.uniform_opponent_share, hp.match_bandwidth
            )
            self.history["selection"].append(sel)
            self.log_dict({f"match/selection_weight/{p}": w for p, w in zip(names, sel)}, batch_size=1)
        # 3. responses: per model, one generate over all of its (duel, side) slots (of this rank's duels)
        g = hp.grpo_rollouts if hp.algorithm == "grpo" else 1
        texts: dict[tuple[int, int], list[str]] = {}
        rollouts: dict[str, tuple[Rollout, list[tuple[int, int]]]] = {}
        for pi, p in enumerate(names):
            slots = [(d, s) for d, duel in enumerate(duels) for s in (0, 1) if duel[s] == pi and self._mine(d)]
            if not slots:
                continue
            out = self.respond(p, [instructions[idx_list[d]] for d, _ in slots], g)
            for k, slot in enumerate(slots):
                texts[slot] = out.texts[k * g : (k + 1) * g]
            rollouts[p] = (out, slots)
        texts = {slot: t for part in self._gather(texts) for slot, t in part.items()}  # every rank: every duel's
        # 4. judging: each judge scores every non-empty response of every duel it is not in (this rank's duels)
        judges_of = [[j for j in range(m) if j not in duel] if m > 1 else [0] for duel in duels]
        scores: dict[tuple[int, int, int], dict[int, float]] = {}
        counts: dict[int, tuple[int, int]] = {}
        n_empty = 0
        for j, jn in enumerate(names):
            items = [
                (d, s, r)
                for d in range(len(duels))
                if j in judges_of[d] and self._mine(d)
                for s in (0, 1)
                for r in range(g)
                if texts[(d, s)][r].strip()
            ]
            verdicts = self.judge(
                jn, [instructions[idx_list[d]] for d, _, _ in items], [texts[(d, s)][r] for d, s, r in items]
            )
            counts[j] = (len(verdicts), sum(1 for _, ok in verdicts if not ok))
            for (d, s, r), (score, _) in zip(items, verdicts):
                scores.setdefault((d, s, r), {})[j] = score
        gathered = self._gather((scores, counts))
        scores = {}
        for part, _ in gathered:  # in duel order on every rank, whichever rank judged
            scores.update(part)
        scores = dict(sorted(scores.items()))
        for j, jn in enumerate(names):
            judged = sum(c[j][0] for _, c in gathered)
            fails = sum(c[j][1] for _, c in gathered)
            self.judge_counts[jn][0] += judged
            self.judge_counts[jn][1] += fails
            self.counters["judgements"] += judged
            self.counters["parse_failures"] += fails
            if judged and fails == judged and hp.judge_mode == "generate":
                warnings.warn(
                    f"iteration {iteration}: none of judge {jn}'s {judged} judgements parsed; each "
                    "counts as 5.0 (App. G)",
                    stacklevel=2,
                )
        for d in range(len(duels)):
            for s in (0, 1):
                for r in range(g):
                    if not texts[(d, s)][r].strip():
                        n_empty += 1
                        scores[(d, s, r)] = dict.fromkeys(judges_of[d], SCORE_MIN)  # documented rule
        self.counters["empty_responses"] += n_empty
        raw = torch.tensor([v for per_judge in scores.values() for v in per_judge.values()], dtype=torch.float64)
        if not bool(torch.isfinite(raw).all()) and not self.check_finite(raw, "peer scores (rewards)"):
            # only a failure is reported: a good score check must not end a streak of skipped follower updates
            return
        # 5. aggregation and reputations
        side_scores: list[tuple[float, float]] = []
        rollout_scores: dict[tuple[int, int], list[float]] = {}
        for d, (a, b) in enumerate(duels):
            judges = judges_of[d]
            weights = elo.judge_weights([names[j] for j in judges]) if elo is not None else [1.0] * len(judges)
            per_side = []
            for s in (0, 1):
                per_rollout = [
                    reputation_weighted_mean([scores[(d, s, r)][j] for j in judges], weights) for r in range(g)
                ]
                rollout_scores[(d, s)] = per_rollout
                per_side.append(sum(per_rollout) / g)
            side_scores.append((per_side[0], per_side[1]))
            if elo is not None and self._mine(d):  # each duel reported once, by the rank that played it
                judge_a = [sum(scores[(d, 0, r)][j] for r in range(g)) / g for j in judges]
                judge_b = [sum(scores[(d, 1, r)][j] for r in range(g)) / g for j in judges]
                elo.report(names[a], names[b], judge_verdicts(judge_a, judge_b), weights=weights)
        # 6. leader update
        rewards = [
            composite_reward(
                sa,
                sb,
                progress,
                hp.difficulty_weight,
                hp.preference_weight,
                hp.min_score,
                hp.reward_bandwidth,
                hp.ideal_gap_start,
                hp.ideal_gap_end,
            )
            for sa, sb in side_scores
        ]
        if hp.leader == "exp3":
            self.leader_bandit.update(idx_list, rewards)
        probs = self.leader_probabilities()
        self.history["weights"].append(probs.tolist())
        self.history["rewards"].append(sum(rewards) / len(rewards))
        # 7. followers
        if hp.algorithm == "dpo":
            stats = self._train_dpo(instructions, idx_list, duels, texts, side_scores, iteration)
        else:
            stats = self._train_grpo(rollouts, rollout_scores, duels)
        self._check_ranks_agree()
        mean_reward = sum(rewards) / len(rewards)
        score_gap = sum(abs(x - y) for x, y in side_scores) / len(side_scores)
        self.epoch_means["leader_reward"].update(mean_reward)
        self.epoch_means["score_gap"].update(score_gap)
        for name, metric in (
            ("leader/reward_epoch", "leader_reward"),
            ("duel/score_gap_epoch", "score_gap"),
            ("follower/loss_epoch", "follower_loss"),
        ):
            self.log(name, self.epoch_means[metric], on_step=False, on_epoch=True, batch_size=1)
        judged = sum(self.judge_counts[p][0] for p in names)
        k = probs.numel()
        self.log_dict(
            {
                "leader/reward": mean_reward,
                "leader/entropy": float(-(probs * probs.log()).sum()),
                "leader/max_weight_ratio": float(probs.max() * k),
                "leader/min_weight_ratio": float(probs.min() * k),
                "match/target_gap": target_gap,
                "duel/score_gap": score_gap,
                "duel/ties": float(sum(1 for x, y in side_scores if x == y)),
                "judge/parse_failures": float(self.counters["parse_failures"]),
                "judge/parse_failure_rate": self.counters["parse_failures"] / max(1, judged),
                "train/empty_responses": float(self.counters["empty_responses"]),
                "train/nonfinite_skipped": float(self.nonfinite_skipped),
                **{
                    f"judge/parse_failure_rate/{p}": self.judge_counts[p][1] / max(1, self.judge_counts[p][0])
                    for p in names
                },
                **stats,
            },
            batch_size=1,
        )

    def _step(
        self, player: str, opt, loss_fn, n: int, micro: int | None = None, rows: tuple[int, int] | None = None
    ) -> tuple[float, int]:
        """One optimizer step of ``player`` on a batch of ``n`` items; ``loss_fn(lo, hi)`` → summed loss.

        ``rows``: the items this rank computes (default: all, ``(0, n)``); under DDP the gradients of every rank's
        share, each divided by the global ``n``, are summed (:meth:`_reduce`). ``micro`` items (default
        ``micro_batch``; 0: all) per forward, gradients accumulated.
        """
        hp = self.hparams
        a0, b0 = rows if rows is not None else (0, n)
        step = (hp.micro_batch if micro is None else micro) or max(1, b0 - a0)
        opt.zero_grad()
        total, finite = 0.0, True
        with self._no_sync():
            for lo in range(a0, b0, step):
                loss = loss_fn(lo, min(b0, lo + step)) / n
                if not bool(torch.isfinite(loss.detach()).all()):
                    finite = False
                    break
                self.manual_backward(loss)
                total += float(loss.detach())
        params = self.bank(player).player_parameters(player)
        total, finite = self._reduce(params, total, finite)
        # counts, warns, logs; raises after max_consecutive_nonfinite skips in a row; a good step ends a streak
        if not self.check_finite(torch.tensor(total if finite else float("nan")), f"losses of follower {player}"):
            opt.zero_grad()
            return float("nan"), 0
        if hp.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, hp.grad_clip)
        opt.step()
        self.epoch_means["follower_loss"].update(total)
        return total, 1

    def _optimizers(self) -> dict[str, Any]:
        opts = self.optimizers()
        opts = opts if isinstance(opts, list) else [opts]
        return dict(zip(self.player_names, opts))

    def _dpo_rows_loss(
        self, p: str, both: Rollout, ref: Tensor, lo: int, acc: list, margin: list, a: int, b: int
    ) -> Tensor:
        """Summed DPO loss of pairs ``lo + a … lo + b`` of ``p`` (log-probabilities at temperature 1).

        ``both`` holds pair ``i`` in rows ``2i`` (chosen) and ``2i + 1`` (rejected); ``ref`` is ``[pairs, 2]``.
        """
        pairs = slice(lo + a, lo + b)
        lp = self.bank(p).logprobs(p, _rows(both, slice(2 * (lo + a), 2 * (lo + b))), 1.0).view(-1, 2)
        loss, cr, rr = dpo_loss(lp[:, 0], lp[:, 1], ref[pairs, 0], ref[pairs, 1], self.hparams.dpo_beta)
        acc.extend((cr > rr).float().tolist())
        margin.extend((cr - rr).tolist())
        return loss.sum()

    def _grpo_rows_loss(
        self, p: str, out: Rollout, adv: Tensor, old: Tensor, ref: Tensor | None, lo: int, clipped: list, a: int, b: int
    ) -> Tensor:
        """GRPO loss of rollouts ``lo + a … lo + b`` of ``p``, times their number (a sum over rows)."""
        hp = self.hparams
        rows = slice(lo + a, lo + b)
        sub = _rows(out, rows)
        lp = self.bank(p).token_logprobs(p, sub, hp.temperature)
        loss, st = grpo_loss(
            lp,
            sub.completion_mask.to(lp.dtype),
            adv[rows],
            old[rows],
            None if ref is None else ref[rows],
            hp.grpo_clip,
            hp.grpo_beta,
        )
        clipped.append(float(st["clip_fraction"]))
        return loss * (b - a)

    def _train_dpo(self, instructions, idx_list, duels, texts, side_scores, iteration: int) -> dict[str, float]:
        hp = self.hparams
        pairs = preference_pairs([a for a, _ in side_scores], [b for _, b in side_scores])
        if not pairs:
            self.counters["iterations_without_pairs"] += 1
            warnings.warn(f"iteration {iteration}: every duel tied; no DPO pair, followers not updated", stacklevel=2)
        opts = self._optimizers()
        stats: dict[str, float] = {"duel/pairs": float(len(pairs))}
        for pi, p in enumerate(self.player_names):
            mine = pairs if hp.dpo_pairs == "all" else [(d, w) for d, w in pairs if pi in duels[d]]
            if not mine:
                continue
            # batches of the pairs; under DDP each rank computes a contiguous share of each batch
            batches = [(lo, min(len(mine), lo + hp.batch_size)) for lo in range(0, len(mine), hp.batch_size)]
            shares = [self._share(lo, hi) for lo, hi in batches]
            local = [mine[i] for a, b in shares for i in range(a, b)]
            bank = self.bank(p)
            both = ref = None
            if local:
                prompts = [self.chat(p, instructions[idx_list[d]], hp.system_prompt) for d, _ in local]
                chosen = [texts[(d, 0 if a_wins else 1)][0] for d, a_wins in local]
                rejected = [texts[(d, 1 if a_wins else 0)][0] for d, a_wins in local]
                # one forward per pair: chosen and rejected side by side (rows 2i, 2i + 1), their prompt run once
                both = self.encode(
                    p,
                    [x for x in prompts for _ in (0, 1)],
                    [t for pair in zip(chosen, rejected) for t in pair],
                    group_size=2,
                )
                with torch.no_grad():  # reference: this follower as it starts the iteration (the previous one's)
                    ref = bank.logprobs(p, both, 1.0, hp.micro_batch).view(-1, 2)
            losses, acc, margin, steps = [], [], [], 0
            micro = max(1, hp.micro_batch // 2) if hp.micro_batch else 0  # pairs: two sequences each
            offset = 0  # where this batch's share starts among this rank's pairs
            for (lo, hi), (a, b) in zip(batches, shares):
                loss_fn = partial(self._dpo_rows_loss, p, both, ref, offset - a, acc, margin)
                total, ok = self._step(p, opts[p], loss_fn, hi - lo, micro, rows=(a, b))
                offset += b - a
                steps += ok
                if ok:
                    losses.append(total)
            acc, margin = (sum(part, []) for part in zip(*self._gather((acc, margin))))
            if losses:
                stats[f"follower/dpo_loss/{p}"] = sum(losses) / len(losses)
                stats[f"follower/reward_accuracy/{p}"] = sum(acc) / len(acc)
                stats[f"follower/reward_margin/{p}"] = sum(margin) / len(margin)
            if steps:
                # The first batch of an iteration has margin 0 by construction (policy = reference), so with one
                # batch per iteration the loss above always reads ln 2; the margin after the iteration's updates, on
                # the same pairs, is what shows whether the follower learned them.
                after_margin: list[float] = []
                if local:
                    with torch.no_grad():
                        after = bank.logprobs(p, both, 1.0, hp.micro_batch).view(-1, 2)
                    _, cr, rr = dpo_loss(after[:, 0], after[:, 1], ref[:, 0], ref[:, 1], hp.dpo_beta)
                    after_margin = (cr - rr).tolist()
                after_margin = sum(self._gather(after_margin), [])
                stats[f"follower/margin_after/{p}"] = sum(after_margin) / len(after_margin)
                stats[f"follower/accuracy_after/{p}"] = sum(x > 0 for x in after_margin) / len(after_margin)
            stats[f"follower/steps/{p}"] = float(steps)
        return stats

    def _train_grpo(self, rollouts, rollout_scores, duels) -> dict[str, float]:
        """GRPO steps of every combatant on batches of its rollouts in duel order (all ranks' rollouts).

        Under DDP each rank holds the rollouts of its own duels: a batch's rows owned by this rank are a contiguous
        run of its rollout (both orders follow the duels), which it computes; the others are other ranks'.
        """
        hp = self.hparams
        g = hp.grpo_rollouts
        _, world = self._world()
        opts = self._optimizers()
        stats: dict[str, float] = {}
        for pi, p in enumerate(self.player_names):
            slots = [(d, s) for d, duel in enumerate(duels) for s in (0, 1) if duel[s] == pi]
            if not slots:
                continue
            out, own = rollouts.get(p, (None, []))
            rewards = torch.tensor([x for slot in own for x in rollout_scores[slot]], dtype=torch.float32)
            old = ref = adv = None
            if own:
                adv = peer_score_advantages(rewards, g).to(self.device)
                bank = self.bank(p)
                with torch.no_grad():  # the sampling policy, for the clipped ratio of later mini-batches
                    old = bank.token_logprobs(p, out, hp.temperature, hp.micro_batch)
                    if hp.grpo_beta > 0:
                        ref = bank.token_logprobs(None, out, hp.temperature, hp.micro_batch)
            # before[i]: this rank's rows among the global rows 0 … i - 1 (a batch may cut a slot's rows)
            before = [0]
            for d, _ in slots:
                step = 1 if self._mine(d) else 0
                before.extend([before[-1] + step * k for k in range(1, g + 1)])
            n = len(slots) * g
            losses, clipped = [], []
            for lo in range(0, n, hp.batch_size):
                hi = min(n, lo + hp.batch_size)
                a, b = before[lo], before[hi]
                loss_fn = partial(self._grpo_rows_loss, p, out, adv, old, ref, 0, clipped)
                total, ok = self._step(p, opts[p], loss_fn, hi - lo, rows=(a, b))
                if ok:
                    losses.append(total)
            clipped = sum(self._gather(clipped), [])
            if losses:
                stats[f"follower/grpo_loss/{p}"] = sum(losses) / len(losses)
                if clipped:
                    stats[f"follower/clip_fraction/{p}"] = sum(clipped) / len(clipped)
            everyone = [x for slot in slots for x in rollout_scores[slot]]
            stats[f"follower/reward/{p}"] = sum(everyone) / len(everyone)
        return stats

    def configure_optimizers(self):  # noqa: D102
        return [
            torch.optim.AdamW(self.bank(p).player_parameters(p), lr=self.hparams.lr, weight_decay=0.0)
            for p in self.player_names
        ]

    # ------------------------------------------------------------------ evaluation
    def _evaluate(self, batch: dict[str, Any], metrics: nn.ModuleDict) -> None:
        hp = self.hparams
        refs = list(batch["reference"])
        if any(r is None for r in refs):
            raise ValueError("evaluation needs a reference answer for every prompt (data.reference_column)")
        for p in self.player_names:
            prompts = [self.chat(p, x, hp.system_prompt) for x in batch["prompt"]]
            out = self.bank(p).generate(p, prompts, 1, max_new_tokens=hp.eval_max_new_tokens, do_sample=False)
            correct = [float(answers_match(final_answer(t), r)) for t, r in zip(out.texts, refs)]
            metrics[p].update(torch.tensor(correct, device=self.device))

    def _log_accuracy(self, stage: str, metrics: nn.ModuleDict) -> None:
        accs = {p: metrics[p].compute() for p in self.player_names}
        self.log_dict({f"{stage}/acc/{p}": v for p, v in accs.items()})
        self.log(f"{stage}/acc_macro", torch.stack(list(accs.values())).mean())
        for metric in metrics.values():
            metric.reset()

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:  # noqa: D102
        self._evaluate(batch, self.val_acc)

    def on_validation_epoch_end(self) -> None:  # noqa: D102
        self._log_accuracy("val", self.val_acc)

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:  # noqa: D102
        self._evaluate(batch, self.test_acc)

    def on_test_epoch_end(self) -> None:  # noqa: D102
        self._log_accuracy("test", self.test_acc)

    # ------------------------------------------------------------------ figures
    def on_train_end(self) -> None:  # noqa: D102
        elo = self._elo()
        if elo is not None:
            self.history["ratings"].append([elo.rating(p) for p in self.player_names])
        self._write_figures(self.trainer.log_dir or self.trainer.default_root_dir)

    @rank_zero_only
    def _write_figures(self, log_dir: str) -> None:
        os.makedirs(log_dir, exist_ok=True)
        record = {
            "players": self.player_names,
            "models": self.hparams.models or [self.hparams.policy] * len(self.player_names),
            **self.history,
            "counters": {**self.counters, "nonfinite_skipped": self.nonfinite_skipped},
            "judge_counts": {p: {"judgements": c[0], "parse_failures": c[1]} for p, c in self.judge_counts.items()},
        }
        with open(os.path.join(log_dir, "pool_history.json"), "w") as f:
            json.dump(record, f, indent=1)
        experiment = getattr(self.logger, "experiment", None) if self.logger is not None else None
        for name, fig in make_pool_figures(self.history, self.player_names).items():
            fig.savefig(os.path.join(log_dir, f"{name}.png"), dpi=110, bbox_inches="tight")
            if experiment is not None and hasattr(experiment, "add_figure"):
                experiment.add_figure(f"pool/{name}", fig, global_step=self.global_step)

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the adapters (not the frozen bases) and the whole game: leader, histories, counters, RNG."""
        sd = checkpoint["state_dict"]
        keep = {f"banks.{n}" for n, p in self.banks.named_parameters() if p.requires_grad}
        for name in list(sd):
            if name.startswith("banks.") and name not in keep:
                del sd[name]
        checkpoint["pool_game"] = {
            "leader": None if self.leader_bandit is None else self.leader_bandit.state_dict(),
            "iteration": self.iteration,
            "nonfinite": self.nonfinite_state(),
            "history": self.history,
            "counters": dict(self.counters),
            "judge_counts": {p: list(c) for p, c in self.judge_counts.items()},
            "generator": self.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint missing an adapter tensor; restore the game."""
        trainable = {f"banks.{n}" for n, p in self.banks.named_parameters() if p.requires_grad}
        require_trainable_tensors(checkpoint, trainable)
        game = checkpoint.get("pool_game")
        if game is None:
            return
        if game["leader"] is not None:
            self.leader_bandit = Exp3(game["leader"]["num_arms"], gamma=self.hparams.gamma)
            self.leader_bandit.load_state_dict(game["leader"])
        self.iteration = int(game["iteration"])
        self.load_nonfinite_state(game["nonfinite"])
        self.history = {k: list(v) for k, v in game["history"].items()}
        self.counters = dict(game["counters"])
        self.judge_counts = {p: list(c) for p, c in game["judge_counts"].items()}
        self.generator.set_state(game["generator"])
        torch.set_rng_state(game["torch_rng"])


def _rows(rollout: Rollout, rows: slice) -> Rollout:
    """The rows ``rows`` (a contiguous slice) of a rollout: prompt width kept, prompt groups kept when none is cut."""
    sequences = rollout.sequences[rows]
    start, g = rows.start or 0, max(1, rollout.group_size)
    whole = start % g == 0 and sequences.shape[0] % g == 0
    return Rollout(
        sequences,
        rollout.attention_mask[rows],
        rollout.prompt_width,
        rollout.completion_mask[rows],
        rollout.texts[rows],
        g if whole else 1,
    )


def make_pool_figures(history: dict[str, list[Any]], players: list[str], top: int = 5) -> dict[str, Any]:
    """The figures of §5 from a run's history (matplotlib, Agg canvas, no pyplot state).

    * ``instruction_weights``: the leader's probability of the ``top`` instructions with the highest and the lowest
      final weight, relative to uniform (1 = uniform), per iteration (Fig. 5);
    * ``reputations``: each model's Elo rating at the start of each iteration and at the end (Fig. 3);
    * ``opponent_selection``: each model's opponent-selection weight per iteration against uniform ``1/m`` (Fig. 4).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figures = {}
    weights = torch.tensor(history["weights"], dtype=torch.float64)  # [T + 1, K]
    if weights.numel():
        k = weights.shape[1]
        rel = weights * k
        order = torch.argsort(rel[-1], descending=True).tolist()
        n = min(top, k // 2) if k > 1 else 1
        fig = Figure(figsize=(6.5, 4))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        steps = list(range(rel.shape[0]))
        for rank, i in enumerate(order[:n]):
            ax.plot(steps, rel[:, i].tolist(), "-", color="tab:green", alpha=0.8, label="top 5" if rank == 0 else None)
        for rank, i in enumerate(order[-n:] if k > 1 else []):
            ax.plot(steps, rel[:, i].tolist(), "-", color="tab:red", alpha=0.8, label="bottom 5" if rank == 0 else None)
        ax.axhline(1.0, color="grey", ls="--", label="uniform")
        ax.set_xlabel("iteration (0: before the first update)")
        ax.set_ylabel("instruction weight / uniform")
        ax.set_title("Leader's instruction weights")
        ax.legend()
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        figures["instruction_weights"] = fig
    if history["ratings"] and len(players) > 1:
        r = torch.tensor(history["ratings"], dtype=torch.float64)
        fig = Figure(figsize=(6.5, 4))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for j, p in enumerate(players):
            ax.plot(list(range(r.shape[0])), r[:, j].tolist(), "-o", ms=3, label=p)
        ax.set_xlabel("iteration")
        ax.set_ylabel("Elo reputation")
        ax.set_title("Reputation trajectories")
        ax.legend()
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        figures["reputations"] = fig
    if history["selection"]:
        w = torch.tensor(history["selection"], dtype=torch.float64)
        fig = Figure(figsize=(6.5, 4))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for j, p in enumerate(players):
            ax.plot(list(range(w.shape[0])), w[:, j].tolist(), "-o", ms=3, label=p)
        ax.axhline(1.0 / len(players), color="grey", ls="--", label="uniform")
        ax.set_xlabel("iteration")
        ax.set_ylabel("opponent-selection weight")
        ax.set_title("Opponent selection")
        ax.legend()
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        figures["opponent_selection"] = fig
    return figures
