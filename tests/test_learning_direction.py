"""Each game's update moves its policy the way its reward points, on a case whose answer is known.

The known case: the reward (or preference, judge score, vote) depends on the reply's first character only: a reply
that starts with a letter or digit of even code (``b``, ``D``, ``4``, ...) is good, any other reply is bad. For the
tiny byte-level policy, "starts with such a character" is "the first token is one of those characters' tokens", so
the policy's probability of a good reply is read exactly off its next-token distribution after each prompt: the
mass of those tokens. Each family trains a few steps with its own update; that mass must rise. The same run with the
reward mirrored (bad and good swapped) must lower it, so the check cannot pass by any drift of training alone. The
preference ensemble has no policy: its measure is its P(y ≻ y′) of a good reply over a bad one, trained on labels that
prefer the good (mirrored: the bad) opening.

The losses themselves are checked against hand values and autograd in the families' own tests; here a sign error,
a detached advantage, a swapped chosen/rejected pair or a mis-routed vote would fail. Cost: 1-20 CPU-seconds per
run; each family runs twice (the slowest in the ``e2e`` set). Each family's runs are its recipe's
(``tests/helpers/recipes.py``: ``Recipe.learns``); the known case's pieces are ``tests/helpers/learning.py``.
"""

from __future__ import annotations

import pytest
from helpers.recipes import RECIPES
from helpers.threads import one_torch_thread

#: test id -> (run, whether it is in the e2e set): every recipe's learning runs
RUNS = {
    f"{name}-{variant}" if variant else name: (run, recipe.slow_learning)
    for name, recipe in RECIPES.items()
    for variant, run in recipe.learns.items()
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny model's ops gain nothing from a second thread on a shared CPU."""
    with one_torch_thread():
        yield


@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=[pytest.mark.e2e] if slow else []) for f, (_, slow) in RUNS.items()]
)
def test_an_update_moves_the_policy_toward_its_reward(family, tiny_lm_dir, tmp_path):
    run = RUNS[family][0]
    rewarded = run(tiny_lm_dir, tmp_path / "good", mirrored=False)
    mirrored = run(tiny_lm_dir, tmp_path / "mirrored", mirrored=True)
    print(family, {p: (round(b, 4), round(a, 4), round(mirrored[p][1], 4)) for p, (b, a) in rewarded.items()})
    for player, (before, after) in rewarded.items():
        before_m, after_m = mirrored[player]
        assert before == pytest.approx(before_m)  # the same start
        assert after > before, (player, before, after)  # the rewarded first characters gained mass
        assert after_m < before, (player, before, after_m)  # and lost it when the reward is mirrored
