"""Bad values are refused by name in every family's ``__init__``, before any model is loaded.

The model path does not exist: a value checked only after loading would fail on the path instead, and the control
(the same family with good values) shows that it does.
"""

import pytest

from alignment_games.modules.debate import DebateSelfPlay
from alignment_games.modules.deep_smida import DeepSMIDA
from alignment_games.modules.grpo import GRPO
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.nlhf import NashMDPG
from alignment_games.modules.pool import StackelbergPool
from alignment_games.modules.preference import EnsembleUtility, PreferenceEnsemble
from alignment_games.modules.scorers.judges import ProgrammaticJudge
from alignment_games.modules.sft import CausalLMSFT
from alignment_games.modules.slhf import SLHF
from alignment_games.modules.tabular_smida import TabularSMIDA

MISSING = "/nonexistent/tiny-model"
FAMILIES = {
    "DebateSelfPlay": (DebateSelfPlay, lambda: {"judge": ProgrammaticJudge()}),
    "DeepSMIDA": (DeepSMIDA, lambda: {"utility": EnsembleUtility(allow_untrained=True)}),  # no trained one here
    "GRPO": (GRPO, lambda: {"answer_reward": True}),
    "StackelbergPool": (StackelbergPool, dict),
    "NashMDPG": (NashMDPG, lambda: {"preference": EnsembleUtility(kind="preference", allow_untrained=True)}),
    "SLHF": (SLHF, lambda: {"preference": EnsembleUtility(kind="preference", allow_untrained=True)}),
    "PreferenceEnsemble": (PreferenceEnsemble, dict),
    "CausalLMSFT": (CausalLMSFT, dict),
}
CASES = [
    ("DebateSelfPlay", {"policy_gradient": {"clip": 0.0}}, "policy_gradient.clip must be positive or null, got 0.0"),
    ("DebateSelfPlay", {"word_penalty_coef": -0.01}, "word_penalty_coef must be at least 0.0, got -0.01"),
    ("DebateSelfPlay", {"word_limit": 0}, "word_limit must be at least 1, got 0"),
    ("DebateSelfPlay", {"reply_max_new_tokens": 0}, "reply_max_new_tokens must be at least 1, got 0"),
    (
        "DebateSelfPlay",
        {"policy_gradient": {"micro_batch": -1}},
        "policy_gradient.micro_batch must be at least 0, got -1",
    ),
    ("DeepSMIDA", {"alphas": (0.1, 1.0)}, r"alphas\[1\] must be in \(0.0, 1.0\), got 1.0"),
    ("DeepSMIDA", {"alphas": (0.0,)}, r"alphas\[0\] must be in \(0.0, 1.0\), got 0.0"),
    ("DeepSMIDA", {"epsilons": (0.0, -0.1)}, r"epsilons\[1\] must be in \[0.0, 1.0\), got -0.1"),
    ("DeepSMIDA", {"candidate_alpha": 1.5}, r"candidate_alpha must be in \(0.0, 1.0\), got 1.5"),
    ("DeepSMIDA", {"candidate_alpha": float("nan")}, r"candidate_alpha must be in \(0.0, 1.0\), got nan"),
    ("DeepSMIDA", {"eval_pairs": 0}, "eval_pairs must be at least 1, got 0"),
    ("GRPO", {"adam_betas": (0.9, 1.0)}, r"adam_betas\[1\] must be in \[0.0, 1.0\), got 1.0"),
    ("GRPO", {"weight_decay": -1e-4}, "weight_decay must be at least 0.0, got -0.0001"),
    ("GRPO", {"reward_max_length": 0}, "reward_max_length must be at least 1, got 0"),
    ("GRPO", {"eval_max_new_tokens": 0}, "eval_max_new_tokens must be at least 1, got 0"),
    ("GRPO", {"policy_gradient": {"group_size": 1}}, "policy_gradient.group_size must be at least 2, got 1"),
    (
        "GRPO",
        {"policy_gradient": {"max_tokens_per_micro_batch": -1}},
        "policy_gradient.max_tokens_per_micro_batch must be at least 0, got -1",
    ),
    ("StackelbergPool", {"gamma": 0.0}, r"gamma must be in \(0.0, 1.0\], got 0.0"),
    ("StackelbergPool", {"gamma": 1.5}, r"gamma must be in \(0.0, 1.0\], got 1.5"),
    ("StackelbergPool", {"eval_max_new_tokens": 0}, "eval_max_new_tokens must be at least 1, got 0"),
    ("NashMDPG", {"tau": 0.0}, "tau must be positive, got 0.0"),
    ("NashMDPG", {"lr": -1e-4}, "lr must be positive, got -0.0001"),
    ("NashMDPG", {"beta": 1.5}, r"beta \(the reference's weight in the mixture\) must be in \[0, 1\], got 1.5"),
    (
        "NashMDPG",
        {"beta": float("nan")},
        r"beta \(the reference's weight in the mixture\) must be in \[0, 1\], got nan",
    ),
    ("NashMDPG", {"samples_per_prompt": 0}, "samples_per_prompt must be at least 1, got 0"),
    ("NashMDPG", {"eval_pairs": 0}, "eval_pairs must be at least 1, got 0"),
    ("SLHF", {"tau_follower": 0.0}, "tau_follower must be positive, got 0.0"),
    ("SLHF", {"leader_lr": -1e-3}, "leader_lr must be positive, got -0.001"),
    (
        "SLHF",
        {"follower_samples": 0},
        r"samples_per_prompt \(D\) and follower_samples \(M\) must be at least 1, got D=1, M=0",
    ),
    ("SLHF", {"eval_pairs": 0}, "eval_pairs must be at least 1, got 0"),
    ("SLHF", {"follower_system_template": "Improve it."}, r"follower_system_template must contain \{leader_response\}"),
    ("PreferenceEnsemble", {"num_members": 0}, "num_members must be positive, got 0"),
    ("PreferenceEnsemble", {"member_type": "rank"}, "member_type must be 'gpm' or 'bt', got 'rank'"),
    ("PreferenceEnsemble", {"sharing": "full"}, "sharing must be 'frozen', 'lora' or 'separate', got 'full'"),
    ("PreferenceEnsemble", {"embed_dim": 15}, "embed_dim must be a positive even number, got 15"),
    ("PreferenceEnsemble", {"init_scale": 0.0}, "init_scale must be positive, got 0.0"),
    ("PreferenceEnsemble", {"backbone_lr": float("nan")}, "backbone_lr must be positive, got nan"),
    ("PreferenceEnsemble", {"weight_decay": -0.1}, "weight_decay must be at least 0.0, got -0.1"),
    ("PreferenceEnsemble", {"max_length": 0}, "max_length must be at least 1, got 0"),
    ("CausalLMSFT", {"lr": 0.0}, "lr must be positive, got 0.0"),
    ("CausalLMSFT", {"weight_decay": -1e-4}, "weight_decay must be at least 0.0, got -0.0001"),
    ("CausalLMSFT", {"max_length": 0}, "max_length must be at least 1, got 0"),
    ("CausalLMSFT", {"warmup_steps": -1}, "warmup_steps must be at least 0, got -1"),
    ("CausalLMSFT", {"min_lr_ratio": 1.5}, r"min_lr_ratio must lie in \[0, 1\], got 1.5"),
    (
        "CausalLMSFT",
        {"tiny_tokenizer": "wordpiece"},
        r"tiny_tokenizer must be one of \['byte', 'task'\], got 'wordpiece'",
    ),
]


@pytest.mark.parametrize(("family", "bad", "message"), CASES, ids=[f"{f}-{next(iter(b))}" for f, b, _ in CASES])
def test_a_bad_value_is_refused_by_name_before_loading(family, bad, message):
    cls, base = FAMILIES[family]
    with pytest.raises(ValueError, match=f"^{message}$"):
        cls(lm=ModelConfig(MISSING), **base(), **bad)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_good_values_get_as_far_as_loading_the_model(family):
    cls, base = FAMILIES[family]
    with pytest.raises((OSError, ValueError), match="nonexistent"):
        cls(lm=ModelConfig(MISSING), **base())


@pytest.mark.parametrize("field", ["num_contexts", "num_actions", "ensemble_size"])
def test_tabular_game_sizes_are_refused_by_name(field):
    with pytest.raises(ValueError, match=f"^{field} must be an integer of at least 1, got 0$"):
        TabularSMIDA(**{field: 0})
