"""The pooled last layer: the same scores as transformers' own forward, with the last layer's MLP run once per row."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification, Qwen2Config, Qwen2ForSequenceClassification

from alignment_games.modules.lm.models import build_tiny_reward_model
from alignment_games.modules.lm.pooled_scoring import (
    pooled_positions,
    pooled_scores,
    prefix_cache,
    supports_pooled_last_layer,
)
from alignment_games.modules.scorers.reward_models import RewardModels

PAD = 0
SMALL = dict(
    vocab_size=50,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=PAD,
)


def _model(kind: str, **extra):
    torch.manual_seed(0)
    if kind == "qwen2":
        return Qwen2ForSequenceClassification(Qwen2Config(**SMALL, num_labels=2, **extra)).eval()
    return LlamaForSequenceClassification(LlamaConfig(**SMALL, num_labels=2, **extra)).eval()


def _batch():
    """Right-padded rows of lengths 7, 3, 5 and 7; the third row ends in a pad-id token (it is read before it)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 50, (4, 7), generator=g)
    mask = torch.ones_like(ids)
    for row, length in ((1, 3), (2, 5)):
        ids[row, length:], mask[row, length:] = PAD, 0
    ids[2, 4] = PAD  # a real token equal to the pad id
    return ids, mask


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_pooled_scores_equal_the_full_forward_and_run_the_last_mlp_once_per_row(kind):
    model = _model(kind)
    assert supports_pooled_last_layer(model)
    ids, mask = _batch()
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask).logits
        seen = []
        hook = model.model.layers[-1].mlp.register_forward_hook(lambda m, a, o: seen.append(tuple(a[0].shape)))
        got = pooled_scores(model, ids, mask)
        hook.remove()
    assert torch.allclose(got, full, atol=1e-6)
    assert seen == [(4, 32)]  # one position per row, not [4, 7, 32]
    assert pooled_positions(ids, PAD).tolist() == [6, 2, 3, 6]  # row 2: the pad-id token at 4 is skipped, as HF does
    assert isinstance(model.model.layers[-1], type(model.model.layers[0]))  # the layer is put back


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_a_prefix_cache_then_pooled_suffix_equals_the_full_forward(kind):
    model = _model(kind)
    ids = torch.randint(1, 50, (4, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    prefix, suffix = ids[:, :4], ids[:, 4:]
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask).logits
        seen = []
        hook = model.model.layers[-1].mlp.register_forward_hook(lambda m, a, o: seen.append(tuple(a[0].shape)))
        cache = prefix_cache(model, prefix, mask[:, :4])
        assert seen == []  # the prefix's last layer wrote keys and values only
        got = pooled_scores(model, suffix, mask, cache=cache)
        hook.remove()
    assert cache.get_seq_length() == 7
    assert torch.allclose(got, full, atol=1e-6)


def test_an_unsupported_layer_runs_the_models_own_forward():
    model = _model("qwen2", use_sliding_window=True, sliding_window=3, max_window_layers=0)
    assert not supports_pooled_last_layer(model)
    ids, mask = _batch()
    with torch.no_grad():
        assert torch.equal(pooled_scores(model, ids, mask), model(input_ids=ids, attention_mask=mask).logits)
    assert not supports_pooled_last_layer(_model("qwen2").train())


def test_the_layer_is_restored_when_the_forward_raises():
    model = _model("qwen2")
    last = model.model.layers[-1]
    with pytest.raises(IndexError):
        pooled_scores(model, torch.full((2, 3), 99), torch.ones(2, 3, dtype=torch.long))  # ids past the vocabulary
    assert model.model.layers[-1] is last


def test_reward_models_match_transformers_forward_in_both_paths(tmp_path):
    dirs = [build_tiny_reward_model(tmp_path / "rm", config={"num_key_value_heads": 2}, seed=3)]
    rms = RewardModels(dirs)
    prompts = ["Tom has 4 apples and buys 7 more. How many now?", "What is 2 + 3?"]
    texts = [p + r for p in prompts for r in (" 11", " It is eleven.", "", " 4 + 7 = 11, so 11 apples")]
    tok, model = rms.tokenizers[0], rms.models[0]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        reference = model(**enc).logits
    assert torch.allclose(rms(texts), reference, atol=1e-5)
    assert torch.allclose(rms(texts, group_size=4), reference, atol=1e-5)
