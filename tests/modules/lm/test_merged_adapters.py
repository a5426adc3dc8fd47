"""Merged adapter weights kept between decodes: reused while the adapter is unchanged, remade after any change."""

import pytest
import torch

from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.sampling import Sampling

PROMPTS = ["3 + 4 =", "Twelve apples minus five apples leaves"]
GREEDY = Sampling(max_new_tokens=8)


def _bank(path, decode="auto"):
    bank = PolicyBank(ModelConfig(path, lora_r=4, lora_alpha=8, decode=decode), players=["policy", "other"])
    torch.manual_seed(1)
    with torch.no_grad():  # off the zero init, so that the adapter changes the tokens
        for p in bank.player_parameters("policy"):
            p.add_(0.3 * torch.randn_like(p))
    return bank


def _peft_greedy(bank, prompts):
    """transformers' generate through peft's own LoRA forward (nothing merged): the independent reference."""
    ids, mask = bank.encode_prompts(prompts).values()
    with torch.no_grad(), bank.using("policy") as model:
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=GREEDY.max_new_tokens,
            pad_token_id=bank.tokenizer.pad_token_id,
            eos_token_id=bank.tokenizer.eos_token_id,
        )
    return out[:, ids.shape[1] :]


def _tokens(rollout):
    return rollout.sequences[:, rollout.prompt_width :]


def _fused_step_on_outside_gradients(bank):
    # fused AdamW leaves the parameters' version counters as they were: only their values tell of the step
    params = bank.player_parameters("policy")
    torch.manual_seed(2)
    for p in params:
        p.grad = torch.randn_like(p)
    torch.optim.AdamW(params, lr=0.5, fused=True).step()


def _training_step(bank):
    params = bank.player_parameters("policy")
    rollout = bank.generate("policy", PROMPTS, 2, Sampling(1.0, max_new_tokens=4, min_new_tokens=4))
    loss = -bank.logprobs("policy", rollout, 1.0).mean()
    loss.backward()
    torch.optim.AdamW(params, lr=0.5).step()


def _loaded_checkpoint(bank):
    state = {k: v + 0.5 * torch.randn_like(v) if ".policy." in k else v for k, v in bank.state_dict().items()}
    bank.load_state_dict(state)


@pytest.mark.parametrize(
    "change", [_fused_step_on_outside_gradients, _training_step, _loaded_checkpoint], ids=["fused", "train", "load"]
)
def test_the_next_decode_after_the_adapter_changes_uses_the_new_adapter(tiny_decoder_dir, change):
    """Greedy tokens equal transformers + peft before and after an adapter change (an optimizer step whether or not
    it counts versions, a training step, a loaded state), and the change does change them."""
    bank = _bank(tiny_decoder_dir)
    before = _tokens(bank.generate("policy", PROMPTS, 1, GREEDY, greedy=True))
    assert torch.equal(before, _peft_greedy(bank, PROMPTS))
    change(bank)
    after = _tokens(bank.generate("policy", PROMPTS, 1, GREEDY, greedy=True))
    assert torch.equal(after, _peft_greedy(bank, PROMPTS))
    assert not torch.equal(after, before)


def test_a_repeated_decode_reuses_the_merged_weights_and_leaves_the_base_untouched(tiny_decoder_dir):
    """The second decode merges nothing and gives the same tokens; the base's weights are the same objects with the
    same values after; a forward with gradients (training) frees the copies; another player gets its own."""
    bank = _bank(tiny_decoder_dir)
    base = {n: (p, p.detach().clone()) for n, p in bank.model.named_parameters() if "lora_" not in n}
    first = bank.generate("policy", PROMPTS, 1, GREEDY, greedy=True)
    merges = bank.merged.merges
    assert merges > 0 and set(bank.merged.entries) == {"policy"}
    second = bank.generate("policy", PROMPTS, 1, GREEDY, greedy=True)
    assert bank.merged.merges == merges and torch.equal(first.sequences, second.sequences)
    after = dict(bank.model.named_parameters())
    assert all(after[n] is p and torch.equal(p, copy) for n, (p, copy) in base.items())
    bank.generate("other", PROMPTS, 1, GREEDY, greedy=True)
    assert bank.merged.merges == 2 * merges and set(bank.merged.entries) == {"policy", "other"}
    bank.logprobs("policy", first, 1.0).sum().backward()
    assert not bank.merged.entries
