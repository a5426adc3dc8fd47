"""The ``lm`` of the 4-bit tests: a tiny model's folder loaded as an NF4 base under rank-4 LoRA adapters."""

from alignment_games.modules.lm.model_config import ModelConfig


def four_bit_lm(path, **kw) -> ModelConfig:
    """``ModelConfig`` of ``path`` with ``load_in_4bit``, LoRA r = 4 and alpha 8; ``kw`` adds fields."""
    return ModelConfig(str(path), load_in_4bit=True, lora_r=4, lora_alpha=8, **kw)
