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
run; each family runs twice (the three slowest in the ``e2e`` set, :data:`E2E`).
"""

from __future__ import annotations

import string

import lightning as L
import pytest
import torch
from helpers.callback_helpers import make_trainer
from helpers.threads import one_torch_thread

from alignment_games.modules.algorithms.arithmetic import generate_problems
from alignment_games.modules.algorithms.rl_losses import PairwiseLoss, PolicyGradient
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.lm.text import render_chat
from alignment_games.modules.scorers.judges import DebateJudge, JudgeVotes
from alignment_games.modules.scorers.utility import Utility

GOOD = frozenset(c for c in string.ascii_letters + string.digits if ord(c) % 2 == 0)
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


def _trainer(tmp_path, steps: int) -> L.Trainer:
    return make_trainer(tmp_path, [], max_steps=steps, max_epochs=None, limit_val_batches=0)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny model's ops gain nothing from a second thread on a shared CPU."""
    with one_torch_thread():
        yield


def _lm(tiny_lm_dir) -> ModelConfig:
    return ModelConfig(tiny_lm_dir, lora_r=4, lora_alpha=8)


# ------------------------------------------------------------------------------------------------------------- GRPO
def _grpo_run(tiny_lm_dir, tmp_path, mirrored: bool) -> tuple[float, float]:
    from alignment_games.datamodules.prompts import PromptDataModule
    from alignment_games.modules.grpo import GRPO

    L.seed_everything(0)
    model = GRPO(
        lm=_lm(tiny_lm_dir),
        policy_gradient=PolicyGradient(group_size=16, kl_coef=0.0),
        sampling=Sampling(temperature=1.0, max_new_tokens=1),
        lr=1e-2,
        chat_template=False,
    )
    model.rewards = lambda inputs, completions, refs, group_size=1: torch.tensor(
        [[good(c, mirrored)] for c in completions]
    )
    prompts = model.format_prompts(PROMPTS)
    before = good_mass(model.players, "policy", prompts)
    _trainer(tmp_path, steps=10).fit(model, PromptDataModule(num_prompts=80, batch_size=4))
    return {"policy": (before, good_mass(model.players, "policy", prompts))}


# ------------------------------------------------------------------------------------------------- NLHF and SLHF
class FirstCharacterPreference(Utility):
    """P0(y ≻ y′) = 1/2 + (good(y) − good(y′)) / 2: a good reply beats a bad one surely, equals tie."""

    def __init__(self, mirrored: bool) -> None:
        super().__init__()
        self.mirrored = mirrored

    def forward(self, prompts, first, second):
        g = torch.tensor([good(a, self.mirrored) - good(b, self.mirrored) for a, b in zip(first, second)])
        return 0.5 + 0.5 * g


def _nlhf_run(tiny_lm_dir, tmp_path, mirrored: bool) -> dict[str, tuple[float, float]]:
    from alignment_games.datamodules.prompts import PromptDataModule
    from alignment_games.modules.nlhf import NashMDPG

    L.seed_everything(0)
    model = NashMDPG(
        lm=_lm(tiny_lm_dir),
        preference=FirstCharacterPreference(mirrored),
        lr=1e-2,
        tau=0.01,
        beta=0.25,
        samples_per_prompt=8,
        sampling=Sampling(temperature=1.0, max_new_tokens=1),
    )
    prompts = model.eval_prompts(PROMPTS)
    before = good_mass(model.players, "policy", prompts)
    _trainer(tmp_path, steps=10).fit(model, PromptDataModule(num_prompts=80, batch_size=4))
    return {"policy": (before, good_mass(model.players, "policy", prompts))}


def _leader_follower_run(cls, tmp_path, **kw) -> dict[str, tuple[float, float]]:
    """Train a deep-SMIDA-shaped game (SLHF or deep-SMIDA) 10 batches; each player's good mass before and after.

    The follower's mass is read after a fixed reply of the leader.
    """
    from alignment_games.datamodules.prompts import PromptDataModule

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
    _trainer(tmp_path, steps=20).fit(model, PromptDataModule(num_prompts=80, batch_size=4))  # 2 steps a batch
    return {p: (before[p], good_mass(model.players, p, x)) for p, x in shown.items()}


def _slhf_run(tiny_lm_dir, tmp_path, mirrored: bool) -> dict[str, tuple[float, float]]:
    """Both players raise their chance of beating the other under P0: each learns to start well."""
    from alignment_games.modules.slhf import SLHF

    return _leader_follower_run(SLHF, tmp_path, lm=_lm(tiny_lm_dir), preference=FirstCharacterPreference(mirrored))


# ------------------------------------------------------------------------------------------------------ deep-SMIDA
class FollowerEdge(FirstCharacterPreference):
    """u(x, y, y′) = P0(y′ ≻ y) = 1/2 + (good(y′) − good(y)) / 2: the follower gains by opening well, the leader too."""

    def forward(self, prompts, leader, follower):
        return super().forward(prompts, follower, leader)


def _deep_smida_run(tiny_lm_dir, tmp_path, mirrored: bool) -> dict[str, tuple[float, float]]:
    """The follower ascends u and the leader descends it (its cost is the follower's best response): both open well."""
    from alignment_games.modules.deep_smida import DeepSMIDA

    return _leader_follower_run(DeepSMIDA, tmp_path, lm=_lm(tiny_lm_dir), utility=FollowerEdge(mirrored), log_samples=0)


# ------------------------------------------------------------------------------------------------------ debate
class CritiqueJudge(DebateJudge):
    """Votes for Bob (0) when his critique is good, for Alice (1) otherwise: Bob's reward is good(critique)."""

    def __init__(self, mirrored: bool) -> None:
        super().__init__(num_votes=2)
        self.mirrored = mirrored

    def __call__(self, transcripts):
        votes = [[1.0 - good(t.replies[1].raw, self.mirrored)] * self.num_votes for t in transcripts]
        return JudgeVotes(torch.tensor(votes), [[] for _ in transcripts])


def _debate_run(tiny_lm_dir, tmp_path, mirrored: bool) -> dict[str, tuple[float, float]]:
    """Debate-AB with Bob's critique the forked ply: the shared policy learns to open critiques well."""
    from alignment_games.datamodules.prompts import PromptDataModule
    from alignment_games.modules.algorithms.debate import Transcript, split_reply
    from alignment_games.modules.debate import DebateSelfPlay

    L.seed_everything(0)
    model = DebateSelfPlay(
        lm=_lm(tiny_lm_dir),
        protocol="debate_ab",
        judge=CritiqueJudge(mirrored),
        policy_gradient=PolicyGradient(group_size=16, clip=None),
        lr=4e-2,  # the debates train at lr / 4
        sampling=Sampling(temperature=1.0, max_new_tokens=1),
        reply_max_new_tokens=1,
        require_thinking=False,
        alice_prompt="{problem}",
        trainable_plies=["critique"],
    )
    shown = []
    for problem in PROMPTS:  # Bob's prompt after a fixed answer of Alice's
        t = Transcript(problem, None, "debate_ab")
        t.replies.append(split_reply("The answer is \\boxed{5}.", required=False))
        shown.append(model.render("critique", t))
    before = good_mass(model.bank, "policy", shown)
    _trainer(tmp_path, steps=10).fit(model, PromptDataModule(num_prompts=80, batch_size=4))
    return {"policy": (before, good_mass(model.bank, "policy", shown))}


# --------------------------------------------------------------------------------------------------------- pool
def _pool_run(
    tiny_lm_dir, tmp_path, mirrored: bool, algorithm: str, loss_type: str = "dpo"
) -> dict[str, tuple[float, float]]:
    """Every peer judge scores a good response 10 and a bad one 1; the players learn from the duels."""
    import json

    from alignment_games.datamodules.pool import InstructionPoolDataModule
    from alignment_games.datamodules.prompts import PromptSource
    from alignment_games.modules.games.pool_followers import FollowerTraining
    from alignment_games.modules.pool import StackelbergPool

    path = tmp_path / "pool.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps({"question": q, "answer": "0"}) for q in PROMPTS * 4))
    L.seed_everything(0)
    model = StackelbergPool(
        lm={"name_or_path": str(tiny_lm_dir), "lora_r": 4, "lora_alpha": 8},
        duels_per_iteration=8,
        num_iterations=6,
        sampling=Sampling(temperature=1.0, max_new_tokens=1),
        eval_max_new_tokens=1,
        followers=FollowerTraining(
            algorithm,
            lr=1e-2,
            batch_size=8,
            pairwise=PairwiseLoss(loss_type, beta=1.0),
            policy_gradient=PolicyGradient(group_size=4),
        ),
    )
    model.judge_all = lambda asked: {
        p: [(10.0 if good(y, mirrored) else 1.0, True) for y in ys] for p, (_, ys, _) in asked.items()
    }
    shown = {p: [model.chat(p, x, model.hparams.system_prompt) for x in PROMPTS] for p in model.player_names}
    before = {p: good_mass(model.bank(p), p, shown[p]) for p in model.player_names}
    data = InstructionPoolDataModule(
        source=PromptSource(path=str(path), prompt_column="question", reference_column="answer"),
        val_fraction=0.25,
        batch_size=4,
        iterations_per_epoch=1,
    )
    trainer = _trainer(tmp_path, steps=-1)
    trainer.fit_loop.max_epochs = 6
    trainer.fit(model, datamodule=data)
    return {p: (before[p], good_mass(model.bank(p), p, shown[p])) for p in model.player_names}


# ------------------------------------------------------------------------------------------- preference ensemble
BAD = sorted(frozenset(string.ascii_letters + string.digits) - GOOD)


def _preference_run(tiny_lm_dir, tmp_path, mirrored: bool) -> dict[str, tuple[float, float]]:
    """The ensemble learns from labels that prefer the reply opening with a good character (mirrored: a bad one).

    The measure is the members' mean P(y ≻ y′) for a good y against a bad y′, on prompts it did not train on: it
    rises when the labels favour good openings and falls when they favour bad ones.
    """
    import json
    import random

    from alignment_games.datamodules.preference import PreferenceDataModule
    from alignment_games.modules.preference import PreferenceEnsemble

    rng, rows = random.Random(0), []
    for x in [p.question for p in generate_problems(48, seed=3, min_steps=1, max_steps=1)]:
        for _ in range(2):
            y, y_bad = f"{rng.choice(sorted(GOOD))} is it.", f"{rng.choice(BAD)} is it."
            a, b = (y, y_bad) if rng.random() < 0.5 else (y_bad, y)
            rows.append({"prompt": x, "response_a": a, "response_b": b, "label": good(a, mirrored)})
    path = tmp_path / "pairs.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(r) for r in rows))
    L.seed_everything(0)
    model = PreferenceEnsemble(_lm(tiny_lm_dir), backbone_task="causal_lm", num_members=2, lr=5e-2)
    shown = [(x, f"{g} is it.", f"{b} is it.") for x in PROMPTS for g, b in zip(sorted(GOOD), BAD)]

    def p_good() -> float:
        return float(model.score(*map(list, zip(*shown))).mean())

    before = p_good()
    data = PreferenceDataModule(path=str(path), val_fraction=0.0, heldout_fraction=0.0, batch_size=8, max_length=64)
    _trainer(tmp_path, steps=24).fit(model, datamodule=data)
    return {"ensemble": (before, p_good())}


# ---------------------------------------------------------------------------------------------------------- SFT
PUNCTUATION = frozenset(string.punctuation)


def _sft_run(tiny_lm_dir, tmp_path, mirrored: bool) -> dict[str, tuple[float, float]]:
    """SFT's "reward" is its data: responses that open with a good character (mirrored: with punctuation).

    Any SFT on printable openings draws mass from the rest of the vocabulary to both sets, so the measure here is
    ``log(mass(GOOD) / mass(punctuation))``: it rises when the data opens well and falls when it opens with
    punctuation.
    """
    import math

    from alignment_games.modules.sft import CausalLMSFT

    L.seed_everything(0)
    model = CausalLMSFT(lm=ModelConfig(tiny_lm_dir), output_dir=str(tmp_path / "out"), lr=3e-4)
    starts = sorted(PUNCTUATION) if mirrored else sorted(GOOD)
    rows = [{"prompt": x, "response": f"{starts[i % len(starts)]} is it."} for i, x in enumerate(PROMPTS * 4)]
    loader = torch.utils.data.DataLoader(
        rows, batch_size=4, collate_fn=lambda b: {k: [r[k] for r in b] for k in ("prompt", "response")}
    )
    system = {"role": "system", "content": model.hparams.system_prompt}
    shown = [render_chat(model.tokenizer, [system, {"role": "user", "content": x}], True) for x in PROMPTS]

    def log_ratio() -> float:
        masses = _plain_masses(model.model, model.tokenizer, shown, [GOOD, PUNCTUATION])
        return math.log(masses[0] / masses[1])

    before = log_ratio()
    _trainer(tmp_path, steps=6).fit(model, loader)
    return {"policy": (before, log_ratio())}


@torch.no_grad()
def _plain_masses(model, tokenizer, prompts: list[str], sets: list[frozenset[str]]) -> list[float]:
    """Mean next-token mass of the tokens decoding to one character of each set, after each prompt in turn."""
    ids = [[i for i in range(len(tokenizer)) if tokenizer.decode([i]) in chars] for chars in sets]
    out = [0.0] * len(sets)
    for text in prompts:
        enc = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        probs = model(input_ids=enc).logits[0, -1].float().softmax(-1)
        out = [o + float(probs[i].sum()) / len(prompts) for o, i in zip(out, ids)]
    return out


RUNS = {
    "GRPO": _grpo_run,
    "NashMDPG": _nlhf_run,
    "SLHF": _slhf_run,
    "DeepSMIDA": _deep_smida_run,
    "DebateSelfPlay": _debate_run,
    "StackelbergPool-dpo": lambda *a, **k: _pool_run(*a, **k, algorithm="dpo"),
    # RPO: DPO + the chosen's NLL
    "StackelbergPool-rpo": lambda *a, **k: _pool_run(*a, **k, algorithm="dpo", loss_type="rpo"),
    "StackelbergPool-grpo": lambda *a, **k: _pool_run(*a, **k, algorithm="grpo"),
    "CausalLMSFT": _sft_run,
    "PreferenceEnsemble": _preference_run,
}


#: the families whose two runs take 20-40 s on 2 cores: in the e2e set (`pytest -m e2e`, .ci/run)
E2E = {"SLHF", "DeepSMIDA", "DebateSelfPlay"}


@pytest.mark.parametrize("family", [pytest.param(f, marks=[pytest.mark.e2e] if f in E2E else []) for f in RUNS])
def test_an_update_moves_the_policy_toward_its_reward(family, tiny_lm_dir, tmp_path):
    rewarded = RUNS[family](tiny_lm_dir, tmp_path / "good", mirrored=False)
    mirrored = RUNS[family](tiny_lm_dir, tmp_path / "mirrored", mirrored=True)
    print(family, {p: (round(b, 4), round(a, 4), round(mirrored[p][1], 4)) for p, (b, a) in rewarded.items()})
    for player, (before, after) in rewarded.items():
        before_m, after_m = mirrored[player]
        assert before == pytest.approx(before_m)  # the same start
        assert after > before, (player, before, after)  # the rewarded first characters gained mass
        assert after_m < before, (player, before, after_m)  # and lost it when the reward is mirrored
