"""A 4-bit (bitsandbytes NF4) frozen base on CPU against its dequantised twin.

The reference is an unquantised :class:`PolicyBank` of the same folder whose every quantised projection holds
``bitsandbytes.functional.dequantize_4bit`` of the 4-bit bank's packed weights, with the same (non-zero) adapters:
the 4-bit bank must give its logits, log-probabilities, adapter gradients and greedy tokens, and its own decoders
must give the tokens of ``transformers``' ``generate`` on the same 4-bit model with peft.
"""

from __future__ import annotations

import dataclasses

import bitsandbytes as bnb  # the quantization extra, also in the dev extra: these tests run wherever the suite does
import pytest
import torch
from helpers.four_bit import four_bit_lm
from helpers.threads import one_torch_thread

from alignment_games.modules.lm.decoders import make_decoder
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.sampling import Sampling

PLAYERS = ["first", "second"]
PROMPTS = ["What is 2 + 3?", "Name a colour.", "Hi"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with one_torch_thread():
        yield


def _banks(path, **kw) -> tuple[PolicyBank, PolicyBank]:
    """A 4-bit bank with non-zero adapters and its dequantised fp32 twin holding the same adapters."""
    lm = four_bit_lm(path, **kw)
    quantised = PolicyBank(lm, PLAYERS)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in quantised.model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: an adapter that changes nothing would prove nothing
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    twin = PolicyBank(dataclasses.replace(lm, load_in_4bit=False), PLAYERS)
    layers = dict(quantised.model.named_modules())
    replaced = 0
    with torch.no_grad():
        for name, module in twin.model.named_modules():
            q = layers[name]
            if isinstance(q, bnb.nn.Linear4bit):
                assert type(module) is torch.nn.Linear
                w = bnb.functional.dequantize_4bit(q.weight.data, q.weight.quant_state)
                assert w.shape == module.weight.shape and not torch.allclose(w, module.weight, atol=1e-3)
                module.weight.copy_(w)
                replaced += 1
        adapters = {n: p for n, p in quantised.model.named_parameters() if p.requires_grad}
        for name, p in twin.model.named_parameters():
            if name in adapters:
                p.copy_(adapters[name])
    assert replaced == 14  # 2 layers x 7 projections; the embeddings and the head stay unquantised
    return quantised, twin


def _specials(bank: PolicyBank) -> tuple[int, int]:
    return bank.tokenizer.eos_token_id, bank.tokenizer.pad_token_id


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def banks(request):
    return _banks(request.getfixturevalue("tiny_lm_dir" if request.param == "qwen2" else "tiny_llama_dir"))


def test_the_4bit_base_holds_nf4_linear4bit_layers_computing_in_fp32_under_fp32_adapters(banks):
    quantised, _ = banks
    layers = [m for m in quantised.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and all(m.weight.dtype == torch.uint8 and m.weight.quant_state.quant_type == "nf4" for m in layers)
    assert all(m.compute_dtype == torch.float32 for m in layers)  # lm.dtype auto on CPU
    trainable = [p for p in quantised.model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)


def _logits(model, enc):
    pos = (enc["attention_mask"].cumsum(1) - 1).clamp_min(0)
    return model(**enc, position_ids=pos).logits


@pytest.mark.parametrize("player", [None, "first"])
def test_logits_equal_the_dequantised_twins_in_eval_and_in_training(banks, player):
    """Eval mode without gradients is where bitsandbytes would switch a CPU with AVX512-BF16 to its bf16 kernel."""
    quantised, twin = banks
    enc = quantised.encode_prompts(PROMPTS)
    for train in (False, True):
        with quantised.using(player) as q, twin.using(player) as t, torch.set_grad_enabled(train):
            q.train(train), t.train(train)
            got, want = _logits(q, enc), _logits(t, enc)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_adapter_gradients_equal_the_twins_after_an_eval_forward(banks):
    """A generation (eval, no gradients) before the loss must leave the 4-bit layers' backward intact."""
    quantised, twin = banks
    enc = quantised.encode_prompts(PROMPTS)
    grads = []
    for bank in (quantised, twin):
        bank.model.eval()
        with torch.no_grad(), bank.using("first") as model:
            _logits(model, enc)
        bank.model.train()
        bank.model.zero_grad()
        with bank.using("first") as model:
            _logits(model, enc).log_softmax(-1)[..., :40].sum().backward()
        grads.append({n: p.grad.clone() for n, p in bank.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any(".first." in n and "lora_A" in n for n in grads[0])
    for name, want in grads[1].items():
        torch.testing.assert_close(grads[0][name], want, atol=1e-4, rtol=1e-3, msg=name)


@pytest.mark.parametrize("decode", ["grouped", "static"])
@pytest.mark.parametrize("group", [1, 3])
def test_greedy_decode_equals_generate_and_the_twin_and_logprobs_equal_the_twins(banks, decode, group):
    """``grouped`` (the CPU default) declines the 4-bit model's lean step and runs its forward (G > 1) or generate."""
    quantised, twin = banks
    for bank in banks:
        bank.decoder = make_decoder(dataclasses.replace(bank.lm, decode=decode), *_specials(bank))
    sampling = Sampling(max_new_tokens=8, temperature=0.7)
    out = quantised.generate("first", PROMPTS, group, sampling, greedy=True)
    assert torch.equal(out.sequences, twin.generate("first", PROMPTS, group, sampling, greedy=True).sequences)
    reference = quantised.generate(None, PROMPTS, group, sampling, greedy=True)
    assert not torch.equal(out.sequences, reference.sequences)  # the adapter is in the decode
    enc = quantised.encode_prompts(PROMPTS)
    model = quantised.model
    model.set_adapter("first")
    model.eval()
    with torch.no_grad():
        want = model.generate(
            input_ids=enc["input_ids"].repeat_interleave(group, 0),
            attention_mask=enc["attention_mask"].repeat_interleave(group, 0),
            do_sample=False,
            max_new_tokens=8,
            pad_token_id=quantised.tokenizer.pad_token_id,
            eos_token_id=quantised.tokenizer.eos_token_id,
        )
    width = enc["input_ids"].shape[1]
    for row, seq in zip(out.sequences, want):  # generate stops at the batch's last EOS; the rollout pads after
        n = int(seq.shape[0])
        assert torch.equal(row[: min(n, row.shape[0])], seq[: row.shape[0]]), (row, seq)
    assert out.sequences.shape[1] > width
    # log-probabilities of the completions: the 4-bit bank's against a hand log-softmax of the twin's logits
    got = quantised.token_logprobs("first", out, temperature=0.7)
    with torch.no_grad(), twin.using("first") as t:
        pos = (out.attention_mask.cumsum(1) - 1).clamp_min(0)
        logits = t(input_ids=out.sequences, attention_mask=out.attention_mask, position_ids=pos).logits
    lp = (logits[:, width - 1 : -1] / 0.7).log_softmax(-1).gather(-1, out.sequences[:, width:, None])[..., 0]
    want_lp = lp * out.completion_mask
    torch.testing.assert_close(got.detach(), want_lp, atol=1e-4, rtol=1e-4)
