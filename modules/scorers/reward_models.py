"""Reward scorers of GRPO: the answer checker (RLVR) and frozen sequence-classification reward models."""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from alignment_games.modules.algorithms.answers import answers_match, extract_final_answer
from alignment_games.modules.lm.models import DTYPES, check_exists, resolve_name_or_path
from alignment_games.modules.lm.pooled_scoring import pooled_scores, prefix_cache


def answer_rewards(completions: Sequence[str], references: Sequence[str | None]) -> Tensor:
    """RLVR reward: 1.0 where the completion's last ``\\boxed{}`` equals the reference answer, else 0.0.

    Raises:
        ValueError: naming the row, when a reference is missing.
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


class RewardModels(nn.Module):
    """Frozen sequence-classification reward models (one scalar each), scored in batches.

    Each scores ``prompt + completion`` (right-padded, read at the last real token, as TRL does); models sharing a
    tokenizer share one tokenisation. With ``group_size`` G > 1 a group's common prefix runs once (KV cache shared).

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

        from alignment_games.modules.lm.models import load_tokenizer

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
                options = {"padding": True, "truncation": True, "max_length": self.max_length}
                encoded[fp] = tok(list(texts), return_tensors="pt", add_special_tokens=False, **options)
            enc = encoded[fp]
            n = enc["input_ids"].shape[0]
            g = group_size if group_size > 1 and n % group_size == 0 and _takes_cache(model) else 1
            step = -(-(self.batch_size or n) // g) * g  # whole groups per chunk
            scores = []
            for i in range(0, n, step):
                ids, att = enc["input_ids"][i : i + step].to(device), enc["attention_mask"][i : i + step].to(device)
                shared = _shared_prefix_scores(model, ids, att, g) if g > 1 else None
                scores.append(shared if shared is not None else pooled_scores(model, ids, att)[:, 0])
            cols.append(torch.cat(scores).float())
        return torch.stack(cols, dim=1)


def _takes_cache(model: nn.Module) -> bool:
    params = inspect.signature(type(model).forward).parameters
    return hasattr(model, "base_model") and ("past_key_values" in params or "cache" in params)


def _shared_prefix_scores(model: nn.Module, ids: Tensor, att: Tensor, g: int) -> Tensor | None:
    """Scores of right-padded rows in groups of ``g``, each group's common prefix run once (``None``: < 2 tokens)."""
    n, width = ids.shape
    lengths, rows = att.sum(dim=1), ids.view(n // g, g, width)
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
    cache = prefix_cache(model, p_ids, p_att, position_ids=p_pos)
    cache.batch_repeat_interleave(g)
    full_att = torch.cat([p_att.repeat_interleave(g, dim=0), s_att], dim=1)
    s_pos = (full_att.cumsum(dim=1) - 1).clamp_min(0)[:, p_width:]
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    return pooled_scores(model, s_ids, full_att, position_ids=s_pos, **{name: cache})[:, 0]
