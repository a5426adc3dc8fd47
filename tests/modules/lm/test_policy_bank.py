"""PolicyBank: batched left-padded generation and completion-only log-probabilities, checked row by row."""

import re

import pytest
import torch
from helpers.logprob_grads import logprobs_and_grads
from transformers import AutoModelForCausalLM

from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.sampling import Sampling


@pytest.fixture(scope="module")
def bank(tiny_decoder_dir):
    torch.manual_seed(0)
    b = PolicyBank(ModelConfig(tiny_decoder_dir, lora_r=4, lora_alpha=8), players=["alice"])
    with torch.no_grad():  # move the adapter off its zero init so policy and reference differ
        for p in b.player_parameters("alice"):
            p.add_(0.05 * torch.randn_like(p))
    return b


def _banks(path, *lms):
    """One bank per ``lm`` (an ``lm.decode``, or a dict of ModelConfig fields), the first one's perturbed adapter in
    each."""
    lms = [lm if isinstance(lm, dict) else {"decode": lm} for lm in lms]
    banks = [PolicyBank(ModelConfig(path, lora_r=4, lora_alpha=8, **lm), players=["policy"]) for lm in lms]
    torch.manual_seed(1)
    with torch.no_grad():
        for p in banks[0].player_parameters("policy"):
            p.add_(0.3 * torch.randn_like(p))
    for b in banks[1:]:
        b.load_state_dict(banks[0].state_dict())
    return banks


def _no_cascade_left(bank):
    """The attention backend restored and no decode's state left on the model's modules."""
    base = bank.model.get_base_model()
    return base.config._attn_implementation == "sdpa" and not any(hasattr(m, "cascade") for m in base.modules())


def _one_row_logprobs(model, tok, prompt, completion_ids, temperature):
    """Brute force: the unpadded prompt + completion, full log-softmax, completion positions summed."""
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    full = torch.tensor([ids + completion_ids])
    logits = model(input_ids=full).logits[0, len(ids) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion_ids)[:, None]).squeeze(-1)


def test_token_logprobs_match_unpadded_rows_and_chunking(bank, tiny_decoder_dir):
    prompts = ["1+1=", "a much longer prompt here: 12*3="]
    torch.manual_seed(1)
    roll = bank.generate("alice", prompts, 2, Sampling(0.6, max_new_tokens=6))
    assert roll.sequences.shape[0] == 4
    tok = bank.tokenizer
    with torch.no_grad():
        per_token = bank.token_logprobs("alice", roll, temperature=0.7)
        chunked = bank.token_logprobs("alice", roll, temperature=0.7, micro_batch=1)
        ref = bank.token_logprobs(None, roll, temperature=0.7)
    assert torch.allclose(per_token, chunked, atol=1e-5)
    assert (per_token[roll.completion_mask == 0] == 0).all()
    assert torch.allclose(bank.logprobs("alice", roll, 0.7).detach(), per_token.sum(1))
    base = AutoModelForCausalLM.from_pretrained(tiny_decoder_dir).eval()
    for i in range(4):
        n = int(roll.completion_mask[i].sum())
        comp = roll.sequences[i, roll.prompt_width : roll.prompt_width + n].tolist()
        with bank.using("alice") as model, torch.no_grad():
            want = _one_row_logprobs(model, tok, prompts[i // 2], comp, 0.7)
        assert torch.allclose(per_token[i, :n], want, atol=1e-4), i
        with torch.no_grad():
            want_ref = _one_row_logprobs(base, tok, prompts[i // 2], comp, 0.7)
        assert torch.allclose(ref[i, :n], want_ref, atol=1e-4), i  # disabled adapter = the base model
    assert not torch.allclose(per_token, ref)


def test_greedy_batch_equals_one_prompt_at_a_time(bank):
    prompts = ["7-2=", "the sum of 3 and 4 is "]
    batch = bank.generate("alice", prompts, 1, Sampling(max_new_tokens=5), greedy=True)
    for i, p in enumerate(prompts):
        alone = bank.generate("alice", [p], 1, Sampling(max_new_tokens=5), greedy=True)
        assert alone.texts[0] == batch.texts[i]


def test_gradients_reach_only_the_player_adapter(bank):
    roll = bank.generate("alice", ["2+2="], 2, Sampling(0.6, max_new_tokens=4))
    bank.zero_grad(set_to_none=True)
    bank.token_logprobs("alice", roll).sum().backward()
    named = dict(bank.named_parameters())
    grads = {n for n, p in named.items() if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads and all(".alice." in n for n in grads)
    bank.zero_grad(set_to_none=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_prefix_attention_equals_attention_over_the_copied_cache(dtype):
    """One copy of each prompt's keys for its G rows (grouped-query heads, padded prompts, causal own tokens) gives
    the attention of SDPA over the prompt cache copied to every row."""
    import torch.nn.functional as F

    from alignment_games.modules.lm.decoding import grouped_prefix_attention

    torch.manual_seed(0)
    b, g, h, kvh, p, t, q, d = 3, 4, 4, 2, 7, 5, 2, 8
    keys, values = torch.randn(b, kvh, p, d), torch.randn(b, kvh, p, d)
    pad = torch.zeros(b, 1, p)
    pad[1, :, :3] = float("-inf")  # prompt 1 is left-padded by 3
    own_k, own_v = torch.randn(b * g, kvh, t, d), torch.randn(b * g, kvh, t, d)
    query = torch.randn(b * g, h, q, d)
    keys, values, own_k, own_v, query = (x.to(dtype) for x in (keys, values, own_k, own_v, query))
    layer = torch.nn.Module()
    layer.cascade = (keys, values, pad)  # as cascade_state hands each attention module its layer's prompt part
    out, _ = grouped_prefix_attention(layer, query, own_k, own_v, None, scaling=d**-0.5)
    full_k = torch.cat([keys.repeat_interleave(g, 0), own_k], 2).repeat_interleave(h // kvh, 1)
    full_v = torch.cat([values.repeat_interleave(g, 0), own_v], 2).repeat_interleave(h // kvh, 1)
    allowed = torch.ones(b * g, 1, q, p + t, dtype=torch.bool)
    allowed[:, :, :, p:] = torch.ones(q, t, dtype=torch.bool).tril(t - q)
    allowed[g : 2 * g, :, :, :3] = False
    expected = F.scaled_dot_product_attention(query, full_k, full_v, attn_mask=allowed).transpose(1, 2)
    assert out.shape == (b * g, q, h, d) and out.dtype == dtype
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out, expected, **tol)


@pytest.mark.parametrize(
    ("sampling", "greedy"),
    [
        (Sampling(max_new_tokens=12, min_new_tokens=12), False),
        (Sampling(0.7, 0.8, 10), False),
        (Sampling(max_new_tokens=8), True),
    ],
    ids=["min_new_tokens", "top_p", "greedy"],
)
@pytest.mark.parametrize("decode", ["grouped", "grouped_forward"], ids=["lean_step", "model_forward"])
def test_grouped_decode_gives_generates_tokens_and_restores_the_model(tiny_decoder_dir, sampling, greedy, decode):
    """Sampled groups decoded with each prompt's cache held once, stepped by LeanDecoder or through the model's
    forward: the tokens of transformers' generate over the copied cache, draw for draw, for prompts of different
    lengths; the attention backend is restored afterwards."""
    plain, grouped = _banks(tiny_decoder_dir, "generate", decode)
    grouped.model.generate = None  # the grouped path really runs (a CPU Qwen2 on sdpa): generate would fail
    prompts = ["3 + 4 =", "Twelve apples minus five apples leaves", "9*9"]
    outs = []
    for bank in (plain, grouped):
        torch.manual_seed(7)
        outs.append(bank.generate("policy", prompts, 3, sampling, greedy))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert torch.equal(outs[0].completion_mask, outs[1].completion_mask) and outs[0].texts == outs[1].texts
    assert _no_cascade_left(grouped)


@pytest.mark.parametrize(
    ("how", "g"),  # (sampling, greedy) of generate
    [
        ((Sampling(max_new_tokens=12, min_new_tokens=12), False), 3),
        ((Sampling(0.7, 0.8, 10), False), 3),
        ((Sampling(max_new_tokens=8), True), 3),
        ((Sampling(0.9, max_new_tokens=6), False), 1),
    ],
    ids=["min_new_tokens", "top_p", "greedy", "one_per_prompt"],
)
def test_static_decode_gives_generates_tokens_without_copying_the_prompt_cache(tiny_decoder_dir, how, g, monkeypatch):
    """``lm.decode: static`` (caches allocated once at full length): the tokens of transformers' generate, draw for
    draw from the same seed, greedy and sampled; a group's prompt cache is held once (never repeated to its rows),
    and the attention backend is restored afterwards."""
    from transformers.cache_utils import DynamicCache

    from alignment_games.modules.lm import static_decode

    banks = _banks(tiny_decoder_dir, "generate", "static")
    prompts = ["3 + 4 =", "Twelve apples minus five apples leaves", "9*9"]
    repeats, shapes = [], []
    original_repeat, original_build = DynamicCache.batch_repeat_interleave, static_decode.build_caches
    monkeypatch.setattr(
        DynamicCache, "batch_repeat_interleave", lambda c, n: (repeats.append(n), original_repeat(c, n))
    )

    def build(*args, **kwargs):
        caches = original_build(*args, **kwargs)
        shapes.append((caches[0].prefix_keys.shape[0], caches[0].own_keys.shape[0]))
        return caches

    monkeypatch.setattr(static_decode, "build_caches", build)
    outs = []
    for bank in banks:
        torch.manual_seed(7)
        outs.append(bank.generate("policy", prompts, g, *how))
    assert repeats == ([g] if g > 1 else [])  # only generate copied the prompt cache to the rows
    assert shapes == [(len(prompts), len(prompts) * g)]  # static: the prompt part once per prompt
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert torch.equal(outs[0].completion_mask, outs[1].completion_mask) and outs[0].texts == outs[1].texts
    assert _no_cascade_left(banks[1])


def test_compiled_static_decode_is_one_graph_and_reuses_its_caches(tiny_decoder_dir, monkeypatch):
    """``lm.compile_decode``: the decode step traces as one graph (``fullgraph=True``; the eager backend, so the test
    runs in seconds), the tokens stay generate's, and a second call of the same shapes refills the same buffers (what
    CUDA graphs need) with prompt widths padded to a bucket."""
    from alignment_games.modules.lm import static_decode
    from alignment_games.modules.lm.decoders import StaticDecoder

    monkeypatch.setattr(static_decode, "compile_options", lambda device: {"backend": "eager", "fullgraph": True})
    torch._dynamo.reset()
    compiled_bank, plain = _banks(tiny_decoder_dir, {"decode": "static", "compile_decode": True}, "generate")
    s = Sampling(0.7, 0.9, 6)
    runs = []
    for prompts in (["3 + 4 =", "a longer prompt: 12*3="], ["9*9", "7 - 2 ="]):
        torch.manual_seed(3)
        compiled = compiled_bank.generate("policy", prompts, 2, s)
        caches = compiled_bank.decoder.caches
        torch.manual_seed(3)
        assert torch.equal(compiled.sequences, plain.generate("policy", prompts, 2, s).sequences)
        runs.append((caches, caches[0].own_keys.data_ptr()))
    assert runs[0][0] is runs[1][0] and runs[0][1] == runs[1][1]  # the same buffers, refilled
    assert runs[0][0][0].prefix_keys.shape[2] == StaticDecoder.bucket  # both prompt widths within one bucket


def test_each_decode_is_chosen_once_from_the_config_and_falls_back_where_it_cannot_serve(tiny_decoder_dir):
    """``auto``: grouped on CPU, static elsewhere; grouped needs G > 1 unless LeanDecoder steps it; a prompt of one
    token, or gradient checkpointing (no prompt cache), falls back to generate."""
    from alignment_games.modules.lm.decoders import (
        DeviceDecoder,
        GenerateDecoder,
        GroupedDecoder,
        StaticDecoder,
        make_decoder,
    )

    bank = PolicyBank(ModelConfig(tiny_decoder_dir, lora_r=4, lora_alpha=8), players=["policy"])
    auto, m = bank.decoder, bank.model
    assert isinstance(auto, DeviceDecoder) and type(auto.cpu) is GroupedDecoder and type(auto.other) is StaticDecoder
    grouped, static = auto.cpu, auto.other
    assert grouped.serves(m, 4, 5) and not grouped.serves(m, 1, 5) and not grouped.serves(m, 4, 1)
    with bank.for_generation("policy") as merged:  # LeanDecoder serves the merged model, so G = 1 goes grouped
        assert grouped.serves(merged, 1, 5)
        assert not GroupedDecoder(grouped.fallback, lean=False).serves(merged, 1, 5)
    assert static.serves(m, 1, 5) and not static.serves(m, 4, 1)
    eos, pad = bank.tokenizer.eos_token_id, bank.tokenizer.pad_token_id
    lm = {"name_or_path": tiny_decoder_dir}
    assert type(make_decoder(ModelConfig(**lm, decode="generate"), eos, pad)) is GenerateDecoder
    checkpointed = make_decoder(ModelConfig(**lm, decode="static", gradient_checkpointing=True), eos, pad)
    assert type(checkpointed) is StaticDecoder and not checkpointed.serves(m, 4, 5)


def test_preallocated_cache_returns_what_a_dynamic_cache_returns_without_concatenating(monkeypatch):
    from transformers.cache_utils import DynamicCache

    from alignment_games.modules.lm.decoding import preallocated_cache

    g = torch.Generator().manual_seed(0)
    chunks = [(torch.randn(3, 2, t, 4, generator=g), torch.randn(3, 2, t, 4, generator=g)) for t in (1, 2, 1)]
    dynamic, pre = DynamicCache(), preallocated_cache(4)
    cats, real_cat = [], torch.cat

    def counting_cat(*a, **kw):
        cats.append(1)
        return real_cat(*a, **kw)

    for k, v in chunks:
        want = dynamic.update(k, v, 1)
        monkeypatch.setattr(torch, "cat", counting_cat)
        got = pre.update(k, v, 1)
        monkeypatch.setattr(torch, "cat", real_cat)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not cats
    assert pre.get_seq_length(1) == 4
    with pytest.raises(ValueError, match="5 tokens written to a cache of 4"):
        pre.update(*chunks[0], 1)


@pytest.mark.parametrize("share_prompts", [True, False])
def test_each_micro_batch_runs_only_to_its_longest_completion(tiny_decoder_dir, share_prompts):
    """Group 0's replies are cut to 2 tokens: its micro-batch runs 2 completion columns, not the batch's 8, and only
    its own short prompt's columns, not the long prompt's left padding, with the log-probabilities and gradients of the
    untrimmed batch; with each group's prompt run once (``share_prompts``) and with every row run whole (the path of
    rollouts without groups, as a debate's forked plies)."""
    from dataclasses import replace

    bank = PolicyBank(ModelConfig(tiny_decoder_dir, lora_r=4, lora_alpha=8), players=["policy"])
    bank.share_prompts = share_prompts
    torch.manual_seed(0)
    with torch.no_grad():
        for p in bank.player_parameters("policy"):
            p.add_(0.1 * torch.randn_like(p))
    roll = bank.generate("policy", ["3+4=", "a longer prompt: twelve minus five is "], 2, Sampling(0.6, 1.0, 8, 8))
    cmask, att, seq = roll.completion_mask.clone(), roll.attention_mask.clone(), roll.sequences.clone()
    cmask[:2, 2:] = 0
    att[:2, roll.prompt_width + 2 :] = 0
    seq[:2, roll.prompt_width + 2 :] = bank.tokenizer.pad_token_id
    roll = replace(roll, sequences=seq, attention_mask=att, completion_mask=cmask)
    widths = []
    embed = bank.model.get_base_model().get_input_embeddings()
    hook = embed.register_forward_hook(lambda m, a, o: widths.append(a[0].shape[1]))

    whole, whole_grads = logprobs_and_grads(bank, "policy", roll)
    widths.clear()
    chunked, chunked_grads = logprobs_and_grads(bank, "policy", roll, micro_batch=2)
    hook.remove()
    assert chunked.shape == whole.shape == (4, 8)
    short = int(roll.attention_mask[0, : roll.prompt_width].sum())  # the long prompt fills the prompt's width
    assert short < roll.prompt_width - 10 and widths[-1] == (8 if share_prompts else roll.prompt_width + 8)
    if share_prompts:
        assert widths == [short, 2, roll.prompt_width, 8]  # each group: its prompt, then its completion columns
    else:
        assert widths == [short + 2, roll.prompt_width + 8]  # each micro-batch: its prompt and its columns
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-5, atol=1e-6)


def test_a_decode_past_the_models_positions_is_refused_naming_the_fields(bank, monkeypatch):
    positions = bank.model.config.max_position_embeddings
    assert positions == 1024  # the tiny decoders' config
    prompt = "What is 2 + 3?"
    width = len(bank.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def decode(*args, **kwargs):
        raise AssertionError("decoding started")

    monkeypatch.setattr(bank.decoder, "decode", decode)
    too_long = Sampling(max_new_tokens=positions - width + 1)
    message = (
        f"sampling.max_new_tokens={positions - width + 1} + {width} prompt tokens (the longest prompt, after "
        f"lm.max_prompt_tokens) = {positions + 1} passes the max_position_embeddings={positions} of "
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        bank.generate("alice", [prompt, "x"], 1, too_long)
    assert bank.max_positions == positions
    Sampling(max_new_tokens=positions - width).check_fits(width, positions, "m")  # exactly the positions: fits
    Sampling(max_new_tokens=10**6).check_fits(width, None, "m")  # a model that states no positions: not checked
