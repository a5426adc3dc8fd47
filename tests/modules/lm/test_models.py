import pytest
import torch

from alignment_games.modules.lm.models import (
    apply_lora,
    build_tiny_causal_lm,
    load_model,
    load_tokenizer,
    resolve_name_or_path,
)


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_tiny_lm_round_trips_through_from_pretrained(architecture, request, tmp_path):
    tiny_dir = request.getfixturevalue("tiny_lm_dir" if architecture == "qwen2" else "tiny_llama_dir")
    tok = load_tokenizer(tiny_dir)
    model = load_model(tiny_dir, task="causal_lm").eval()
    text = "Ava has 3 apples. \\boxed{3} ü"
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert tok.decode(ids[0]) == text  # byte-level: exact round trip
    again = load_model(build_tiny_causal_lm(tiny_dir, seed=0, architecture=architecture), task="causal_lm").eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)  # reused folder
    other = load_model(build_tiny_causal_lm(tmp_path / "s1", seed=1, architecture=architecture), task="causal_lm")
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, other.eval()(ids).logits)
    assert model.config.model_type == architecture and model.config.num_hidden_layers == 2
    assert type(model).__name__ == {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[architecture]
    # Qwen2 biases its q/k/v projections, Llama none
    assert (model.model.layers[0].self_attn.q_proj.bias is not None) == (architecture == "qwen2")


def test_tiny_architecture_is_part_of_the_reused_folders_stamp(tmp_path):
    folder = tmp_path / "tiny"
    assert load_model(build_tiny_causal_lm(folder, seed=0), task="causal_lm").config.model_type == "qwen2"
    llama = load_model(build_tiny_causal_lm(folder, seed=0, architecture="llama"), task="causal_lm")
    assert llama.config.model_type == "llama"  # rebuilt, not the Qwen2 folder reused
    with pytest.raises(ValueError, match=r"architecture must be one of \['qwen2', 'llama'\], got 'mistral'"):
        build_tiny_causal_lm(tmp_path / "m", architecture="mistral")


def test_minilm_builtin_loads_offline():
    tok = load_tokenizer("builtin:minilm-l6")
    enc = load_model("builtin:minilm-l6")
    out = enc(**tok(["a cat"], return_tensors="pt"))
    assert out.last_hidden_state.shape[-1] == 384
    with pytest.raises(ValueError, match="unknown builtin"):
        resolve_name_or_path("builtin:nope")


def test_missing_path_and_bad_options_are_clear(tmp_path):
    with pytest.raises(OSError, match="does not exist"):
        load_model(str(tmp_path / "no_such_model"))
    with pytest.raises(OSError, match="does not exist"):
        load_tokenizer(str(tmp_path / "no_such_model"))
    with pytest.raises(ValueError, match="dtype"):
        load_model("builtin:minilm-l6", dtype="float8")


def test_4bit_without_bitsandbytes_names_the_package_and_the_extra(without_bitsandbytes):
    with pytest.raises(ImportError, match=r"bitsandbytes: pip install -e \"\.\[quantization\]\""):
        load_model("builtin:minilm-l6", load_in_4bit=True)


def test_lora_adapters_switch_and_disable_to_reference(tiny_decoder_dir):
    tiny_lm_dir = tiny_decoder_dir
    model = apply_lora(load_model(tiny_lm_dir, task="causal_lm"), r=4, adapter_names=["leader", "follower"])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # peft's default targets for both architectures: the query and value projections of each of the 2 layers
    adapted = sorted({n.split(".lora_A")[0].split(".")[-1] for n in trainable if "lora_A.leader" in n})
    assert adapted == ["q_proj", "v_proj"] and sum("lora_A.leader" in n for n in trainable) == 4
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n and "leader" in n:
                p.fill_(0.05)
        model.set_adapter("leader")
        leader = model(ids).logits
        model.set_adapter("follower")
        follower = model(ids).logits
        with model.disable_adapter():
            ref = model(ids).logits
    assert not torch.allclose(leader, follower)
    assert torch.allclose(follower, ref)  # lora_B starts at zero: an untouched adapter is the reference
    with pytest.raises(ValueError, match="distinct"):
        apply_lora(load_model(tiny_lm_dir, task="causal_lm"), adapter_names=["a", "a"])
