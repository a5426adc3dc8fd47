"""Supervised warm start of a causal LM on (prompt, response) pairs, loss on response tokens only.

Used to make tiny offline policies write text-like replies before a game starts (the references of the games are
then these warm-started models). At the end of ``fit`` the model and tokenizer are saved with ``save_pretrained``
into ``output_dir``, so the games load them through the same ``from_pretrained`` path as a hub checkpoint.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only

from modules.lm.models import build_tiny_causal_lm, load_model, load_tokenizer
from modules.distributed.sharding import parameter_gathering, shard_for_strategy, sharded_strategy_kind
from modules.training.faults import NonFiniteGuard

__all__ = ["CausalLMSFT"]


class CausalLMSFT(NonFiniteGuard, L.LightningModule):
    """Fine-tune a causal LM on chat-formatted (prompt, response) pairs.

    Args:
        model: Hub name or local path; ``None`` builds a tiny random Qwen2 from ``tiny_config`` (offline default).
        tiny_config: Overrides of the tiny Qwen2 config dict (``hidden_size``, ``num_hidden_layers``, ...).
        output_dir: Where the fine-tuned model and tokenizer are saved at the end of ``fit``.
        system_prompt: System message of every example.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        max_length: Tokens per example (prompt cut from the left first).
        seed: Seed of the tiny model's initialisation.
        dtype: Weights dtype.
        max_consecutive_nonfinite: A batch with a non-finite loss is skipped (no update), logged and counted;
            this many in a row stop training with an error, the last checkpoint intact.
    """

    def __init__(
        self,
        model: str | None = None,
        tiny_config: dict[str, Any] | None = None,
        output_dir: str = "artifacts/tiny_policy",
        system_prompt: str = "You are a helpful assistant.",
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        max_length: int = 512,
        seed: int = 0,
        dtype: str = "float32",
        max_consecutive_nonfinite: int = 10,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.init_nonfinite_guard(max_consecutive_nonfinite)
        path = model
        if path is None:
            path = build_tiny_causal_lm(os.path.join(output_dir, "_init"), config=tiny_config, seed=seed)
        self.tokenizer = load_tokenizer(path, padding_side="right")
        self.model = load_model(path, task="causal_lm", dtype=dtype)

    def encode(
        self, prompts: list[str], responses: list[str], systems: list[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (−100 outside response tokens).

        ``systems`` gives a system message per example (the batch's ``system`` field); else ``system_prompt``.
        """
        rows, labels = [], []
        eos = self.tokenizer.eos_token_id
        systems = systems or [self.hparams.system_prompt] * len(prompts)
        for system, x, y in zip(systems, prompts, responses):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": x}]
            prompt = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            p_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            r_ids = self.tokenizer(y, add_special_tokens=False)["input_ids"] + [eos]
            room = self.hparams.max_length - len(r_ids)
            p_ids = p_ids[-room:] if room > 0 else []
            ids = (p_ids + r_ids)[: self.hparams.max_length]
            rows.append(ids)
            labels.append(([-100] * len(p_ids) + r_ids)[: self.hparams.max_length])
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        lab = torch.full((len(rows), width), -100, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (r, lb) in enumerate(zip(rows, labels)):
            input_ids[i, : len(r)] = torch.tensor(r)
            lab[i, : len(lb)] = torch.tensor(lb)
            mask[i, : len(r)] = 1
        return {"input_ids": input_ids, "attention_mask": mask, "labels": lab}

    def _loss(self, batch: dict[str, Any]) -> torch.Tensor:
        enc = self.encode(batch["prompt"], batch["response"], batch.get("system"))
        enc = {k: v.to(self.device) for k, v in enc.items()}
        logits = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), enc["labels"][:, 1:].flatten(), ignore_index=-100)

    def training_step(self, batch, batch_idx):  # noqa: D102
        loss = self._loss(batch)
        if not self.check_finite(loss, "losses"):
            return None  # no backward, no optimizer step (the same on every rank)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch["prompt"]))
        return loss

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:  # noqa: D102
        checkpoint["nonfinite"] = self.nonfinite_state()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:  # noqa: D102
        self.load_nonfinite_state(checkpoint.get("nonfinite"))

    def validation_step(self, batch, batch_idx):  # noqa: D102
        self.log("val/loss", self._loss(batch), batch_size=len(batch["prompt"]), sync_dist=True)

    def configure_optimizers(self):  # noqa: D102
        return torch.optim.AdamW(self.model.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)

    def configure_model(self) -> None:
        """Under FSDP2 (``ModelParallelStrategy``) shard the model, one unit per decoder block; elsewhere nothing."""
        shard_for_strategy(self, self.model, "SFT")

    def on_fit_end(self) -> None:
        """Save the model for the next job (rank 0), gathered whole first under sharded strategies.

        Under ZeRO-3 or FSDP every rank takes part in the gather (a collective; see
        :func:`modules.distributed.sharding.parameter_gathering`), then rank 0 writes the whole weights. Under FSDP2 every rank
        takes part in assembling the full state dict (``get_model_state_dict(full_state_dict=True)``), which rank 0
        writes.
        """
        if sharded_strategy_kind(self.trainer.strategy) == "ModelParallelStrategy":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: PLC0415

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            self._save(get_model_state_dict(self.model, options=options))
            return
        with parameter_gathering(self.trainer.strategy, self.model)():
            self._save()

    @rank_zero_only
    def _save(self, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        os.makedirs(self.hparams.output_dir, exist_ok=True)
        self.model.save_pretrained(self.hparams.output_dir, state_dict=state_dict)
        self.tokenizer.save_pretrained(self.hparams.output_dir)
        rank_zero_info(f"warm-started policy saved to {self.hparams.output_dir}")
