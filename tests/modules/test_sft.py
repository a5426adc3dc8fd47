import os

import lightning as L
import pytest
import torch
from helpers.callback_helpers import make_trainer

from alignment_games.datamodules.sft import ArithmeticSFTDataModule
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.sft import CausalLMSFT


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
    model = CausalLMSFT(lm=ModelConfig(tiny_lm_dir), max_length=256)
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


def test_sft_loads_through_the_model_config(tiny_lm_dir, tmp_path):
    model = CausalLMSFT(lm={"name_or_path": tiny_lm_dir, "dtype": "bfloat16", "attn_implementation": "eager"})
    assert next(model.model.parameters()).dtype == torch.bfloat16
    assert model.model.config._attn_implementation == "eager"
    assert model.hparams["lm"]["name_or_path"] == tiny_lm_dir and model.hparams["lora"] is False
    with pytest.raises(ValueError, match="set lora: true"):
        CausalLMSFT(lm=ModelConfig(tiny_lm_dir, load_in_4bit=True))
    for field, bad, message in [("lr", -3e-3, "lr must be positive"), ("weight_decay", -0.1, "weight_decay must be")]:
        with pytest.raises(ValueError, match=message):  # checked before anything is built or written
            CausalLMSFT(lm=None, output_dir=str(tmp_path / "never"), **{field: bad})
    assert not (tmp_path / "never").exists()
    tiny = CausalLMSFT(lm=None, tiny_config={"num_hidden_layers": 1}, output_dir=str(tmp_path / "t"))
    assert tiny.model.config.num_hidden_layers == 1 and tiny.hparams["lm"] is None


def test_sft_builds_its_tiny_model_with_the_task_tokenizer(tmp_path):
    model = CausalLMSFT(
        lm=None,
        tiny_config={"hidden_size": 32, "intermediate_size": 64},
        tiny_tokenizer="task",
        output_dir=str(tmp_path),
    )
    assert len(model.tokenizer) > 260 and model.model.config.vocab_size == len(model.tokenizer)
    enc = model.encode(["Ava has 12 apples."], ["<think>12 + 30 = 42</think>"], [None])
    kept = enc["labels"][0][enc["labels"][0] != -100].tolist()
    assert model.tokenizer.decode(kept) == "<think>12 + 30 = 42</think><|endoftext|>"
    digits = [t for t in model.tokenizer.convert_ids_to_tokens(kept) if any(c.isdigit() for c in t)]
    assert digits == list("123042")  # one token per digit
    with pytest.raises(ValueError, match="tiny_tokenizer must be one of"):
        CausalLMSFT(lm=None, tiny_tokenizer="bpe", output_dir=str(tmp_path / "never"))
    assert not (tmp_path / "never").exists()


def test_sft_with_lora_trains_and_saves_only_the_adapter(tiny_lm_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    L.seed_everything(0)
    out = tmp_path / "adapter"
    lm = ModelConfig(tiny_lm_dir, lora_r=4, lora_alpha=8)
    model = CausalLMSFT(lm=lm, lora=True, output_dir=str(out), max_length=96, lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.model.named_parameters()}
    trainable = {n for n, p in model.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = make_trainer(
        tmp_path, [ckpt], max_steps=3, max_epochs=None, limit_val_batches=0, enable_checkpointing=True
    )
    trainer.fit(model, ArithmeticSFTDataModule(num_prompts=24, batch_size=4))
    changed = {n for n, p in model.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable  # the base is unchanged
    assert any("lora_B" in n for n in changed)  # the adapter moved away from its zero init
    # the folder is an adapter (and the tokenizer), not the full weights
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists() and (out / "tokenizer_config.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(tiny_lm_dir)
    loaded = PeftModel.from_pretrained(base, out)
    trained = model.model.state_dict()
    for name, w in loaded.state_dict().items():
        assert torch.equal(w, trained[name]), name
    # the checkpoint holds the adapter only, and a fresh module resumes from it
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert set(ckpt["state_dict"]) == {f"model.{n}" for n in trainable}
    resumed = CausalLMSFT(lm=lm, lora=True, output_dir=str(out), max_length=96)
    resumed.on_load_checkpoint(ckpt)
    resumed.load_state_dict(ckpt["state_dict"], strict=False)
    assert all(torch.equal(p, model.model.get_parameter(n)) for n, p in resumed.model.named_parameters())


def test_the_saved_model_folder_is_replaced_whole_or_left_as_it_was(tmp_path, monkeypatch):
    """save_pretrained goes to a folder beside output_dir, swapped in at the end: a save that fails half-way leaves
    the previous artifact as it was, a finished one leaves nothing of the previous behind."""
    out = tmp_path / "policy"
    out.mkdir()
    (out / "stale.txt").write_text("the previous artifact")
    model = CausalLMSFT(lm=None, tiny_config={"num_hidden_layers": 1}, output_dir=str(out))

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed during the tokenizer's save")

    monkeypatch.setattr(model.tokenizer, "save_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        model._save()
    assert sorted(os.listdir(out)) == ["stale.txt"] and sorted(os.listdir(tmp_path)) == ["policy"]
    monkeypatch.undo()
    model._save()
    names = set(os.listdir(out))
    assert "stale.txt" not in names and "config.json" in names and "tokenizer_config.json" in names
    assert os.path.isfile(out / "_init" / "config.json")  # the tiny base, saved beside the model
    assert sorted(os.listdir(tmp_path)) == ["policy"]


def test_the_tiny_base_is_written_only_by_the_save_and_named_where_it_is_saved(tmp_path):
    """A tiny base (``lm: null``) is built outside ``output_dir`` (a run that saves nothing writes nothing there); the
    save copies it to ``output_dir/_init``, and every saved file names it there, so the adapter loads over it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "artifacts" / "policy"
    model = CausalLMSFT(lm=None, lora=True, tiny_config={"num_hidden_layers": 1}, output_dir=str(out))
    assert not (tmp_path / "artifacts").exists()
    model._save()
    assert sorted(os.listdir(tmp_path)) == ["artifacts"]
    base = str(out / "_init")
    assert os.path.isfile(os.path.join(base, "model.safetensors"))
    for name in ("adapter_config.json", "README.md", "export.json"):
        text = (out / name).read_text()
        assert base in text and model._tiny_init not in text, name
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(out))
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(loaded(ids).logits, model.model(ids).logits)


def test_the_arguments_passed_on_to_the_base_are_kept_in_the_hparams(tiny_lm_dir):
    model = CausalLMSFT(lm=ModelConfig(tiny_lm_dir), max_consecutive_nonfinite=3)
    assert model.hparams.max_consecutive_nonfinite == model.max_consecutive_nonfinite == 3
    assert CausalLMSFT(lm=ModelConfig(tiny_lm_dir)).hparams.max_consecutive_nonfinite == 10
