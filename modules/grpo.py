"""GRPO (Shao et al., 2024): one LM policy, G samples per prompt, group-relative advantages, clipped update.

Per training step, for B prompts: B·G completions in one batched ``generate`` (left padding, KV cache); rewards from
each reward model in one batched pass (models that share a tokenizer share one tokenisation) and/or the answer
checker (RLVR: 1 when the reply's last ``\\boxed{}`` matches the prompt's reference); group advantages
(:func:`modules.rl_losses.group_advantages`); reference log-probabilities once per step without gradients through the
disabled adapter; the clipped surrogate with the k3 KL (:func:`modules.rl_losses.grpo_loss`) on completion tokens
only; AdamW. With ``updates_per_rollout`` μ > 1 the sampling policy's log-probabilities are kept (one extra forward
without gradients) and μ optimizer steps reuse the rollout, which is where the clipping acts.

Each phase's wall time is logged (``time/generate``, ``time/score``, ``time/ref_logprobs``, ``time/backward``: the
policy's forward and backward, ``time/optimizer``) and kept in :attr:`GRPO.phase_times`. A step with a non-finite
reward or loss is skipped, counted (``train/nonfinite_skipped``) and warned about; ``max_consecutive_nonfinite`` in a
row stop training with a clear error (:class:`modules.faults.NonFiniteGuard`: one decision for all ranks).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn

from callbacks.fault_tolerance import collect_rng_state, restore_rng_state
from modules.answers import answers_match, extract_final_answer
from modules.faults import NonFiniteGuard, require_trainable_tensors
from modules.models import DTYPES, check_exists, resolve_name_or_path
from modules.policy import (
    PolicyBank,
    fit_manual_backward_strategy,
    fsdp2_gradient_sync,
    shard_for_strategy,
    sharded_strategy_kind,
)
from modules.rl_losses import group_advantages, grpo_loss
from modules.timing import PhaseTimer

__all__ = ["GRPO", "RewardModels", "answer_rewards", "build_tiny_reward_model"]

PLAYER = "policy"


def answer_rewards(completions: Sequence[str], references: Sequence[str | None]) -> Tensor:
    """RLVR reward: 1.0 where the completion's last ``\\boxed{}`` equals the reference answer, else 0.0.

    Raises:
        ValueError: naming the row, when a reference is missing (the checker needs one for every prompt).
    """
    if len(completions) != len(references):
        raise ValueError(f"{len(completions)} completions but {len(references)} references")
    out = []
    for i, (text, ref) in enumerate(zip(completions, references)):
        if ref is None:
            raise ValueError(
                f"row {i}: field 'reference' is missing; the answer reward needs a reference answer for every prompt "
                "(set data.init_args.reference_column, or answer_reward: false)"
            )
        out.append(1.0 if answers_match(extract_final_answer(text), ref) else 0.0)
    return torch.tensor(out, dtype=torch.float32)


def _tokenizer_fingerprint(tok: Any) -> str:
    """Equal for tokenizers that split text identically (same vocabulary, merges, normaliser, specials)."""
    backend = getattr(tok, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tok.get_vocab().items()))
    return hashlib.sha1(f"{text}|{tok.pad_token_id}|{tok.truncation_side}".encode()).hexdigest()


def build_tiny_reward_model(save_dir: str | os.PathLike, config: dict[str, Any] | None = None, seed: int = 0) -> str:
    """A random-initialised tiny Qwen2 sequence classifier (one output) with the byte tokenizer, saved to a folder.

    The reward-model counterpart of :func:`modules.models.build_tiny_causal_lm` (same tokenizer, so it reads the tiny
    policy's text), for tests and benchmarks; it loads through ``from_pretrained`` like any hub reward model.
    """
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from modules.models import TINY_QWEN2, build_byte_tokenizer

    save_dir = Path(save_dir)
    cfg_dict = {**TINY_QWEN2, **(config or {})}
    stamp = {"config": cfg_dict, "seed": seed, "kind": "sequence_classification"}
    stamp_file = save_dir / "alignment_games_tiny.json"
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp:
        return str(save_dir)
    tok = build_byte_tokenizer()
    cfg = Qwen2Config(
        vocab_size=len(tok), num_labels=1, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **cfg_dict
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForSequenceClassification(cfg)
    save_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(save_dir)
    tok.save_pretrained(save_dir)
    stamp_file.write_text(json.dumps(stamp))
    return str(save_dir)


class RewardModels(nn.Module):
    """Frozen sequence-classification reward models (one scalar each), scored in batches.

    Each model scores ``prompt + completion`` (right-padded, the score at the last real token, as TRL does). Models
    that share a tokenizer share one tokenisation per call; each model scores the whole batch in one pass (or
    ``batch_size`` rows at a time).

    With ``group_size`` G > 1 (rows in groups of G sampled from one prompt, as GRPO makes them) the tokens that a
    group's rows share are run once per group: the longest common token prefix of each group (computed on the token
    ids, so tokenisation is exactly the unshared one) goes through the model's backbone once, its KV cache is
    repeated to the group's rows, and only the rows' own tokens run on top, at the same positions and under the same
    attention as before. With prompts of P tokens and completions of C, that is ``B·P + B·G·C`` tokens instead of
    ``B·G·(P + C)``; the scores equal the unshared ones up to float rounding (tested). Used for models whose
    ``forward`` takes a KV cache and whose backbone is ``base_model`` (decoder-only classifiers such as Qwen2's,
    Llama's, Mistral's); others, and groups sharing fewer than 2 tokens, take the unshared path.

    Args:
        paths: Hub names or local folders of ``AutoModelForSequenceClassification`` checkpoints.
        batch_size: Rows per forward (0: all rows at once).
        max_length: Tokens kept per text (cut from the left, so the completion stays).
        dtype: Weights dtype.
        trust_remote_code: Off unless turned on.

    Raises:
        OSError: naming the path of a model that does not exist.
        ValueError: when a model has more than one output.
    """

    def __init__(
        self,
        paths: Sequence[str],
        batch_size: int = 0,
        max_length: int = 1024,
        dtype: str = "float32",
        trust_remote_code: bool = False,
    ) -> None:
        super().__init__()
        from transformers import AutoModelForSequenceClassification

        from modules.models import load_tokenizer

        self.paths, self.batch_size, self.max_length = list(paths), batch_size, max_length
        self.models = nn.ModuleList()
        self.tokenizers: list[Any] = []
        self.fingerprints: list[str] = []
        for i, name in enumerate(self.paths):
            path = resolve_name_or_path(name)
            check_exists(f"reward_models[{i}]", path)
            tok = load_tokenizer(path, trust_remote_code=trust_remote_code, padding_side="right")
            tok.truncation_side = "left"
            model = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=1, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code
            )
            if model.config.num_labels != 1:
                raise ValueError(f"reward_models[{i}] ({name}) has {model.config.num_labels} outputs; one is needed")
            model.config.pad_token_id = tok.pad_token_id  # the score is read at the last non-pad token
            self.models.append(model.eval().requires_grad_(False))
            self.tokenizers.append(tok)
            self.fingerprints.append(_tokenizer_fingerprint(tok))

    def __len__(self) -> int:
        return len(self.models)

    def train(self, mode: bool = True) -> RewardModels:
        """Stay in eval mode (no dropout) whatever the trainer asks."""
        return super().train(False)

    @torch.no_grad()
    def forward(self, texts: Sequence[str], group_size: int = 1) -> Tensor:
        """Scores ``[N, K]`` of the ``N`` texts by the ``K`` models (``group_size``: see the class docstring)."""
        device = next(self.parameters()).device
        encoded: dict[str, dict[str, Tensor]] = {}
        cols = []
        for model, tok, fp in zip(self.models, self.tokenizers, self.fingerprints):
            if fp not in encoded:
                encoded[fp] = tok(
                    list(texts),
                    return_tensors="pt",
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    add_special_tokens=False,
                )
            enc = encoded[fp]
            n = enc["input_ids"].shape[0]
            g = group_size if group_size > 1 and n % group_size == 0 and _takes_cache(model) else 1
            step = -(-(self.batch_size or n) // g) * g  # whole groups per chunk
            scores = []
            for i in range(0, n, step):
                ids = enc["input_ids"][i : i + step].to(device)
                att = enc["attention_mask"][i : i + step].to(device)
                shared = _shared_prefix_scores(model, ids, att, g) if g > 1 else None
                scores.append(shared if shared is not None else model(input_ids=ids, attention_mask=att).logits[:, 0])
            cols.append(torch.cat(scores).float())
        return torch.stack(cols, dim=1)


def _takes_cache(model: nn.Module) -> bool:
    params = inspect.signature(type(model).forward).parameters
    return hasattr(model, "base_model") and ("past_key_values" in params or "cache" in params)


def _shared_prefix_scores(model: nn.Module, ids: Tensor, att: Tensor, g: int) -> Tensor | None:
    """Scores of right-padded rows in groups of ``g``, each group's common token prefix run once.

    ``None`` when a group shares fewer than 2 tokens (the caller then scores the rows as they are). The prefixes
    (each group's own length, at most its shortest row minus one, so every row keeps a token) are left-padded to one
    width and run through the backbone; their cache is repeated to the rows, whose remaining tokens are right-padded
    after it. Positions come from the attention mask, so every real token keeps its unshared position.
    """
    n, width = ids.shape
    lengths = att.sum(dim=1)
    rows = ids.view(n // g, g, width)
    same = (rows == rows[:, :1]).all(dim=1).long().cumprod(dim=1).sum(dim=1)  # common prefix per group
    prefix = torch.minimum(same, lengths.view(n // g, g).min(dim=1).values - 1)
    if int(prefix.min()) < 2:
        return None
    p_width = int(prefix.max())
    p_ids = torch.zeros((n // g, p_width), dtype=ids.dtype, device=ids.device)
    p_att = torch.zeros_like(p_ids)
    for k, length in enumerate(prefix.tolist()):
        p_ids[k, p_width - length :] = ids[k * g, :length]
        p_att[k, p_width - length :] = 1
    cut = prefix.repeat_interleave(g)
    s_width = int((lengths - cut).max())
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    s_ids = torch.full((n, s_width), pad, dtype=ids.dtype, device=ids.device)
    s_att = torch.zeros_like(s_ids)
    for r in range(n):
        rest = int(lengths[r] - cut[r])
        s_ids[r, :rest] = ids[r, int(cut[r]) : int(lengths[r])]
        s_att[r, :rest] = 1
    p_pos = (p_att.cumsum(dim=1) - 1).clamp_min(0)
    out = model.base_model(input_ids=p_ids, attention_mask=p_att, position_ids=p_pos, use_cache=True)
    cache = out.past_key_values
    cache.batch_repeat_interleave(g)
    full_att = torch.cat([p_att.repeat_interleave(g, dim=0), s_att], dim=1)
    s_pos = (full_att.cumsum(dim=1) - 1).clamp_min(0)[:, p_width:]
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    logits = model(input_ids=s_ids, attention_mask=full_att, position_ids=s_pos, **{name: cache}).logits
    return logits[:, 0]


class GRPO(PhaseTimer, NonFiniteGuard, L.LightningModule):
    """Group Relative Policy Optimization of one LM policy (LoRA over a frozen base, or a full copy).

    Args:
        policy: Causal LM (hub name or local path); its frozen weights are the reference.
        players: ``"lora"`` (one adapter over the frozen base; the disabled adapter is the reference) or
            ``"separate"`` (a trainable full copy and a frozen reference copy).
        reward_models: Sequence-classification reward models (paths), each one scalar; summed with
            ``reward_weights``.
        answer_reward: Add the RLVR reward: 1 when the reply's last ``\\boxed{}`` matches the prompt's reference.
        reward_weights: One weight per reward model, then one for the answer reward (default: all 1).
        reward_batch_size: Rows per reward-model forward (0: the whole batch at once).
        reward_max_length: Tokens per reward-model input (cut from the left).
        num_generations: G, samples per prompt (≥ 2: the group is the baseline).
        beta: KL coefficient β (0 skips the reference forward).
        clip: ε of the ratio clipping.
        updates_per_rollout: μ, optimizer steps per rollout (1: on-policy, the ratio is 1 in value).
        scale_rewards: Divide advantages by the group std (GRPO); ``False`` keeps the mean baseline only.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        adam_betas: AdamW betas.
        grad_clip: Gradient norm clip (``None``: none).
        temperature: Sampling temperature, also used for the log-probabilities.
        top_p: Nucleus mass (1.0: none).
        max_new_tokens: Tokens per reply.
        min_new_tokens: EOS is suppressed before this many tokens (fixes the work per step; 0: off).
        max_prompt_tokens: Prompt tokens kept (cut from the left, counted).
        system_prompt: System message of the chat template (``None``: none).
        chat_template: Render prompts with the tokenizer's chat template; ``False`` feeds them as they are.
        lora_r: LoRA rank.
        lora_alpha: LoRA alpha.
        lora_target_modules: Modules to adapt (``None``: peft's default for the architecture).
        dtype: Weights dtype of the policy and the reward models.
        gradient_checkpointing: Activation checkpointing of the policy.
        trust_remote_code: Off unless turned on.
        logprob_micro_batch: Rows per reference (and old-policy) log-probability forward (0: all at once).
        train_micro_batch: Rows per policy forward + backward (0: all at once); gradients are accumulated.
        max_consecutive_nonfinite: Stop after this many skipped steps in a row.
        eval_max_new_tokens: Tokens per greedy reply on validation (``None``: ``max_new_tokens``).
    """

    def __init__(
        self,
        policy: str,
        players: str = "lora",
        reward_models: list[str] | None = None,
        answer_reward: bool = True,
        reward_weights: list[float] | None = None,
        reward_batch_size: int = 0,
        reward_max_length: int = 1024,
        num_generations: int = 4,
        beta: float = 0.04,
        clip: float = 0.2,
        updates_per_rollout: int = 1,
        scale_rewards: bool = True,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        adam_betas: tuple[float, float] = (0.9, 0.999),
        grad_clip: float | None = 1.0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 256,
        min_new_tokens: int = 0,
        max_prompt_tokens: int = 1024,
        system_prompt: str | None = None,
        chat_template: bool = True,
        lora_r: int = 16,
        lora_alpha: int = 32,
        lora_target_modules: list[str] | None = None,
        dtype: str = "float32",
        gradient_checkpointing: bool = False,
        trust_remote_code: bool = False,
        logprob_micro_batch: int = 0,
        train_micro_batch: int = 0,
        max_consecutive_nonfinite: int = 10,
        eval_max_new_tokens: int | None = None,
    ) -> None:
        super().__init__()
        reward_models = list(reward_models or [])
        if not reward_models and not answer_reward:
            raise ValueError("no reward: give reward_models, or answer_reward: true, or both")
        n_rewards = len(reward_models) + int(answer_reward)
        if reward_weights is not None and len(reward_weights) != n_rewards:
            raise ValueError(
                f"reward_weights has {len(reward_weights)} entries but there are {n_rewards} rewards "
                f"({len(reward_models)} reward models{' + the answer reward' if answer_reward else ''})"
            )
        if num_generations < 2:
            raise ValueError(f"num_generations must be at least 2 for a group baseline, got {num_generations}")
        if beta < 0:
            raise ValueError(f"beta must be non-negative, got {beta}")
        if clip <= 0:
            raise ValueError(f"clip must be positive, got {clip}")
        if updates_per_rollout < 1:
            raise ValueError(f"updates_per_rollout must be at least 1, got {updates_per_rollout}")
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        if not 0 <= min_new_tokens <= max_new_tokens:
            raise ValueError(f"min_new_tokens={min_new_tokens} must be in [0, max_new_tokens={max_new_tokens}]")
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.players = PolicyBank(
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
        self.reward_models = (
            RewardModels(reward_models, reward_batch_size, reward_max_length, dtype, trust_remote_code)
            if reward_models
            else None
        )
        self.register_buffer(
            "reward_weight", torch.tensor(reward_weights or [1.0] * n_rewards, dtype=torch.float32), persistent=False
        )
        self.strict_loading = False  # frozen base and reward models are not stored; on_load_checkpoint checks the rest
        self.init_nonfinite_guard(max_consecutive_nonfinite)
        self.phase_times: dict[str, float] = {}

    # ------------------------------------------------------------------ pieces
    def configure_model(self) -> None:
        """Under FSDP2 (``ModelParallelStrategy``) shard the policy over the data-parallel mesh; elsewhere nothing."""
        shard_for_strategy(self, self.players, "GRPO")

    def setup(self, stage: str) -> None:  # noqa: D102
        if stage == "fit":  # FSDP refused; DeepSpeed clips by grad_clip in its engine
            fit_manual_backward_strategy(self.trainer.strategy, "GRPO", self.hparams.grad_clip)
        # sharded strategies: gather the policy's parameters once around each generate call, not once per token
        self.players.use_strategy(self.trainer.strategy)

    def format_prompts(self, prompts: Sequence[str]) -> list[str]:
        """The policy's inputs: chat-rendered (with the system prompt) or the prompts as they are."""
        if not self.hparams.chat_template:
            return list(prompts)
        return [self.players.chat(self.hparams.system_prompt, x) for x in prompts]

    def rewards(
        self,
        inputs: Sequence[str],
        completions: Sequence[str],
        references: Sequence[str | None],
        group_size: int = 1,
    ) -> Tensor:
        """Per-reward scores ``[N, K]`` (reward models first, then the answer reward), before weighting.

        ``group_size``: rows come in groups sampled from one prompt (their shared tokens are scored once).
        """
        cols = []
        if self.reward_models is not None:
            texts = [x + y for x, y in zip(inputs, completions)]
            cols.append(self.reward_models(texts, group_size=group_size).to(self.device))
        if self.hparams.answer_reward:
            cols.append(answer_rewards(completions, references).to(self.device).unsqueeze(1))
        return torch.cat(cols, dim=1)

    def _no_sync(self, last: bool) -> Any:
        """Skip the gradient all-reduce of every micro-batch but the last (DDP/FSDP ``no_sync``).

        Not under DeepSpeed: its engine refuses ``no_sync`` with ZeRO-2/3 (gradients are reduced into their
        partitions as they are produced) and keeps its own accumulation boundary, so every micro-batch's backward is
        reduced there. Under FSDP2 the policy's units skip their reduce-scatter instead (:func:`fsdp2_gradient_sync`).
        """
        if self._trainer is not None and sharded_strategy_kind(self.trainer.strategy) == "ModelParallelStrategy":
            return fsdp2_gradient_sync(self.players, enabled=last)
        wrapped = self.trainer.strategy.model if self._trainer is not None else None
        if last or wrapped is None or wrapped is self or not hasattr(wrapped, "no_sync"):
            return nullcontext()
        if sharded_strategy_kind(self.trainer.strategy) == "DeepSpeedStrategy":
            return nullcontext()
        return wrapped.no_sync()

    def _policy_loss(
        self, rollout, advantages: Tensor, ref: Tensor | None, old: Tensor | None
    ) -> dict[str, Tensor] | None:
        """Forward and backward of the policy in ``train_micro_batch`` chunks; the loss and stats of the batch.

        ``None`` when a chunk's loss is not finite (counted; the caller skips the optimizer step).
        """
        hp = self.hparams
        n, g = rollout.sequences.shape[0], rollout.group_size
        step = -(-(hp.train_micro_batch or n) // g) * g  # whole groups, so each chunk runs its prompts once
        total: dict[str, Tensor] = {}
        for i in range(0, n, step):
            part = _slice_rollout(rollout, i, i + step)
            with self._no_sync(last=i + step >= n):
                lp = self.players.token_logprobs(PLAYER, part, hp.temperature)
                loss, stats = grpo_loss(
                    lp,
                    part.completion_mask.to(lp.dtype),
                    advantages[i : i + step],
                    old_token_logprobs=None if old is None else old[i : i + step],
                    ref_token_logprobs=None if ref is None else ref[i : i + step],
                    clip=hp.clip,
                    beta=hp.beta,
                )
                if not self.check_finite(loss.detach(), "losses"):  # same decision on every rank
                    return None
                # grpo_loss averages over its rows: weight each chunk by its share of the batch
                self.manual_backward(loss * (lp.shape[0] / n))
            w = lp.shape[0] / n
            for k, v in {"loss": loss.detach(), **stats}.items():
                total[k] = total.get(k, 0.0) + w * v
        return total

    # ------------------------------------------------------------------ training
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:  # noqa: D102
        hp = self.hparams
        opt = self.optimizers()
        prompts, refs = list(batch["prompt"]), list(batch["reference"])
        b, g = len(prompts), hp.num_generations
        self.phase_times = {}
        inputs = self.format_prompts(prompts)
        with self._timed("generate"):
            roll = self.players.generate(
                PLAYER,
                inputs,
                g,
                temperature=hp.temperature,
                top_p=hp.top_p,
                max_new_tokens=hp.max_new_tokens,
                min_new_tokens=hp.min_new_tokens,
            )
        with self._timed("score"):
            per_reward = self.rewards(
                [x for x in inputs for _ in range(g)], roll.texts, [r for r in refs for _ in range(g)], group_size=g
            )
            reward = (per_reward * self.reward_weight).sum(dim=1)
        if not self.check_finite(reward, "rewards"):  # same decision on every rank: nobody steps
            return
        advantages = group_advantages(reward, g, scale=hp.scale_rewards)
        ref = old = None
        with torch.no_grad():
            if hp.beta > 0:
                with self._timed("ref_logprobs"):
                    ref = self.players.token_logprobs(None, roll, hp.temperature, hp.logprob_micro_batch)
            if hp.updates_per_rollout > 1:
                with self._timed("old_logprobs"):
                    old = self.players.token_logprobs(PLAYER, roll, hp.temperature, hp.logprob_micro_batch)
        for _ in range(hp.updates_per_rollout):
            opt.zero_grad()
            with self._timed("backward"):
                out = self._policy_loss(roll, advantages, ref, old)
            if out is None:
                opt.zero_grad()
                return
            with self._timed("optimizer"):
                if hp.grad_clip is not None:
                    self.clip_gradients(opt, gradient_clip_val=hp.grad_clip, gradient_clip_algorithm="norm")
                opt.step()
        self.phase_times["step"] = sum(self.phase_times.values())
        self.phase_times["generated_tokens"] = float(roll.completion_mask.sum())
        logs = {f"time/{k}": float(v) for k, v in self.phase_times.items()}
        logs.update(
            {
                "train/loss": out["loss"],
                "train/reward": reward.mean(),
                "train/reward_std": reward.view(b, g).std(dim=1).mean(),
                "train/kl": out["kl"],
                "train/clip_fraction": out["clip_fraction"],
                "train/completion_tokens": roll.completion_mask.sum(1).float().mean(),
                "train/empty_completions": float(roll.num_empty),
            }
        )
        names = [f"rm{i}" for i in range(len(self.reward_models or []))] + (["answer"] if hp.answer_reward else [])
        logs.update({f"train/reward_{n}": per_reward[:, i].mean() for i, n in enumerate(names)})
        self.log_dict(logs, batch_size=b)

    def configure_optimizers(self) -> torch.optim.Optimizer:  # noqa: D102
        hp = self.hparams
        # trainable = the adapter (or the policy copy); selected by requires_grad, which survives FSDP flattening
        params = [p for p in self.players.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.adam_betas))

    # ------------------------------------------------------------------ evaluation
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Greedy reply per held-out prompt: mean reward (``val/reward``) and, with references, ``val/accuracy``."""
        hp = self.hparams
        prompts, refs = list(batch["prompt"]), list(batch["reference"])
        inputs = self.format_prompts(prompts)
        roll = self.players.generate(
            PLAYER, inputs, 1, max_new_tokens=hp.eval_max_new_tokens or hp.max_new_tokens, do_sample=False
        )
        per_reward = self.rewards(inputs, roll.texts, refs)
        logs = {"val/reward": (per_reward * self.reward_weight).sum(dim=1).mean()}
        if all(r is not None for r in refs):
            logs["val/accuracy"] = answer_rewards(roll.texts, refs).mean()
        self.log_dict(logs, batch_size=len(prompts), sync_dist=True)

    test_step = validation_step

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the adapter (or trained copy), the counters and the RNG states; drop the frozen weights."""
        sd = checkpoint["state_dict"]
        keep = {f"players.{n}" for n, p in self.players.named_parameters() if p.requires_grad}
        for name in list(sd):
            if name not in keep:
                del sd[name]
        checkpoint["grpo_counters"] = self.nonfinite_state()
        # tensors and plain values only, so that `fit --ckpt_path` (torch.load with weights_only=True) reads it
        checkpoint["grpo_rng"] = collect_rng_state()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint missing any trainable tensor; restore the counters and the RNG states."""
        trainable = {f"players.{n}" for n, p in self.players.named_parameters() if p.requires_grad}
        require_trainable_tensors(checkpoint, trainable)
        self.load_nonfinite_state(checkpoint.get("grpo_counters"))
        if checkpoint.get("grpo_rng") is not None:
            restore_rng_state(checkpoint["grpo_rng"])


def _slice_rollout(rollout, start: int, stop: int):
    """Rows ``[start, stop)`` of a rollout (same prompt width)."""
    n = rollout.sequences.shape[0]
    if start == 0 and stop >= n:
        return rollout
    g = rollout.group_size
    whole_groups = start % g == 0 and (min(stop, n) - start) % g == 0
    return type(rollout)(
        rollout.sequences[start:stop],
        rollout.attention_mask[start:stop],
        rollout.prompt_width,
        rollout.completion_mask[start:stop],
        rollout.texts[start:stop],
        group_size=g if whole_groups else 1,
    )
