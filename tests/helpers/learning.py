"""The known case of the learning-direction tests (``tests/test_learning_direction.py``) and what every family's run
shares: the reward depends on the reply's first character only (:data:`GOOD` openings are good), and the policy's
chance of a good reply is read exactly off its next-token distribution (:func:`good_mass`)."""

from __future__ import annotations

import string

import lightning as L
import torch

from alignment_games.modules.algorithms.arithmetic import generate_problems
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.scorers.utility import Utility

from .callback_helpers import make_trainer

GOOD = frozenset(c for c in string.ascii_letters + string.digits if ord(c) % 2 == 0)
BAD = sorted(frozenset(string.ascii_letters + string.digits) - GOOD)
PUNCTUATION = frozenset(string.punctuation)
PROMPTS = [p.question for p in generate_problems(6, seed=11, min_steps=1, max_steps=1)]


def good(text: str, mirrored: bool = False) -> float:
    """1 for a reply whose first character is in :data:`GOOD` (0 for it when ``mirrored``)."""
    return float((text[:1] in GOOD) != mirrored)


def good_token_ids(tokenizer) -> list[int]:
    """The tokens that decode to one character of :data:`GOOD` (one per character for the byte tokenizer)."""
    ids = [i for i in range(len(tokenizer)) if tokenizer.decode([i]) in GOOD]
    assert len(ids) == len(GOOD)
    return ids


@torch.no_grad()
def good_mass(bank: PolicyBank, player: str, prompts: list[str]) -> float:
    """Mean over ``prompts`` (already formatted for the policy) of P(the first reply token is good)."""
    enc = bank.encode_prompts(prompts)
    pos = (enc["attention_mask"].cumsum(1) - 1).clamp_min(0)
    with bank.using(player) as model:
        logits = model(**enc, position_ids=pos).logits[:, -1].float()
    return float(logits.softmax(-1)[:, good_token_ids(bank.tokenizer)].sum(-1).mean())


@torch.no_grad()
def plain_masses(model, tokenizer, prompts: list[str], sets: list[frozenset[str]]) -> list[float]:
    """Mean next-token mass of the tokens decoding to one character of each set, after each prompt in turn."""
    ids = [[i for i in range(len(tokenizer)) if tokenizer.decode([i]) in chars] for chars in sets]
    out = [0.0] * len(sets)
    for text in prompts:
        enc = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        probs = model(input_ids=enc).logits[0, -1].float().softmax(-1)
        out = [o + float(probs[i].sum()) / len(prompts) for o, i in zip(out, ids)]
    return out


def trainer(tmp_path, steps: int) -> L.Trainer:
    """A quiet trainer of ``steps`` optimizer steps without validation."""
    return make_trainer(tmp_path, [], max_steps=steps, max_epochs=None, limit_val_batches=0)


def prompts(num_prompts: int = 80):
    """Generated arithmetic prompts in batches of 4."""
    from alignment_games.datamodules.prompts import PromptDataModule

    return PromptDataModule(num_prompts=num_prompts, batch_size=4)


class FirstCharacterPreference(Utility):
    """P0(y ≻ y′) = 1/2 + (good(y) − good(y′)) / 2: a good reply beats a bad one surely, equals tie."""

    def __init__(self, mirrored: bool) -> None:
        super().__init__()
        self.mirrored = mirrored

    def forward(self, prompts, first, second):
        g = torch.tensor([good(a, self.mirrored) - good(b, self.mirrored) for a, b in zip(first, second)])
        return 0.5 + 0.5 * g


class FollowerEdge(FirstCharacterPreference):
    """u(x, y, y′) = P0(y′ ≻ y) = 1/2 + (good(y′) − good(y)) / 2: the follower gains by opening well, the leader too."""

    def forward(self, prompts, leader, follower):
        return super().forward(prompts, follower, leader)


def leader_follower_run(cls, tmp_path, **kw) -> dict[str, tuple[float, float]]:
    """Train a deep-SMIDA-shaped game (SLHF or deep-SMIDA) 10 batches; each player's good mass before and after.

    The follower's mass is read after a fixed reply of the leader.
    """
    L.seed_everything(0)
    model = cls(
        leader_lr=1e-2,
        follower_lr=1e-2,
        tau_leader=0.01,
        tau_follower=0.01,
        samples_per_prompt=4,
        follower_samples=4,
        sampling=Sampling(temperature=1.0, max_new_tokens=1),
        **kw,
    )
    shown = {
        "leader": model.play.leader_prompts(PROMPTS),
        "follower": model.play.follower_prompts(PROMPTS, ["5"] * len(PROMPTS)),
    }
    before = {p: good_mass(model.players, p, x) for p, x in shown.items()}
    trainer(tmp_path, steps=20).fit(model, prompts())  # 2 steps a batch
    return {p: (before[p], good_mass(model.players, p, x)) for p, x in shown.items()}
