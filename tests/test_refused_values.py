"""Bad values are refused by name in every family's ``__init__``, before any model is loaded (issue 17 item 6).

The model path does not exist: a value checked only after loading would fail on the path instead, and the control
(the same family with good values) shows that it does.
"""

import pytest

from modules.debate import DebateSelfPlay
from modules.deep_smida import DeepSMIDA
from modules.grpo import GRPO
from modules.lm.model_config import ModelConfig
from modules.pool import StackelbergPool
from modules.scorers.judges import ProgrammaticJudge
from modules.scorers.utility import EnsembleUtility
from modules.tabular_smida import TabularSMIDA

MISSING = "/nonexistent/tiny-model"
FAMILIES = {
    "DebateSelfPlay": (DebateSelfPlay, lambda: {"judge": ProgrammaticJudge()}),
    "DeepSMIDA": (DeepSMIDA, lambda: {"utility": EnsembleUtility(allow_untrained=True)}),  # no trained one here
    "GRPO": (GRPO, lambda: {"answer_reward": True}),
    "StackelbergPool": (StackelbergPool, dict),
}
CASES = [
    ("DebateSelfPlay", {"clip": 0.0}, "clip must be positive, got 0.0"),
    ("DebateSelfPlay", {"word_penalty_coef": -0.01}, "word_penalty_coef must be at least 0.0, got -0.01"),
    ("DebateSelfPlay", {"word_limit": 0}, "word_limit must be at least 1, got 0"),
    ("DebateSelfPlay", {"reply_max_new_tokens": 0}, "reply_max_new_tokens must be at least 1, got 0"),
    ("DebateSelfPlay", {"logprob_micro_batch": -1}, "logprob_micro_batch must be at least 0, got -1"),
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
    ("GRPO", {"train_micro_batch": -2}, "train_micro_batch must be at least 0, got -2"),
    ("StackelbergPool", {"gamma": 0.0}, r"gamma must be in \(0.0, 1.0\], got 0.0"),
    ("StackelbergPool", {"gamma": 1.5}, r"gamma must be in \(0.0, 1.0\], got 1.5"),
    ("StackelbergPool", {"eval_max_new_tokens": 0}, "eval_max_new_tokens must be at least 1, got 0"),
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
