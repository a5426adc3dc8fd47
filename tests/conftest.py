import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory):
    """A tiny random Qwen2 causal LM with the project's byte tokenizer, saved like a hub checkpoint."""
    from modules.models import build_tiny_causal_lm

    return build_tiny_causal_lm(tmp_path_factory.mktemp("tiny_qwen2"), seed=0)
