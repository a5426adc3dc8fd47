"""ModelConfig: bad values name their field, and every loading option reaches ``from_pretrained`` and peft in every
family that loads a language model."""

import pytest
import transformers
from helpers.recipes import RECIPES

from alignment_games.modules.lm.model_config import ModelConfig


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"dtype": "float8"}, "lm.dtype"),
        ({"players": "shared"}, "lm.players"),
        ({"lora_r": 0}, "lm.lora_r"),
        ({"lora_dropout": 1.0}, "lm.lora_dropout"),
        ({"max_prompt_tokens": 0}, "lm.max_prompt_tokens"),
        ({"load_in_4bit": True, "players": "separate"}, "lm.load_in_4bit"),
    ],
)
def test_a_bad_value_names_its_field(kw, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        ModelConfig("some/model", **kw)


def test_lora_r_zero_points_to_full_fine_tuning():
    """There is no LoRA of rank 0: full fine-tuning (the paper's "LoRA disabled") is ``players: separate``."""
    with pytest.raises(
        ValueError, match="lm.lora_r: must be positive, got 0; full fine-tuning without LoRA is players: separate"
    ):
        ModelConfig("some/model", lora_r=0)
    assert ModelConfig("some/model", players="separate").players == "separate"


def test_coerce_takes_a_config_a_dict_or_a_name_and_refuses_unknown_fields():
    cfg = ModelConfig("a/b", lora_r=4, lora_target_modules=["q_proj"])
    assert ModelConfig.coerce(cfg) is cfg
    assert ModelConfig.coerce(cfg.as_dict()) == cfg  # what a checkpoint's hyper-parameters hold
    assert ModelConfig.coerce("a/b") == ModelConfig("a/b")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['lora_rank'\]"):
        ModelConfig.coerce({"name_or_path": "a/b", "lora_rank": 4})
    assert all(isinstance(v, (str, int, float, bool, list, type(None))) for v in cfg.as_dict().values())


OPTIONS = {"revision": "main", "attn_implementation": "eager", "dtype": "bfloat16", "trust_remote_code": False}
LORA = {
    "lora_r": 3,
    "lora_alpha": 7,
    "lora_dropout": 0.05,
    "lora_target_modules": ["q_proj", "v_proj"],
    "lora_modules_to_save": ["lm_head"],
    "lora_extra": {"use_rslora": True},
}


@pytest.fixture
def spies(monkeypatch):
    """Record the keyword arguments of every ``from_pretrained`` and ``get_peft_model`` call (and still load)."""
    import peft

    calls = {"model": [], "tokenizer": [], "peft": []}
    for cls, key in (
        (transformers.AutoModelForCausalLM, "model"),
        (transformers.AutoModel, "model"),
        (transformers.AutoTokenizer, "tokenizer"),
    ):
        original = cls.from_pretrained.__func__

        def spy(klass, path, *args, _original=original, _key=key, **kwargs):
            calls[_key].append(kwargs)
            kwargs = {k: v for k, v in kwargs.items() if k != "revision"}  # a local folder has no revisions
            return _original(klass, path, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    original_peft = peft.get_peft_model

    def peft_spy(model, config, *args, **kwargs):
        calls["peft"].append(config)
        return original_peft(model, config, *args, **kwargs)

    monkeypatch.setattr(peft, "get_peft_model", peft_spy)
    return calls


#: every family that loads a language model, built by its recipe with the loader contract's options (adapters on)
FAMILIES = {name: recipe for name, recipe in RECIPES.items() if recipe.build is not None}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_option_reaches_from_pretrained_and_peft(family, tiny_lm_dir, spies, tmp_path):
    lm = ModelConfig(str(tiny_lm_dir), gradient_checkpointing=True, **OPTIONS, **LORA)
    FAMILIES[family].make(lm, tmp_path, "loader")
    assert spies["model"], "no model was loaded through from_pretrained"
    for kwargs in spies["model"]:
        for key, value in OPTIONS.items():
            got = kwargs[key]
            assert (str(got).removeprefix("torch.") if key == "dtype" else got) == value, (key, got)
    assert all(k["revision"] == "main" and k["trust_remote_code"] is False for k in spies["tokenizer"])
    assert spies["peft"], "no adapter was made through peft"
    for config in spies["peft"]:
        assert (config.r, config.lora_alpha, config.lora_dropout) == (3, 7, 0.05)
        assert set(config.target_modules) == {"q_proj", "v_proj"} and config.use_rslora is True
        assert "lm_head" in config.modules_to_save


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_4bit_loading_without_bitsandbytes_names_the_option(family, tiny_lm_dir, without_bitsandbytes, tmp_path):
    with pytest.raises(ImportError, match="load_in_4bit"):
        FAMILIES[family].make(ModelConfig(str(tiny_lm_dir), load_in_4bit=True), tmp_path, "loader")
