import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers on two cores: one thread each, not two each
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)


import pytest


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory):
    """A tiny random Qwen2 causal LM with the project's byte tokenizer, saved like a hub checkpoint."""
    from alignment_games.modules.lm.models import build_tiny_causal_lm

    return build_tiny_causal_lm(tmp_path_factory.mktemp("tiny_qwen2"), seed=0)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random Llama causal LM (the Qwen2 one's shapes, no biases) with the same byte tokenizer."""
    from alignment_games.modules.lm.models import build_tiny_causal_lm

    return build_tiny_causal_lm(tmp_path_factory.mktemp("tiny_llama"), seed=0, architecture="llama")


@pytest.fixture(scope="session", params=["qwen2", "llama"])
def tiny_decoder_dir(request):
    """The tiny Qwen2 and the tiny Llama in turn: a test taking it runs on both architectures."""
    return request.getfixturevalue("tiny_lm_dir" if request.param == "qwen2" else "tiny_llama_dir")


@pytest.fixture
def without_bitsandbytes(monkeypatch):
    """bitsandbytes looks absent to ``importlib.util.find_spec``, as in an install without the quantization extra."""
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **k: None if name == "bitsandbytes" else find(name, *a, **k)
    )
