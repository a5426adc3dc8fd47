import pytest
import torch

from datamodules.sft import ArithmeticSFTDataModule
from modules.sft import CausalLMSFT


def test_sft_data_mixes_leader_and_follower_formats():
    dm = ArithmeticSFTDataModule(num_prompts=200, follower_fraction=0.5, seed=1)
    dm.setup()
    systems = [s for s, _, _ in dm.train_pairs + dm.val_pairs]
    follower = [s for s in systems if "Another assistant previously answered" in s]
    assert 60 < len(follower) < 140 and len(systems) == 200
    assert all("{leader_response}" not in s for s in follower)  # filled with a solution of the same problem
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"system", "prompt", "response"}
    with pytest.raises(ValueError, match="follower_fraction"):
        ArithmeticSFTDataModule(follower_fraction=1.5)
    with pytest.raises(ValueError, match="kinds"):
        ArithmeticSFTDataModule(kinds=["nope"])


def test_sft_loss_only_on_response_tokens(tiny_lm_dir):
    model = CausalLMSFT(model=tiny_lm_dir, max_length=256)
    enc = model.encode(["What is 1+1?"], ["2"], ["sys"])
    labels = enc["labels"][0]
    kept = labels[labels != -100].tolist()
    assert kept == model.tokenizer("2", add_special_tokens=False)["input_ids"] + [model.tokenizer.eos_token_id]
    assert enc["attention_mask"].sum() == enc["input_ids"].shape[1]
    before = [p.detach().clone() for p in model.parameters()]
    loss = model._loss({"prompt": ["What is 1+1?"], "response": ["2"], "system": ["sys"]})
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
