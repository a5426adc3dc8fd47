"""Language-model players on one frozen base: LoRA adapters per player, the disabled adapter as the reference.

:class:`PolicyBank` owns the models and does the two things every game needs, batched:

* :meth:`PolicyBank.generate`: one ``generate`` call per player per step for all prompts × samples (left padding,
  KV cache), returning a :class:`Rollout` whose token layout is ``[left-padded prompt | completion | right pad]``;
* :meth:`PolicyBank.logprobs`: the sum of log-probabilities of the completion tokens only (at the sampling
  temperature), for a player (with gradients) or the frozen reference (``player=None``: adapters disabled).

With ``players="separate"`` each player is a full trainable copy and one frozen copy serves as the reference.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from modules.models import apply_lora, load_model, load_tokenizer

__all__ = ["PolicyBank", "Rollout", "fill_template"]

_FIELD = re.compile(r"\{(prompt|leader_response)\}")


def fill_template(template: str, **values: str) -> str:
    """Replace ``{prompt}`` / ``{leader_response}`` in one pass over the template; data text is never re-read."""
    return _FIELD.sub(lambda m: values.get(m.group(1), m.group(0)), template)


@dataclass
class Rollout:
    """Sampled sequences of one player.

    Attributes:
        sequences: ``[N, P + C]`` token ids: left-padded prompt (width P) then completion (right-padded).
        attention_mask: ``[N, P + C]``.
        prompt_width: P.
        completion_mask: ``[N, C]``: 1 on completion tokens up to and including the first EOS.
        texts: Decoded completions.
    """

    sequences: Tensor
    attention_mask: Tensor
    prompt_width: int
    completion_mask: Tensor
    texts: list[str]

    @property
    def num_empty(self) -> int:
        """Completions that are empty once special tokens are dropped."""
        return sum(1 for t in self.texts if not t.strip())


class PolicyBank(nn.Module):
    """The players of a game over one base model.

    Args:
        name_or_path: Causal LM by hub name or local path.
        players: Player names (e.g. ``["leader", "follower"]``).
        mode: ``"lora"`` (adapters over one frozen base) or ``"separate"`` (a trainable copy each + one frozen
            reference copy).
        lora_r: LoRA rank.
        lora_alpha: LoRA alpha.
        lora_target_modules: Modules to adapt (``None``: peft's default for the architecture).
        dtype: Weights dtype.
        gradient_checkpointing: Activation checkpointing of the base.
        trust_remote_code: Off unless turned on.
        max_prompt_tokens: Prompts longer than this are cut from the left, with a warning, and counted.
    """

    def __init__(
        self,
        name_or_path: str,
        players: Sequence[str] = ("leader", "follower"),
        mode: str = "lora",
        lora_r: int = 16,
        lora_alpha: int = 32,
        lora_target_modules: list[str] | str | None = None,
        dtype: str = "float32",
        gradient_checkpointing: bool = False,
        trust_remote_code: bool = False,
        max_prompt_tokens: int = 1024,
    ) -> None:
        super().__init__()
        if mode not in ("lora", "separate"):
            raise ValueError(f"players mode must be 'lora' or 'separate', got {mode!r}")
        self.mode, self.player_names, self.max_prompt_tokens = mode, list(players), max_prompt_tokens
        self.tokenizer = load_tokenizer(name_or_path, trust_remote_code=trust_remote_code, padding_side="left")
        load = dict(
            task="causal_lm",
            dtype=dtype,
            gradient_checkpointing=gradient_checkpointing,
            trust_remote_code=trust_remote_code,
        )
        if mode == "lora":
            base = load_model(name_or_path, **load)
            base.requires_grad_(False)
            self.model = apply_lora(
                base, r=lora_r, alpha=lora_alpha, target_modules=lora_target_modules, adapter_names=self.player_names
            )
            self._all_players_trainable()  # peft trains only the active adapter: train all players
        else:
            self.models = nn.ModuleDict({p: load_model(name_or_path, **load) for p in self.player_names})
            self.reference = load_model(name_or_path, **load).eval().requires_grad_(False)
        self.truncated_prompts = 0

    def player_parameters(self, player: str) -> list[nn.Parameter]:
        """The trainable parameters of one player (its adapter, or its copy)."""
        if player not in self.player_names:
            raise KeyError(f"unknown player {player!r}; players: {self.player_names}")
        if self.mode == "separate":
            return list(self.models[player].parameters())
        return [p for n, p in self.model.named_parameters() if f".{player}." in n]

    @contextmanager
    def _use(self, player: str | None) -> Iterator[nn.Module]:
        if self.mode == "separate":
            yield self.reference if player is None else self.models[player]
            return
        if player is None:
            with self.model.disable_adapter():
                yield self.model
        else:
            self.model.set_adapter(player)
            self._all_players_trainable()
            yield self.model
        # peft's set_adapter / disable_adapter freeze the inactive adapters; a graph built earlier with another
        # player would then lose its gradients at backward time, so every player is made trainable again.
        self._all_players_trainable()

    def _all_players_trainable(self) -> None:
        for name, p in self.model.named_parameters():
            if any(f".{q}." in name for q in self.player_names):
                p.requires_grad_(True)

    def chat(self, system: str | None, user: str) -> str:
        """Render one conversation turn with the tokenizer's chat template, ready for the assistant's reply."""
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "

    def _encode_prompts(self, prompts: Sequence[str]) -> dict[str, Tensor]:
        enc = self.tokenizer(list(prompts), add_special_tokens=False)
        ids = enc["input_ids"]
        cut = [i for i, s in enumerate(ids) if len(s) > self.max_prompt_tokens]
        if cut:
            self.truncated_prompts += len(cut)
            warnings.warn(
                f"{len(cut)} prompts longer than max_prompt_tokens={self.max_prompt_tokens} were cut from the left",
                stacklevel=3,
            )
            ids = [s[-self.max_prompt_tokens :] for s in ids]
        width = max(len(s) for s in ids)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, s in enumerate(ids):
            if s:
                input_ids[i, width - len(s) :] = torch.tensor(s)
                mask[i, width - len(s) :] = 1
        return {"input_ids": input_ids, "attention_mask": mask}

    @torch.no_grad()
    def generate(
        self,
        player: str | None,
        prompts: Sequence[str],
        num_samples: int,
        temperature: float = 0.6,
        top_p: float = 1.0,
        max_new_tokens: int = 128,
        do_sample: bool = True,
    ) -> Rollout:
        """Sample ``num_samples`` completions for each prompt in one batched call (row ``i*num_samples + s``)."""
        device = next(self.parameters()).device
        enc = {k: v.repeat_interleave(num_samples, dim=0).to(device) for k, v in self._encode_prompts(prompts).items()}
        eos = self.tokenizer.eos_token_id
        with self._use(player) as model:
            was_training = model.training
            model.eval()
            out = model.generate(
                **enc,
                do_sample=do_sample,
                temperature=temperature if do_sample else None,
                top_p=top_p if do_sample else None,
                top_k=0 if do_sample else None,
                max_new_tokens=max_new_tokens,
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=eos,
            )
            model.train(was_training)
        width = enc["input_ids"].shape[1]
        completion = out[:, width:]
        is_eos = completion == eos
        # keep tokens up to and including the first EOS (generating EOS is an action too)
        after_first_eos = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
        completion_mask = (~after_first_eos).long()
        if self.tokenizer.pad_token_id != eos:
            completion_mask &= (completion != self.tokenizer.pad_token_id).long()
        texts = self.tokenizer.batch_decode(completion * completion_mask, skip_special_tokens=True)
        attention = torch.cat([enc["attention_mask"], completion_mask], dim=1)
        return Rollout(out, attention, width, completion_mask, texts)

    def token_logprobs(
        self, player: str | None, rollout: Rollout, temperature: float = 0.6, micro_batch: int = 0
    ) -> Tensor:
        """Per-token ``log softmax(logits / T)`` of the completion tokens, ``[N, C]``, zero outside the completion.

        Only the completion positions are turned into log-probabilities (the prompt's logits are never normalised);
        ``micro_batch`` rows at a time bound the memory of the ``[rows, C, vocab]`` logits. Gradients flow unless
        called under ``no_grad``; ``player=None`` is the frozen reference (adapters disabled).
        """
        seq, att, width = rollout.sequences, rollout.attention_mask, rollout.prompt_width
        cmask = rollout.completion_mask.to(seq.device)
        n = seq.shape[0]
        step = micro_batch or n
        out = []
        with self._use(player) as model:
            for i in range(0, n, step):
                s, a = seq[i : i + step], att[i : i + step]
                pos = (a.cumsum(dim=1) - 1).clamp_min(0)
                logits = model(input_ids=s, attention_mask=a, position_ids=pos).logits
                logits = logits[:, width - 1 : -1].float() / temperature  # predicts the completion tokens
                target = s[:, width:]
                lp = torch.log_softmax(logits, dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
                out.append(lp * cmask[i : i + step])
        return torch.cat(out)

    def logprobs(self, player: str | None, rollout: Rollout, temperature: float = 0.6, micro_batch: int = 0) -> Tensor:
        """Sum of :meth:`token_logprobs` over the completion, ``[N]``."""
        return self.token_logprobs(player, rollout, temperature, micro_batch).sum(dim=1)
