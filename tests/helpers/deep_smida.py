"""A small Deep-SMIDA module on the tiny random Qwen2, shared by the tests that train or export one."""

from alignment_games.modules.deep_smida import DeepSMIDA
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.scorers.utility import Utility


def tiny_deep_smida(tiny_lm_dir, utility: Utility, **kw) -> DeepSMIDA:
    """:class:`DeepSMIDA`: LoRA r = 4, two leader and two follower samples, 8-token replies at 0.6; ``kw`` overrides."""
    args = dict(
        lm=ModelConfig(tiny_lm_dir, lora_r=4),
        utility=utility,
        samples_per_prompt=2,
        follower_samples=2,
        sampling=Sampling(temperature=0.6, max_new_tokens=8),
    )
    args.update(kw)
    return DeepSMIDA(**args)
