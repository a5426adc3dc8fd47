import math
import warnings

import pytest

from alignment_games.modules.training.schedules import schedule_length, warmup_cosine_factor


def test_warmup_then_cosine_to_the_floor():
    # warmup 4 of 14 steps, floor 0.2: (s+1)/4, then 0.2 + 0.8 * (1 + cos(pi * (s - 4) / 10)) / 2
    assert [warmup_cosine_factor(s, 4, 14, 0.2) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert warmup_cosine_factor(4, 4, 14, 0.2) == 1.0
    assert warmup_cosine_factor(9, 4, 14, 0.2) == pytest.approx(0.6)  # half way: the middle of 1 and 0.2
    assert warmup_cosine_factor(6, 4, 14, 0.2) == pytest.approx(0.2 + 0.4 * (1 + math.cos(math.pi * 0.2)))
    assert warmup_cosine_factor(14, 4, 14, 0.2) == pytest.approx(0.2)
    assert warmup_cosine_factor(100, 4, 14, 0.2) == pytest.approx(0.2)  # past the end it stays at the floor
    assert warmup_cosine_factor(0, 0, 10, 0.0) == 1.0  # no warmup


@pytest.mark.parametrize(
    ("args", "match"),
    [((0, -1, 10, 0.1), "warmup_steps"), ((0, 10, 10, 0.1), "warmup_steps < total_steps"), ((0, 1, 10, 1.5), "floor")],
)
def test_bad_schedules_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        warmup_cosine_factor(*args)


def test_the_schedule_length_is_the_trainers_unless_given():
    assert schedule_length(None, 4, 1) == 4  # the configs: one iteration per epoch
    assert schedule_length(None, 2, 3) == 6  # iterations_per_epoch 3
    for unbounded in (None, -1):
        with pytest.raises(ValueError, match=r"num_iterations: not given.*trainer\.max_epochs"):
            schedule_length(None, unbounded, 1)
    assert schedule_length(8, -1, 1) == 8  # given: no trainer length needed
    with pytest.warns(UserWarning, match=r"num_iterations=8, but the trainer plays 4 iterations"):
        assert schedule_length(8, 4, 1) == 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert schedule_length(4, 4, 1) == 4  # agreeing: nothing to say
