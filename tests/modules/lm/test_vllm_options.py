"""The vLLM engine's settings and refusals, checked without starting an engine (the engine itself: -m engines)."""

import sys

import pytest
import torch

from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.lm.vllm_engine import INSTALL, assemble, engine_options, request_options, require_vllm


def test_a_missing_vllm_is_an_error_naming_the_extra(monkeypatch, tiny_lm_dir):
    from alignment_games.modules.lm.policy_bank import PolicyBank

    monkeypatch.setitem(sys.modules, "vllm", None)  # what an environment without the package imports
    with pytest.raises(ImportError, match=r'pip install -e "\.\[vllm\]"'):
        require_vllm()
    with pytest.raises(ImportError, match="lm.decode: vllm"):
        PolicyBank(ModelConfig(tiny_lm_dir, decode="vllm"))
    assert INSTALL == 'pip install -e ".[vllm]"'


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"load_in_4bit": True}, r"lm.load_in_4bit.*lm.decode: vllm"),
        ({"players": "separate"}, r"lm.players: separate.*lm.decode: vllm"),
        ({"vllm_kv_cache_gib": 0}, r"lm.vllm_kv_cache_gib"),
        ({"compile_decode": True}, r"lm.compile_decode"),
    ],
)
def test_settings_the_engine_cannot_serve_are_refused_naming_the_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig("some/model", decode="vllm", **fields)


def test_the_engine_options_follow_the_config():
    options = engine_options(ModelConfig("some/model", lora_r=4, vllm_kv_cache_gib=0.5), max_loras=3)
    assert options["dtype"] == "float32"  # lm.dtype auto on a CPU
    assert options["kv_cache_memory_bytes"] == 2**29
    assert options["max_lora_rank"] == 8  # the smallest rank vLLM reserves that holds r = 4
    assert options["max_loras"] == 4  # three players and the all-zero adapter of the base's rows
    assert options["enforce_eager"] and options["skip_tokenizer_init"] and options["enable_lora"]
    assert engine_options(ModelConfig("some/model", lora_r=16), 2)["max_lora_rank"] == 16
    bf16 = engine_options(ModelConfig("some/model", dtype="bfloat16"), 2)
    assert bf16["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="lm.lora_r"):
        engine_options(ModelConfig("some/model", lora_r=600), 2)
    with pytest.raises(ValueError, match="lm.lora_modules_to_save"):
        engine_options(ModelConfig("some/model", lora_modules_to_save=["lm_head"]), 2)


def test_a_request_samples_as_the_own_decoders():
    s = Sampling(temperature=0.7, top_p=0.9, max_new_tokens=12, min_new_tokens=3)
    sampled = request_options(s, greedy=False, eos=5, seed=42)
    assert (sampled["temperature"], sampled["top_p"], sampled["top_k"]) == (0.7, 0.9, 0)
    assert (sampled["max_tokens"], sampled["min_tokens"], sampled["stop_token_ids"]) == (12, 3, [5])
    assert (sampled["seed"], sampled["logprobs"], sampled["n"]) == (42, 0, 1)
    greedy = request_options(s, greedy=True, eos=None, seed=42)
    assert (greedy["temperature"], greedy["top_p"], greedy["seed"], greedy["stop_token_ids"]) == (0.0, 1.0, None, [])


def test_a_temperature_vllm_would_raise_is_refused_naming_the_field():
    """vLLM's ``SamplingParams`` samples a temperature below 0.01 at 0.01; greedy (temperature 0) stays greedy."""
    with pytest.raises(ValueError, match=r"sampling.temperature: 0.0001 is below 0.01, which vLLM samples at instead"):
        request_options(Sampling(temperature=1e-4), greedy=False, eos=5, seed=1)
    assert request_options(Sampling(temperature=0.01), greedy=False, eos=5, seed=1)["temperature"] == 0.01
    assert request_options(Sampling(temperature=1e-4), greedy=True, eos=5, seed=1)["temperature"] == 0.0


def test_completions_are_assembled_into_the_decoders_rows():
    ids = torch.tensor([[0, 7, 8], [4, 5, 6]])  # 0: the left padding of the first prompt
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    rows, lps = assemble(ids, mask, 2, [[1], [2, 3], [9, 9, 9], []], [[-0.5], [-1.0, -2.0], [-1, -1, -1], []], pad=0)
    expected = [[0, 7, 8, 1, 0, 0], [0, 7, 8, 2, 3, 0], [4, 5, 6, 9, 9, 9], [4, 5, 6, 0, 0, 0]]
    assert rows.tolist() == expected
    assert lps.tolist() == [[-0.5, 0, 0], [-1.0, -2.0, 0], [-1, -1, -1], [0, 0, 0]]
