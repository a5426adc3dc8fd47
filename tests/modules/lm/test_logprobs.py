"""Chunked log-probabilities at a real vocabulary (151,936 entries, hidden size 16) against the full-logits formula.

Every check compares with the computation the suite did before chunking, written out here: the model's own logits
over the whole vocabulary, ``float() / T``, ``log_softmax``, the chosen token's entry.
"""

import pytest
import torch
import torch.nn.functional as F
from helpers.memory import peak_cpu_bytes
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from alignment_games.modules.lm.logprobs import chunk_tokens_for, head_inputs, head_token_logprobs
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.models import apply_lora, build_tiny_causal_lm
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.rollout import Rollout
from alignment_games.modules.sft import CausalLMSFT

VOCAB = 151_936  # Qwen2.5's
SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def real_vocab_dir(tmp_path_factory, request):
    """The tiny Qwen2 and the tiny Llama at the real vocabulary, in turn."""
    folder = tmp_path_factory.mktemp(f"real_vocab_{request.param}")
    return build_tiny_causal_lm(folder, config=SHAPE, seed=0, architecture=request.param)


def _bank(path: str, dtype: str = "float32") -> PolicyBank:
    torch.manual_seed(0)
    bank = PolicyBank(ModelConfig(path, dtype=dtype, lora_r=4, lora_alpha=8), players=["alice"])
    with torch.no_grad():  # off the adapter's zero init, so that its gradients and the policy's values are its own
        for p in bank.player_parameters("alice"):
            p.add_(0.1 * torch.randn_like(p))
    return bank


def _rollout(bank: PolicyBank, group_size: int, tokens: int, seed: int = 0) -> Rollout:
    """Two left-padded prompts, ``group_size`` rows each, random completions over the whole vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    enc = bank.encode_prompts(["1+1=", "a longer prompt: 12*3="])
    ids, mask = (enc[k].repeat_interleave(group_size, dim=0) for k in ("input_ids", "attention_mask"))
    n = ids.shape[0]
    completion = torch.randint(0, VOCAB, (n, tokens), generator=gen)
    completion[:, 0] = VOCAB - 1  # the last row of the head is reached
    cmask = torch.ones(n, tokens, dtype=torch.long)
    cmask[0, tokens // 2 :] = 0  # a finished row: its tail is padding
    seq = torch.cat([ids, completion], dim=1)
    return Rollout(seq, torch.cat([mask, cmask], dim=1), ids.shape[1], cmask, [""] * n, group_size)


def _full_logits_logprobs(model, roll: Rollout, temperature: float) -> torch.Tensor:
    """The reference: every position's logits over the whole vocabulary in fp32, then the log-softmax."""
    seq, att, width = roll.sequences, roll.attention_mask, roll.prompt_width
    pos = (att.cumsum(dim=1) - 1).clamp_min(0)
    logits = model(input_ids=seq, attention_mask=att, position_ids=pos).logits[:, width - 1 : -1]
    lp = torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, seq[:, width:, None]).squeeze(-1)
    return lp * roll.completion_mask


def _grads(params) -> list[torch.Tensor | None]:
    out = [None if p.grad is None else p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return out


@pytest.mark.parametrize(("group_size", "micro_batch"), [(1, 0), (2, 2)])
def test_bank_values_and_adapter_gradients_equal_the_full_logits(real_vocab_dir, group_size, micro_batch):
    """Per-prompt rows and prompt-shared groups, micro-batched or not, chunks that straddle rows (7 tokens)."""
    bank = _bank(real_vocab_dir)
    bank.logit_chunk_tokens = 7
    roll = _rollout(bank, group_size, tokens=9)
    weights = torch.randn(roll.completion_mask.shape, generator=torch.Generator().manual_seed(1))
    params = bank.player_parameters("alice")

    got = bank.token_logprobs("alice", roll, temperature=0.7, micro_batch=micro_batch)
    (got * weights).sum().backward()
    got_grads = _grads(params)
    with bank.using("alice") as model:
        want = _full_logits_logprobs(model, roll, 0.7)
    (want * weights).sum().backward()
    want_grads = _grads(params)

    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert all(g.abs().sum() > 0 for g in want_grads)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the reference (adapters off), as the KL terms and the peer judge read it
        ref = bank.token_logprobs(None, roll, temperature=1.0, micro_batch=micro_batch)
        with bank.using(None) as model:
            torch.testing.assert_close(ref, _full_logits_logprobs(model, roll, 1.0), rtol=0, atol=1e-5)


def test_bf16_weights_give_the_full_logits_values_with_an_fp32_log_softmax(real_vocab_dir):
    """bf16 logits as the model forms them, the log-softmax in fp32 per chunk: the full path's values and gradients."""
    bank = _bank(real_vocab_dir, dtype="bfloat16")
    bank.logit_chunk_tokens = 5
    roll = _rollout(bank, 1, tokens=6)
    params = bank.player_parameters("alice")
    got = bank.token_logprobs("alice", roll, temperature=0.7)
    assert got.dtype == torch.float32
    got.sum().backward()
    got_grads = _grads(params)
    with bank.using("alice") as model:
        want = _full_logits_logprobs(model, roll, 0.7)
    want.sum().backward()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for g, w in zip(got_grads, _grads(params)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("config_class", "model_class"), [(Qwen2Config, Qwen2ForCausalLM), (LlamaConfig, LlamaForCausalLM)]
)
def test_an_adapted_untied_head_is_recomputed_with_the_adapter_of_its_forward(config_class, model_class):
    """LoRA on the output layer itself (untied from the embeddings): the backward recomputes each chunk's logits
    with the adapter active at the forward, although another adapter is active when the backward runs."""
    torch.manual_seed(0)
    base = model_class(config_class(**SHAPE, tie_word_embeddings=False))
    model = apply_lora(base, r=2, alpha=4, target_modules=["q_proj", "lm_head"], adapter_names=["a", "b"])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.add_(0.1 * torch.randn_like(p))
    trainable = [p for n, p in model.named_parameters() if "lora_" in n]
    head_a = [p for n, p in model.named_parameters() if "lm_head" in n and ".a." in n]
    assert head_a
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))

    model.set_adapter("a")
    with head_inputs(model) as seen:
        model(input_ids=ids)
    got = head_token_logprobs(model, seen[0][:, :-1], ids[:, 1:], temperature=0.9, chunk_tokens=3)
    model.set_adapter("b")  # another player's turn before the backward, as in a game's step
    for p in trainable:
        p.requires_grad_(True)
    got.sum().backward()
    got_grads = _grads(trainable)

    model.set_adapter("a")
    for p in trainable:
        p.requires_grad_(True)
    logits = model(input_ids=ids).logits[:, :-1].float() / 0.9
    want = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    want.sum().backward()
    want_grads = _grads(trainable)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    reached = [i for i, w in enumerate(want_grads) if w is not None]
    assert [i for i, g in enumerate(got_grads) if g is not None] == reached  # adapter a's tensors, not b's
    assert {id(trainable[i]) for i in reached} >= {id(p) for p in head_a}
    for i in reached:
        torch.testing.assert_close(got_grads[i], want_grads[i], rtol=1e-5, atol=1e-5)


def test_sft_loss_and_every_weight_gradient_equal_the_full_cross_entropy(tmp_path):
    """Full fine-tuning (the tied embedding trained through the head): the response tokens' mean cross-entropy."""
    module = CausalLMSFT(tiny_config=SHAPE, output_dir=str(tmp_path))
    module.logit_chunk_tokens = 4
    batch = {"prompt": ["1+1=", "name a colour"], "response": ["2", "blue, or green"]}
    got = module._loss(batch)
    got.backward()
    params = [p for p in module.model.parameters() if p.requires_grad]
    got_grads = _grads(params)

    enc = module.encode(batch["prompt"], batch["response"])
    logits = module.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
    want = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), enc["labels"][:, 1:].flatten(), ignore_index=-100)
    want.backward()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for g, w in zip(got_grads, _grads(params)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_chunked_forward_and_backward_peak_at_most_a_quarter_of_the_full_logits(real_vocab_dir):
    """Peak CPU memory of one forward + backward over 4 rows × 32 completion tokens, chunks of 16 tokens."""
    bank = _bank(real_vocab_dir)
    bank.logit_chunk_tokens = 16
    roll = _rollout(bank, 2, tokens=32)

    def chunked():
        bank.token_logprobs("alice", roll, temperature=0.7).sum().backward()

    def full():
        with bank.using("alice") as model:
            _full_logits_logprobs(model, roll, 0.7).sum().backward()

    full_peak, chunked_peak = peak_cpu_bytes(full), peak_cpu_bytes(chunked)
    bank.zero_grad(set_to_none=True)
    one_fp32_logits = 4 * 32 * VOCAB * 4
    assert full_peak >= one_fp32_logits  # the measure sees the full path's [N, C, V] fp32 logits
    assert chunked_peak <= 0.25 * full_peak, (chunked_peak, full_peak)


def test_default_chunk_fits_the_budget_and_unhandled_logit_scales_are_refused():
    assert chunk_tokens_for(VOCAB) == 220  # 128 MiB of fp32 logits
    assert chunk_tokens_for(10**9) == 1
    model = Qwen2ForCausalLM(Qwen2Config(**{**SHAPE, "vocab_size": 300}))
    model.config.logit_scale = 0.5
    with pytest.raises(ValueError, match="config.logit_scale=0.5"):
        head_token_logprobs(model, torch.zeros(1, 16), torch.zeros(1, dtype=torch.long))


def test_final_logit_softcapping_is_applied_per_chunk_as_the_model_does():
    """Gemma 2 caps its logits after the output layer (``cap · tanh(logits / cap)``): the chunks do too."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(**SHAPE, head_dim=8, final_logit_softcapping=0.5)  # a cap that bends these logits
    # float64: in fp32 the two paths' summation orders differ by ~1e-5 of these gradients' scale (about 5)
    model = Gemma2ForCausalLM(config).double()
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    with head_inputs(model) as seen:
        model(input_ids=ids)
    got = head_token_logprobs(model, seen[0][:, :-1], ids[:, 1:], temperature=0.8, chunk_tokens=3)
    got.sum().backward()
    got_grads = _grads(list(model.parameters()))
    logits = model(input_ids=ids).logits[:, :-1] / 0.8
    assert logits.abs().max() <= 0.5 / 0.8 + 1e-6  # the model's own logits are capped
    want = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    want.sum().backward()
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    for g, w in zip(got_grads, _grads(list(model.parameters()))):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
