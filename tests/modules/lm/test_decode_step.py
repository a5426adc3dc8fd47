"""LeanDecoder: the logits of the model's own forward for each decoded token, and a clear refusal where it cannot."""

import pytest
import torch
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from alignment_games.modules.lm.decode_step import LeanDecoder, lean_decode_unsupported
from alignment_games.modules.lm.decoding import cache_arg
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.sampling import Sampling

SMALL = dict(
    vocab_size=61,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
)


def _model(kind: str):
    torch.manual_seed(0)
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**SMALL)).eval()
    # Llama with biased attention and MLP projections and a scaled rotary embedding
    config = LlamaConfig(
        **SMALL,
        attention_bias=True,
        mlp_bias=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize(
    ("g", "padded"), [(3, True), (1, True), (1, False)], ids=["cascade", "one_row_per_prompt", "unpadded_one_row"]
)
@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_each_step_gives_the_forward_logits_of_rows_continuing_left_padded_prompts(kind, g, padded):
    """Two prompts (one left-padded by 2, or neither) × G rows, 5 decoded tokens of different values per row: every
    step's logits equal the model's forward over the whole padded sequence, at the row's last position (G = 1: one
    attention over each row's prompt and own keys instead of the cascade)."""
    model = _model(kind)
    b, width, new = 2, 6, 5
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(1, 61, (b, width), generator=gen)
    pmask = torch.ones(b, width, dtype=torch.long)
    pmask[1, :2] = 0 if padded else 1
    own = torch.randint(1, 61, (b * g, new), generator=gen)
    with torch.no_grad():
        cache = DynamicCache()
        pos = (pmask.cumsum(1) - 1).clamp_min(0)
        kw = {cache_arg(model): cache}  # the argument's name differs between transformers versions
        model(input_ids=prompt[:, :-1], attention_mask=pmask[:, :-1], position_ids=pos[:, :-1], **kw)
        decoder = LeanDecoder(model, cache, pmask[:, :-1], g, new)
        rows, rmask = prompt.repeat_interleave(g, 0), pmask.repeat_interleave(g, 0)
        token, position = rows[:, -1:], rmask.sum(1, keepdim=True) - 1
        for step in range(new):
            got = decoder.step(token, position)
            seq = torch.cat([rows, own[:, :step]], dim=1)
            mask = torch.cat([rmask, torch.ones(b * g, step, dtype=torch.long)], dim=1)
            positions = (mask.cumsum(1) - 1).clamp_min(0)
            want = model(input_ids=seq, attention_mask=mask, position_ids=positions).logits[:, -1]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            token, position = own[:, step : step + 1], position + 1
        with pytest.raises(ValueError, match="more than 5 tokens"):
            decoder.step(token, position)


def test_models_it_cannot_repeat_exactly_are_refused_with_the_reason(tiny_decoder_dir):
    tiny_lm_dir = tiny_decoder_dir  # the tiny Qwen2, then the tiny Llama
    assert lean_decode_unsupported(_model("qwen2")) is None
    mistral = MistralForCausalLM(MistralConfig(**SMALL, sliding_window=4))
    assert "model type 'mistral'" in lean_decode_unsupported(mistral)
    bank = PolicyBank(ModelConfig(tiny_lm_dir, lora_r=4, lora_alpha=8), players=["policy"])
    with bank.using("policy") as model:
        assert "LoRA layer is active" in lean_decode_unsupported(model)
        with pytest.raises(ValueError, match="LeanDecoder: a LoRA layer is active"):
            LeanDecoder(model, DynamicCache(), torch.ones(1, 1), 1, 1)
    with bank.using(None) as model:  # the disabled adapter: the frozen base alone
        assert lean_decode_unsupported(model) is None
    with bank.for_generation("policy") as model:  # the adapter merged into fresh weights
        assert lean_decode_unsupported(model) is None


@pytest.mark.parametrize("decode", ["grouped_forward", "grouped"])
def test_the_grouped_decode_steps_through_the_lean_decoder_unless_turned_off(tiny_decoder_dir, monkeypatch, decode):
    tiny_lm_dir = tiny_decoder_dir  # the tiny Qwen2, then the tiny Llama
    bank = PolicyBank(ModelConfig(tiny_lm_dir, lora_r=4, lora_alpha=8, decode=decode), players=["policy"])
    lean = decode == "grouped"
    steps = []
    original = LeanDecoder.step
    monkeypatch.setattr(LeanDecoder, "step", lambda self, *a: steps.append(1) or original(self, *a))
    bank.generate("policy", ["1 + 2 =", "a longer prompt"], 2, Sampling(0.6, 1.0, 4, 4))
    assert len(steps) == (4 if lean else 0)


def test_fsdp_wrapped_layers_and_sharded_parameters_keep_the_models_forward():
    """FSDP units gather their weights in forward hooks that LeanDecoder would skip: a layer class renamed as
    ``fully_shard`` renames it is refused, and so are parameters DeepSpeed ZeRO-3 partitions (``ds_id``)."""
    model = _model("qwen2")
    layer = model.model.layers[0]
    layer.__class__ = type("FSDPQwen2DecoderLayer", (type(layer),), {})
    assert "FSDP-wrapped module FSDPQwen2DecoderLayer" == lean_decode_unsupported(model)
    model = _model("qwen2")
    assert lean_decode_unsupported(model) is None
    model.model.norm.weight.ds_id = 3
    assert lean_decode_unsupported(model) == "sharded or offloaded parameters"
