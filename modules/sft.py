"""Supervised warm start of a causal LM on (prompt, response) pairs, loss on response tokens only."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import weakref
from functools import partial
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from typing_extensions import override

from alignment_games.modules.algorithms.checks import require_at_least, require_positive
from alignment_games.modules.base import AutomaticFamily
from alignment_games.modules.checkpoints.export import EXPORT_RECORD, Player, record_of, run_record
from alignment_games.modules.checkpoints.trust import family_name, seal_checkpoint
from alignment_games.modules.distributed.sharding import is_fsdp2, parameter_gathering, shard_for_strategy
from alignment_games.modules.lm.logprobs import head_inputs, head_token_logprobs
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.models import TINY_TOKENIZERS, build_tiny_causal_lm
from alignment_games.modules.lm.precision import cast_frozen_for_strategy
from alignment_games.modules.lm.text import pad_sequences, render_chat
from alignment_games.modules.training.artifacts import atomic_folder
from alignment_games.modules.training.schedules import warmup_cosine_factor


class CausalLMSFT(AutomaticFamily):
    """Fine-tune a causal LM on chat-formatted (prompt, response) pairs.

    Args:
        lm: The model to fine-tune and how it loads (:class:`ModelConfig`); ``None``: a tiny random Qwen2 (offline).
        lora: Train a LoRA adapter over the frozen base instead of every weight, and save only the adapter.
        tiny_config: Overrides of the tiny Qwen2 config (``hidden_size``, ``num_hidden_layers``, ...; ``lm: null``).
        tiny_tokenizer: The tiny model's tokenizer: ``byte`` or ``task``
          (:mod:`alignment_games.modules.lm.task_tokenizer`).
        output_dir: Where the model (or adapter) and tokenizer are saved after ``fit`` (a tiny base in ``_init``).
        system_prompt: System message of every example that brings none of its own (see :meth:`encode`).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        max_length: Tokens per example (prompt cut from the left first).
        seed: Seed of the tiny model's initialisation.
        warmup_steps: With ``cosine_decay``, steps of linear warmup to ``lr``.
        cosine_decay: Decay the rate along a cosine to ``lr * min_lr_ratio`` at ``trainer.max_steps`` (off: constant).
        min_lr_ratio: The final learning rate's share of ``lr`` under ``cosine_decay``.
        **training: :class:`~alignment_games.modules.base.AutomaticFamily`'s arguments (non-finite limit, optimizer).
    """

    def __init__(
        self,
        lm: ModelConfig | None = None,
        lora: bool = False,
        tiny_config: dict[str, Any] | None = None,
        tiny_tokenizer: str = "byte",
        output_dir: str = "artifacts/tiny_policy",
        system_prompt: str = "You are a helpful assistant.",
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        max_length: int = 512,
        seed: int = 0,
        warmup_steps: int = 0,
        cosine_decay: bool = False,
        min_lr_ratio: float = 0.1,
        **training: Any,
    ) -> None:
        super().__init__(**training)
        require_positive(lr=lr)
        require_at_least(weight_decay=(weight_decay, 0.0), max_length=(max_length, 1), warmup_steps=(warmup_steps, 0))
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must lie in [0, 1], got {min_lr_ratio}")
        if tiny_tokenizer not in TINY_TOKENIZERS:
            raise ValueError(f"tiny_tokenizer must be one of {list(TINY_TOKENIZERS)}, got {tiny_tokenizer!r}")
        lm = None if lm is None else ModelConfig.coerce(lm)
        if lm is not None and lm.load_in_4bit and not lora:
            raise ValueError("lm.load_in_4bit: a 4-bit model cannot be fine-tuned in full; set lora: true (QLoRA)")
        self.save_hyperparameters(ignore=["lm", "optimizer"])
        self.hparams.update(lm=lm and lm.as_dict(), max_consecutive_nonfinite=self.max_consecutive_nonfinite)
        # the tiny base is built in a temporary folder, copied to output_dir/_init only by the save at the end of fit
        self._tiny_init: str | None = None
        source = lm
        if lm is None:
            self._tiny_init = tempfile.mkdtemp(prefix="sft_tiny_init_")
            weakref.finalize(self, shutil.rmtree, self._tiny_init, True)
            build_tiny_causal_lm(self._tiny_init, config=tiny_config, seed=seed, tokenizer=tiny_tokenizer)
            source, lm = ModelConfig(self._tiny_init), ModelConfig(os.path.join(output_dir, "_init"))
        self.lm = lm  # the base, recorded beside the saved model (export.json)
        self.tokenizer = source.load_tokenizer(padding_side="right")
        base = source.load_model("causal_lm", frozen=lora)
        if self._tiny_init is not None:  # the saved files name the base where it is saved, not the temporary folder
            base.name_or_path = base.config._name_or_path = lm.name_or_path
        self.model = source.with_adapters(base, ["default"]) if lora else base
        # with an adapter only it is saved in checkpoints; the frozen base is reloaded from its path
        self.strict_loading = not lora
        # tokens whose logits are formed at once by the loss; None: as many as fit LOGIT_CHUNK_BYTES of fp32
        self.logit_chunk_tokens: int | None = None

    def encode(
        self, prompts: list[str | list[dict[str, str]]], responses: list[str], systems: list[str | None] | None = None
    ) -> dict[str, torch.Tensor]:
        """Right-padded ``input_ids``, ``attention_mask``, ``labels`` (−100 off the response); prompts: text or chat."""
        rows, labels = [], []
        eos = self.tokenizer.eos_token_id
        systems = systems or [None] * len(prompts)
        for system, x, y in zip(systems, prompts, responses):
            system = {"role": "system", "content": self.hparams.system_prompt if system is None else system}
            if isinstance(x, str):
                messages = [system, {"role": "user", "content": x}]
            else:
                messages = list(x) if x and x[0]["role"] == "system" else [system, *x]
            prompt = render_chat(self.tokenizer, messages, add_generation_prompt=True)
            p_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            r_ids = self.tokenizer(y, add_special_tokens=False)["input_ids"] + [eos]
            room = self.hparams.max_length - len(r_ids)
            p_ids = p_ids[-room:] if room > 0 else []
            rows.append((p_ids + r_ids)[: self.hparams.max_length])
            labels.append(([-100] * len(p_ids) + r_ids)[: self.hparams.max_length])
        return {**pad_sequences(rows, self.tokenizer.pad_token_id), "labels": pad_sequences(labels, -100)["input_ids"]}

    def _loss(self, batch: dict[str, Any]) -> torch.Tensor:
        """Mean cross-entropy over the response tokens, whose logits are formed a chunk at a time."""
        enc = self.encode(batch["prompt"], batch["response"], batch.get("system"))
        enc = {k: v.to(self.device) for k, v in enc.items()}
        with head_inputs(self.model) as seen:
            self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
        labels = enc["labels"][:, 1:]
        scored = labels != -100
        logprobs = head_token_logprobs(
            self.model, seen[0][:, :-1][scored], labels[scored], 1.0, self.logit_chunk_tokens
        )
        return -logprobs.mean()

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor | None:
        loss = self._loss(batch)
        if not self.check_finite(loss, "losses"):
            return None  # no backward, no optimizer step (the same on every rank)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch["prompt"]))
        return loss

    def trainable_state_names(self) -> set[str]:
        """State-dict names of the trained tensors (every weight, or the adapter's)."""
        return {f"model.{n}" for n, p in self.model.named_parameters() if p.requires_grad}

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the adapter only with ``lora`` (the base is reloaded from its path); record the family; refuse NaN.

        Raises:
            RuntimeError: a kept tensor or an optimizer moment is NaN or inf (nothing is written).
        """
        checkpoint["nonfinite"] = self.nonfinite_state()
        state_dict = checkpoint.get("state_dict")
        if self.hparams.lora and state_dict is not None:
            keep = self.trainable_state_names()
            for name in [n for n in state_dict if n not in keep]:
                del state_dict[name]
        seal_checkpoint(self, checkpoint, "SFT")

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch), batch_size=len(batch["prompt"]), sync_dist=True)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer | dict[str, Any]:
        """:meth:`make_optimizer` over the trained weights; with ``cosine_decay``, a warmup-cosine schedule per step.

        Raises:
            ValueError: with ``cosine_decay`` and no ``trainer.max_steps`` above ``warmup_steps``.
        """
        hp = self.hparams
        params = [p for p in self.model.parameters() if p.requires_grad]  # every weight, or the adapter
        optimizer = self.make_optimizer(params, hp.lr, weight_decay=hp.weight_decay)
        if not hp.cosine_decay:
            return optimizer
        total = self.trainer.max_steps
        if total is None or total <= hp.warmup_steps:
            raise ValueError(f"cosine_decay needs trainer.max_steps above warmup_steps={hp.warmup_steps}, got {total}")
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            partial(warmup_cosine_factor, warmup_steps=hp.warmup_steps, total_steps=total, floor=hp.min_lr_ratio),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    @override
    def configure_model(self) -> None:
        """Under FSDP2 shard the model (adapters included), one unit per decoder block; elsewhere nothing."""
        shard_for_strategy(self, self.model.get_base_model() if self.hparams.lora else self.model, "SFT")

    @override
    def setup(self, stage: str) -> None:
        """Under ``bf16-mixed`` (one device, DDP) hold the frozen base under the adapter in bf16, cast once."""
        super().setup(stage)
        cast_frozen_for_strategy(self.model, self.trainer.strategy)

    @override
    def on_fit_end(self) -> None:
        """Save the model (or adapter) on rank 0, gathered whole first (by every rank) under sharded strategies."""
        if self.trainer.fast_dev_run:  # a smoke run leaves nothing behind (nor replaces a real artifact)
            rank_zero_info(f"fast_dev_run: the model is not saved to {self.hparams.output_dir}")
            return
        if is_fsdp2(self.trainer.strategy):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            self._save(get_model_state_dict(self.model, options=options))
            return
        with parameter_gathering(self.trainer.strategy, self.model)():
            self._save()

    def export_players(self) -> list[Player]:
        """The fine-tuned model as one player, ``policy``: its adapter (``lora``) or its whole weights."""
        return [Player("policy", self.lm, self.model, "default" if self.hparams.lora else None, self.tokenizer)]

    @rank_zero_only
    def _save(self, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write the whole folder beside ``output_dir`` and swap it in (never a torn artifact), the tiny base in it."""
        out = self.hparams.output_dir
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with atomic_folder(out) as tmp:
            self.model.save_pretrained(tmp, state_dict=state_dict)
            self.tokenizer.save_pretrained(tmp)
            (player,) = self.export_players()
            kind = "lora_adapter" if self.hparams.lora else "full_model"
            source = {"family": family_name(self), "global_step": self.global_step, **run_record(trainer=self._trainer)}
            with open(os.path.join(tmp, EXPORT_RECORD), "w") as f:
                json.dump(record_of(player, kind, source), f, indent=2)
            if self._tiny_init is not None:  # the tiny base (lm: null) an adapter refers to
                shutil.copytree(self._tiny_init, os.path.join(tmp, "_init"))
        rank_zero_info(f"warm-started {'adapter' if self.hparams.lora else 'policy'} saved to {out}")
