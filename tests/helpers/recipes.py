"""One test recipe per model family: everything the contract tests need to know about it, in one place.

A :class:`Recipe` says how to build the family tiny (:attr:`Recipe.build`, shared by the non-finite, refused-value,
optimizer, loader and 4-bit tests), the values it must refuse by name, its kill-resume runs (a config and tiny
overrides), the rate options of its optimizers, and its learning-direction runs. ``tests/test_families.py`` requires
a recipe for every family that ``alignment_games.modules.training.registry.model_families`` finds, and each contract
in it or a reason in :attr:`Recipe.exempt`.

Adding a family: write its section below (a builder, a learning run) and one ``add(Recipe(...))`` at its end, copying
the nearest sibling (a policy-gradient family: GRPO; a pairwise family: the pool; a leader-follower game: SLHF). Its
config's smoke overrides are its own header's ``# Smoke:`` lines (``tests/helpers/config_header.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import lightning as L
import torch

from alignment_games.modules.algorithms.rl_losses import PairwiseLoss, PolicyGradient
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.scorers.judges import DebateJudge, JudgeVotes, ProgrammaticJudge
from alignment_games.modules.scorers.utility import Utility

from . import learning
from .learning import PROMPTS, FirstCharacterPreference, FollowerEdge, good, good_mass
from .resume_harness import Family, Kill

#: a builder: (the model's ``lm``, a scratch folder, overrides of the family's arguments) -> (model, ``fit`` kwargs)
Builder = Callable[..., tuple[L.LightningModule, dict[str, Any]]]
#: a learning run: (tiny model folder, scratch folder, mirrored) -> {player: (good mass before, after)}
Learning = Callable[..., dict[str, tuple[float, float]]]


@dataclass(frozen=True)
class Rates:
    """The optimizer contract: each player's optimizer at the family's rates (``tests/test_injected_optimizers.py``).

    Attributes:
        options: ``init_args`` options that set the rates (and AdamW's settings), e.g. ``"lr=0.5"``.
        lrs: The rate of each group of each player's optimizer that those options give.
        adamw: AdamW's (weight decay, betas) when the family sets them; else none and torch's betas.
    """

    options: tuple[str, ...]
    lrs: list[list[float]]
    adamw: tuple[float, tuple[float, float]] = (0.0, (0.9, 0.999))


@dataclass(frozen=True)
class Recipe:
    """A family's test recipe.

    Attributes:
        family: Its class name, as the registry lists it.
        build: Its tiny model on a given ``lm`` and the data to fit it on; keyword arguments override the family's.
        steps: Trainer limits of a three-batch fit (``max_steps`` counts every optimizer's steps).
        options: Extra builder arguments per contract (``"loader"``, ``"4bit"``), e.g. to make it load adapters.
        four_bit: Variants of the 4-bit run: (test id suffix, builder arguments, with ``"lm"``'s ``ModelConfig``
            fields and ``"trainer"``'s options apart); one plain run by default.
        refused: (bad arguments, the exact message) pairs its ``__init__`` must refuse before loading a model.
        resume: Its kill-resume runs through ``train.py`` (the first also gives the optimizer test its config).
        rates: Its optimizers' rate options.
        learns: Its learning-direction runs by test id suffix (``""``: the plain run).
        slow_learning: Its learning runs take 20-40 s on 2 cores: in the ``e2e`` set.
        exempt: Contract -> why it does not apply.
    """

    family: str
    build: Builder | None = None
    steps: dict[str, int] = field(default_factory=lambda: {"max_steps": 3})
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    four_bit: tuple[tuple[str, dict[str, Any]], ...] = (("", {}),)
    refused: tuple[tuple[dict[str, Any], str], ...] = ()
    resume: tuple[Family, ...] = ()
    rates: Rates | None = None
    learns: dict[str, Learning] = field(default_factory=dict)
    slow_learning: bool = False
    exempt: dict[str, str] = field(default_factory=dict)

    def make(self, lm: ModelConfig, tmp_path, contract: str = "", **kw: Any) -> tuple[L.LightningModule, dict]:
        """The tiny model on ``lm`` and its ``fit`` kwargs, with ``contract``'s options and ``kw`` on top."""
        return self.build(lm, tmp_path, **{**self.options.get(contract, {}), **kw})


RECIPES: dict[str, Recipe] = {}


def add(recipe: Recipe) -> None:
    """Register a family's recipe (one per family)."""
    assert recipe.family not in RECIPES, f"two recipes for {recipe.family}"
    RECIPES[recipe.family] = recipe


def tiny_lm(path, **kw: Any) -> ModelConfig:
    """The tiny model at ``path`` under rank-4 LoRA adapters (alpha 8)."""
    return ModelConfig(str(path), **{"lora_r": 4, "lora_alpha": 8, **kw})


class Letters(Utility):
    """A score in [0, 1] that varies with the reply (its distinct characters): a utility or preference that loads
    nothing."""

    def forward(self, prompts, leader, follower):
        return torch.tensor([len(set(y)) / 50.0 for y in follower], dtype=torch.float32)


def _prompts(**kw: Any) -> dict[str, Any]:
    from alignment_games.datamodules.prompts import PromptDataModule

    return {"datamodule": PromptDataModule(**{"num_prompts": 24, "batch_size": 2, **kw})}


def chain(n: int) -> tuple[Kill, ...]:
    """SIGTERM mid-epoch 0, SIGKILL mid-epoch 1, SIGKILL at the start of epoch 2, SIGTERM at the end of epoch 2."""
    return (
        Kill("SIGTERM", after_batch=n // 2),
        Kill("SIGKILL", after_batch=n + n // 2),
        Kill("SIGKILL", epoch=2),
        Kill("SIGTERM", after_batch=3 * n),
    )


def lm_run(name: str, config: str, args: tuple[str, ...], **kw: Any) -> Family:
    """A kill-resume run on the tiny LM: 4 batches an epoch, a checkpoint every 5, :func:`chain` (4) by default."""
    return Family(
        name, config, args, **{"batches_per_epoch": 4, "ckpt_every": 5, "kills": chain(4), "needs_tiny_lm": True, **kw}
    )


# the slower games' chain: SIGTERM mid-epoch, then SIGKILL at an epoch boundary (which resumes mid-epoch 1)
SHORT_CHAIN = (Kill("SIGTERM", after_batch=2), Kill("SIGKILL", epoch=2))
# LoRA families on the tiny LM: small adapters, prompts cut from the left (short sequences, fast steps)
TINY_LORA = (
    "--model.init_args.lm.max_prompt_tokens=48",
    "--model.init_args.lm.lora_r=4",
    "--model.init_args.lm.lora_alpha=8",
)
# the preference model P0 of NLHF and SLHF: an untrained two-member ensemble on the tiny LM (as deep_smida's utility)
TINY_PREFERENCE = (
    "--model.init_args.preference.init_args.backbone={tiny_lm_dir}",
    "--model.init_args.preference.init_args.backbone_task=causal_lm",
    "--model.init_args.preference.init_args.num_members=2",
    "--model.init_args.preference.init_args.allow_untrained=true",
)
# 14 steps (3.5 epochs of 4 batches) with one validation, at batch 9
FOURTEEN_STEPS = ("--trainer.max_steps=14", "--trainer.val_check_interval=9", "--trainer.limit_val_batches=1")
NOT_TRAINED_BY_GRADIENT = {
    contract: "no gradients, no model: test_tabular_smida, test_nonfinite_gradients' tabular tests"
    for contract in ("non-finite skip", "learning direction", "optimizers", "loader", "4-bit base")
}


# ------------------------------------------------------------------------------------------------- tabular SMIDA
add(
    Recipe(
        family="TabularSMIDA",
        resume=(
            Family(
                name="smida_tabular",
                config="smida_tabular.yaml",
                args=("--data.init_args.steps_per_epoch=6", "--trainer.max_steps=22"),
                batches_per_epoch=6,
                ckpt_every=5,
                kills=chain(6),
            ),
        ),
        exempt={
            **NOT_TRAINED_BY_GRADIENT,
            "refused values": "no model to load: test_refused_values.test_tabular_game_sizes_are_refused_by_name",
        },
    )
)


# ------------------------------------------------------------------------------------------- preference ensemble
def _preference(lm, tmp_path, **kw):
    from alignment_games.datamodules.preference import PreferenceDataModule
    from alignment_games.modules.preference import PreferenceEnsemble

    model = PreferenceEnsemble(lm, **{"backbone_task": "causal_lm", "num_members": 2, **kw})
    data = PreferenceDataModule(num_prompts=24, responses_per_prompt=3, batch_size=8, max_length=64)
    return model, {"datamodule": data}


def _preference_learns(tiny_lm_dir, tmp_path, mirrored: bool) -> dict[str, tuple[float, float]]:
    """The ensemble learns from labels that prefer the reply opening with a good character (mirrored: a bad one).

    The measure is the members' mean P(y ≻ y′) for a good y against a bad y′, on prompts it did not train on: it
    rises when the labels favour good openings and falls when they favour bad ones.
    """
    import random

    from alignment_games.datamodules.preference import PreferenceDataModule
    from alignment_games.modules.algorithms.arithmetic import generate_problems
    from alignment_games.modules.preference import PreferenceEnsemble

    rng, rows = random.Random(0), []
    for x in [p.question for p in generate_problems(48, seed=3, min_steps=1, max_steps=1)]:
        for _ in range(2):
            y, y_bad = f"{rng.choice(sorted(learning.GOOD))} is it.", f"{rng.choice(learning.BAD)} is it."
            a, b = (y, y_bad) if rng.random() < 0.5 else (y_bad, y)
            rows.append({"prompt": x, "response_a": a, "response_b": b, "label": good(a, mirrored)})
    path = tmp_path / "pairs.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(r) for r in rows))
    L.seed_everything(0)
    model = PreferenceEnsemble(tiny_lm(tiny_lm_dir), backbone_task="causal_lm", num_members=2, lr=5e-2)
    shown = [(x, f"{g} is it.", f"{b} is it.") for x in PROMPTS for g, b in zip(sorted(learning.GOOD), learning.BAD)]

    def p_good() -> float:
        return float(model.score(*map(list, zip(*shown))).mean())

    before = p_good()
    data = PreferenceDataModule(path=str(path), val_fraction=0.0, heldout_fraction=0.0, batch_size=8, max_length=64)
    learning.trainer(tmp_path, steps=24).fit(model, datamodule=data)
    return {"ensemble": (before, p_good())}


add(
    Recipe(
        family="PreferenceEnsemble",
        build=_preference,
        options={"loader": {"sharing": "lora", "cache_features": False}},
        four_bit=(("lora", {"sharing": "lora", "cache_features": False}), ("frozen", {"cache_features": False})),
        refused=(
            ({"num_members": 0}, "num_members must be positive, got 0"),
            ({"member_type": "rank"}, "member_type must be 'gpm' or 'bt', got 'rank'"),
            ({"sharing": "full"}, "sharing must be 'frozen', 'lora' or 'separate', got 'full'"),
            ({"embed_dim": 15}, "embed_dim must be a positive even number, got 15"),
            ({"init_scale": 0.0}, "init_scale must be positive, got 0.0"),
            ({"backbone_lr": float("nan")}, "backbone_lr must be positive, got nan"),
            ({"weight_decay": -0.1}, "weight_decay must be at least 0.0, got -0.1"),
            ({"max_length": 0}, "max_length must be at least 1, got 0"),
        ),
        resume=(
            Family(
                name="preference_ensemble",
                config="preference_ensemble.yaml",
                args=(
                    "--model.init_args.lm.name_or_path={tiny_lm_dir}",
                    "--model.init_args.backbone_task=causal_lm",
                    "--model.init_args.num_members=2",
                    "--model.init_args.report_bootstrap=0",
                    "--data.init_args.num_prompts=24",
                    "--data.init_args.responses_per_prompt=3",
                    "--data.init_args.batch_size=8",
                    "--data.init_args.max_length=96",
                    "--trainer.max_steps=20",
                    "--trainer.limit_val_batches=1",
                    "--trainer.num_sanity_val_steps=0",
                ),
                batches_per_epoch=6,
                ckpt_every=5,
                kills=chain(6),
                needs_tiny_lm=True,
            ),
        ),
        rates=Rates(("lr=0.5", "backbone_lr=0.25", "weight_decay=0.125"), [[0.5]], (0.125, (0.9, 0.999))),
        learns={"": _preference_learns},
    )
)


# ----------------------------------------------------------------------------------------------------------- SFT
def _sft(lm, tmp_path, **kw):
    from alignment_games.datamodules.sft import ArithmeticSFTDataModule
    from alignment_games.modules.sft import CausalLMSFT

    model = CausalLMSFT(**{"lm": lm, "output_dir": str(tmp_path / "out"), "max_length": 64, **kw})
    return model, {"datamodule": ArithmeticSFTDataModule(num_prompts=40, batch_size=4)}


def _sft_learns(tiny_lm_dir, tmp_path, mirrored: bool) -> dict[str, tuple[float, float]]:
    """SFT's "reward" is its data: responses that open with a good character (mirrored: with punctuation).

    Any SFT on printable openings draws mass from the rest of the vocabulary to both sets, so the measure here is
    ``log(mass(GOOD) / mass(punctuation))``: it rises when the data opens well and falls when it opens with
    punctuation.
    """
    import math

    from alignment_games.modules.lm.text import render_chat
    from alignment_games.modules.sft import CausalLMSFT

    L.seed_everything(0)
    model = CausalLMSFT(lm=ModelConfig(tiny_lm_dir), output_dir=str(tmp_path / "out"), lr=3e-4)
    starts = sorted(learning.PUNCTUATION) if mirrored else sorted(learning.GOOD)
    rows = [{"prompt": x, "response": f"{starts[i % len(starts)]} is it."} for i, x in enumerate(PROMPTS * 4)]
    loader = torch.utils.data.DataLoader(
        rows, batch_size=4, collate_fn=lambda b: {k: [r[k] for r in b] for k in ("prompt", "response")}
    )
    system = {"role": "system", "content": model.hparams.system_prompt}
    shown = [render_chat(model.tokenizer, [system, {"role": "user", "content": x}], True) for x in PROMPTS]

    def log_ratio() -> float:
        sets = [learning.GOOD, learning.PUNCTUATION]
        masses = learning.plain_masses(model.model, model.tokenizer, shown, sets)
        return math.log(masses[0] / masses[1])

    before = log_ratio()
    learning.trainer(tmp_path, steps=6).fit(model, loader)
    return {"policy": (before, log_ratio())}


add(
    Recipe(
        family="CausalLMSFT",
        build=_sft,
        options={"loader": {"lora": True}, "4bit": {"lora": True, "max_length": 32}},
        refused=(
            ({"lr": 0.0}, "lr must be positive, got 0.0"),
            ({"weight_decay": -1e-4}, "weight_decay must be at least 0.0, got -0.0001"),
            ({"max_length": 0}, "max_length must be at least 1, got 0"),
            ({"warmup_steps": -1}, "warmup_steps must be at least 0, got -1"),
            ({"min_lr_ratio": 1.5}, r"min_lr_ratio must lie in \[0, 1\], got 1.5"),
            ({"tiny_tokenizer": "wordpiece"}, r"tiny_tokenizer must be one of \['byte', 'task'\], got 'wordpiece'"),
        ),
        resume=(
            Family(
                name="sft_tiny",
                config="sft_tiny.yaml",
                args=(
                    '--model.init_args.tiny_config={"hidden_size": 32, "intermediate_size": 64, '
                    '"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}',
                    "--model.init_args.max_length=96",
                    "--data.init_args.num_prompts=25",
                    "--data.init_args.batch_size=4",
                    "--trainer.max_steps=20",
                    "--trainer.val_check_interval=4",
                    "--trainer.limit_val_batches=1",
                    "--trainer.num_sanity_val_steps=0",
                ),
                batches_per_epoch=6,
                ckpt_every=5,
                kills=chain(6),
            ),
        ),
        rates=Rates(("lr=0.5", "weight_decay=0.125"), [[0.5]], (0.125, (0.9, 0.999))),
        learns={"": _sft_learns},
    )
)


# ---------------------------------------------------------------------------------------------------------- GRPO
def _grpo(lm, tmp_path, **kw):
    from alignment_games.modules.grpo import GRPO

    model = GRPO(
        **{
            "lm": lm,
            "policy_gradient": {"group_size": 2, "kl_coef": 0.1},
            "sampling": Sampling(max_new_tokens=6),
            "lr": 5e-2,
            "chat_template": False,
            **kw,
        }
    )
    # the answer reward of a random tiny policy is 0 everywhere (no advantage, no update); the length varies
    model.rewards = lambda inputs, completions, references, **_: torch.tensor([[len(c) / 10.0] for c in completions])
    return model, _prompts()


def _grpo_learns(tiny_lm_dir, tmp_path, mirrored: bool, **kw: Any) -> dict[str, tuple[float, float]]:
    """GRPO (with ``pairwise``: Online DPO, IPO, RPO or SimPO on each group's best and worst reply)."""
    from alignment_games.modules.grpo import GRPO

    L.seed_everything(0)
    model = GRPO(
        lm=tiny_lm(tiny_lm_dir),
        policy_gradient=PolicyGradient(group_size=16, kl_coef=0.0),
        sampling=Sampling(temperature=1.0, max_new_tokens=1),
        lr=1e-2,
        chat_template=False,
        **kw,
    )
    model.rewards = lambda inputs, completions, refs, group_size=1: torch.tensor(
        [[good(c, mirrored)] for c in completions]
    )
    prompts = model.format_prompts(PROMPTS)
    before = good_mass(model.players, "policy", prompts)
    learning.trainer(tmp_path, steps=10).fit(model, learning.prompts())
    return {"policy": (before, good_mass(model.players, "policy", prompts))}


# GRPO on the tiny LM with a reward model
GRPO_RUN = (
    "--model.init_args.lm.name_or_path={tiny_lm_dir}",
    # the tiny LM's folder loaded as a sequence classifier: its backbone with a score head initialised under the
    # run's seed, so the rewards vary and the adapter moves (the answer checker alone gives a random policy 0
    # everywhere)
    "--model.init_args.reward_models=[{tiny_lm_dir}]",
    "--model.init_args.answer_reward=false",
    "--model.init_args.policy_gradient.group_size=2",
    "--model.init_args.sampling.max_new_tokens=4",
    *TINY_LORA,
    "--data.init_args.num_prompts=9",  # 8 train prompts (4 batches of 2), 1 validation
    *FOURTEEN_STEPS,
)
add(
    Recipe(
        family="GRPO",
        build=_grpo,
        options={"4bit": {"sampling": Sampling(max_new_tokens=4)}},
        four_bit=(
            ("", {}),
            ("checkpointing", {"lm": {"gradient_checkpointing": True}}),
            ("bf16-mixed", {"trainer": {"precision": "bf16-mixed"}}),
        ),
        refused=(
            ({"adam_betas": (0.9, 1.0)}, r"adam_betas\[1\] must be in \[0.0, 1.0\), got 1.0"),
            ({"weight_decay": -1e-4}, "weight_decay must be at least 0.0, got -0.0001"),
            ({"reward_max_length": 0}, "reward_max_length must be at least 1, got 0"),
            ({"eval_max_new_tokens": 0}, "eval_max_new_tokens must be at least 1, got 0"),
            ({"policy_gradient": {"group_size": 1}}, "policy_gradient.group_size must be at least 2, got 1"),
            (
                {"policy_gradient": {"max_tokens_per_micro_batch": -1}},
                "policy_gradient.max_tokens_per_micro_batch must be at least 0, got -1",
            ),
            (
                {"pairwise": {"loss_type": "ipo"}},  # the builder's kl_coef is 0.1
                r"policy_gradient.kl_coef must be 0 with pairwise \(the pairwise loss holds the KL term\)",
            ),
            ({"pairwise": {"beta": 0.0}}, "pairwise.beta must be positive, got 0.0"),
        ),
        resume=(
            lm_run(
                name="grpo",
                config="grpo_tiny.yaml",
                args=GRPO_RUN,
            ),
            lm_run(  # the same run over a 4-bit (NF4) base: the packed weights are reloaded, the adapter resumes
                name="grpo_4bit",
                config="grpo_tiny.yaml",
                args=(*GRPO_RUN, "--model.init_args.lm.load_in_4bit=true"),
            ),
        ),
        rates=Rates(("lr=0.5", "weight_decay=0.125", "adam_betas=[0.5,0.75]"), [[0.5]], (0.125, (0.5, 0.75))),
        learns={"": _grpo_learns, "online_ipo": partial(_grpo_learns, pairwise=PairwiseLoss("ipo"))},
    )
)


# ---------------------------------------------------------------------------------------------------- deep-SMIDA
def _leader_follower(family: str, scorer: str) -> Builder:
    """A leader-follower game's builder (deep-SMIDA, SLHF): two samples a side, :class:`Letters` as its ``scorer``
    (its utility or preference), both players at rate 1e-2."""

    def build(lm, tmp_path, **kw):
        from alignment_games.modules.training.registry import model_families

        args = {
            "lm": lm,
            scorer: Letters(),
            "samples_per_prompt": 2,
            "follower_samples": 2,
            "sampling": Sampling(temperature=0.6, max_new_tokens=6),
            "leader_lr": 1e-2,
            "follower_lr": 1e-2,
            **kw,
        }
        return model_families()[family](**args), _prompts()

    return build


def _deep_smida_learns(tiny_lm_dir, tmp_path, mirrored: bool) -> dict[str, tuple[float, float]]:
    """The follower ascends u and the leader descends it (its cost is the follower's best response): both open well."""
    from alignment_games.modules.deep_smida import DeepSMIDA

    utility = FollowerEdge(mirrored)
    return learning.leader_follower_run(DeepSMIDA, tmp_path, lm=tiny_lm(tiny_lm_dir), utility=utility, log_samples=0)


add(
    Recipe(
        family="DeepSMIDA",
        build=_leader_follower("DeepSMIDA", "utility"),
        steps={"max_steps": 6},  # two optimizer steps per batch
        refused=(
            ({"alphas": (0.1, 1.0)}, r"alphas\[1\] must be in \(0.0, 1.0\), got 1.0"),
            ({"alphas": (0.0,)}, r"alphas\[0\] must be in \(0.0, 1.0\), got 0.0"),
            ({"epsilons": (0.0, -0.1)}, r"epsilons\[1\] must be in \[0.0, 1.0\), got -0.1"),
            ({"candidate_alpha": 1.5}, r"candidate_alpha must be in \(0.0, 1.0\), got 1.5"),
            ({"candidate_alpha": float("nan")}, r"candidate_alpha must be in \(0.0, 1.0\), got nan"),
            ({"eval_pairs": 0}, "eval_pairs must be at least 1, got 0"),
        ),
        resume=(
            lm_run(
                name="deep_smida",
                config="deep_smida.yaml",
                args=(
                    "--model.init_args.lm.name_or_path={tiny_lm_dir}",
                    "--model.init_args.sampling.max_new_tokens=4",
                    "--model.init_args.lm.max_prompt_tokens=48",  # cut from the left: short sequences, fast steps
                    "--model.init_args.follower_samples=2",
                    "--model.init_args.utility.init_args.backbone={tiny_lm_dir}",
                    "--model.init_args.utility.init_args.backbone_task=causal_lm",
                    "--model.init_args.utility.init_args.num_members=2",
                    "--model.init_args.utility.init_args.allow_untrained=true",
                    "--data.init_args.num_prompts=9",
                    "--data.init_args.batch_size=2",
                    "--trainer.max_steps=20",  # 10 batches: two optimizer steps each
                    "--trainer.val_check_interval=9",  # one validation in the reference run, one in the chain
                    "--trainer.limit_val_batches=1",
                ),
                steps_per_batch=2,
                kills=SHORT_CHAIN,  # the slowest family
                rel_tol=1e-6,  # the gradient norms of a step after a resume can differ in the last float32 bit
            ),
        ),
        rates=Rates(("leader_lr=0.5", "follower_lr=0.25"), [[0.5], [0.25]]),
        learns={"": _deep_smida_learns},
        slow_learning=True,
    )
)


# ---------------------------------------------------------------------------------------------------------- NLHF
def _nlhf(lm, tmp_path, **kw):
    from alignment_games.modules.nlhf import NashMDPG

    args = {
        "lm": lm,
        "preference": Letters(),  # a number in [0, 1] that varies with the opponent's reply
        "samples_per_prompt": 2,
        "sampling": Sampling(temperature=0.6, max_new_tokens=6),
        "lr": 1e-2,
        **kw,
    }
    return NashMDPG(**args), _prompts()


def _nlhf_learns(tiny_lm_dir, tmp_path, mirrored: bool) -> dict[str, tuple[float, float]]:
    from alignment_games.modules.nlhf import NashMDPG

    L.seed_everything(0)
    model = NashMDPG(
        lm=tiny_lm(tiny_lm_dir),
        preference=FirstCharacterPreference(mirrored),
        lr=1e-2,
        tau=0.01,
        beta=0.25,
        samples_per_prompt=8,
        sampling=Sampling(temperature=1.0, max_new_tokens=1),
    )
    prompts = model.eval_prompts(PROMPTS)
    before = good_mass(model.players, "policy", prompts)
    learning.trainer(tmp_path, steps=10).fit(model, learning.prompts())
    return {"policy": (before, good_mass(model.players, "policy", prompts))}


add(
    Recipe(
        family="NashMDPG",
        build=_nlhf,
        refused=(
            ({"tau": 0.0}, "tau must be positive, got 0.0"),
            ({"lr": -1e-4}, "lr must be positive, got -0.0001"),
            ({"beta": 1.5}, r"beta \(the reference's weight in the mixture\) must be in \[0, 1\], got 1.5"),
            ({"beta": float("nan")}, r"beta \(the reference's weight in the mixture\) must be in \[0, 1\], got nan"),
            ({"samples_per_prompt": 0}, "samples_per_prompt must be at least 1, got 0"),
            ({"eval_pairs": 0}, "eval_pairs must be at least 1, got 0"),
        ),
        resume=(
            lm_run(
                name="nlhf",
                config="nlhf.yaml",
                args=(
                    "--model.init_args.lm.name_or_path={tiny_lm_dir}",
                    "--model.init_args.sampling.max_new_tokens=4",
                    *TINY_LORA,
                    *TINY_PREFERENCE,
                    "--data.init_args.num_prompts=9",  # 8 train prompts (4 batches of 2), 1 validation
                    "--data.init_args.batch_size=2",
                    "--trainer.max_steps=10",  # one optimizer: 10 batches
                    # validations at batches 3, 6 and 9: the chain resumes at 5 between two of them, so the oracle's
                    # generator must travel in the checkpoint
                    "--trainer.val_check_interval=3",
                    "--trainer.limit_val_batches=1",
                ),
                kills=SHORT_CHAIN,
            ),
        ),
        rates=Rates(("lr=0.5",), [[0.5]]),
        learns={"": _nlhf_learns},
    )
)


# ---------------------------------------------------------------------------------------------------------- SLHF
def _slhf_learns(tiny_lm_dir, tmp_path, mirrored: bool) -> dict[str, tuple[float, float]]:
    """Both players raise their chance of beating the other under P0: each learns to start well."""
    from alignment_games.modules.slhf import SLHF

    preference = FirstCharacterPreference(mirrored)
    return learning.leader_follower_run(SLHF, tmp_path, lm=tiny_lm(tiny_lm_dir), preference=preference)


add(
    Recipe(
        family="SLHF",
        build=_leader_follower("SLHF", "preference"),
        steps={"max_steps": 6},  # two optimizer steps per batch
        refused=(
            ({"tau_follower": 0.0}, "tau_follower must be positive, got 0.0"),
            ({"leader_lr": -1e-3}, "leader_lr must be positive, got -0.001"),
            (
                {"follower_samples": 0, "samples_per_prompt": 1},
                r"samples_per_prompt \(D\) and follower_samples \(M\) must be at least 1, got D=1, M=0",
            ),
            ({"eval_pairs": 0}, "eval_pairs must be at least 1, got 0"),
            ({"follower_system_template": "Improve it."}, r"follower_system_template must contain \{leader_response\}"),
        ),
        resume=(
            lm_run(
                name="slhf",
                config="slhf.yaml",
                args=(
                    "--model.init_args.lm.name_or_path={tiny_lm_dir}",
                    "--model.init_args.sampling.max_new_tokens=4",
                    *TINY_LORA,
                    "--model.init_args.follower_samples=2",
                    *TINY_PREFERENCE,
                    "--data.init_args.num_prompts=9",
                    "--data.init_args.batch_size=2",
                    "--trainer.max_steps=20",  # 10 batches: two optimizer steps each
                    "--trainer.val_check_interval=3",  # as nlhf: validations at batches 3, 6 and 9
                    "--trainer.limit_val_batches=1",
                ),
                steps_per_batch=2,
                kills=SHORT_CHAIN,
            ),
        ),
        rates=Rates(("leader_lr=0.5", "follower_lr=0.25"), [[0.5], [0.25]]),
        learns={"": _slhf_learns},
        slow_learning=True,
    )
)


# -------------------------------------------------------------------------------------------------------- debate
def _debate(lm, tmp_path, **kw):
    from torch.utils.data import DataLoader

    from alignment_games.modules.debate import DebateSelfPlay

    args = {
        "lm": lm,
        "protocol": "debate_ab",
        "policy_gradient": {"group_size": 2},
        "sampling": Sampling(temperature=0.6, max_new_tokens=6),
        "reply_max_new_tokens": 4,
        "require_thinking": False,
        "alice_prompt": "{problem}",
        "judge": ProgrammaticJudge(num_votes=8, seed=1),
        **kw,
    }
    rows = [("What is 4 + 4?", "8"), ("1 + 1?", "2")]
    collate = lambda items: {"prompt": [x[0] for x in items], "reference": [x[1] for x in items]}  # noqa: E731
    return DebateSelfPlay(**args), {"train_dataloaders": DataLoader(rows, batch_size=2, collate_fn=collate)}


class CritiqueJudge(DebateJudge):
    """Votes for Bob (0) when his critique is good, for Alice (1) otherwise: Bob's reward is good(critique)."""

    def __init__(self, mirrored: bool) -> None:
        super().__init__(num_votes=2)
        self.mirrored = mirrored

    def __call__(self, transcripts):
        votes = [[1.0 - good(t.replies[1].raw, self.mirrored)] * self.num_votes for t in transcripts]
        return JudgeVotes(torch.tensor(votes), [[] for _ in transcripts])


def _debate_learns(tiny_lm_dir, tmp_path, mirrored: bool) -> dict[str, tuple[float, float]]:
    """Debate-AB with Bob's critique the forked ply: the shared policy learns to open critiques well."""
    from alignment_games.modules.algorithms.debate import Transcript, split_reply
    from alignment_games.modules.debate import DebateSelfPlay

    L.seed_everything(0)
    model = DebateSelfPlay(
        lm=tiny_lm(tiny_lm_dir),
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
    learning.trainer(tmp_path, steps=10).fit(model, learning.prompts())
    return {"policy": (before, good_mass(model.bank, "policy", shown))}


add(
    Recipe(
        family="DebateSelfPlay",
        build=_debate,
        options={"4bit": {"sampling": Sampling(max_new_tokens=4), "judge": ProgrammaticJudge(num_votes=4, seed=1)}},
        refused=(
            ({"policy_gradient": {"clip": 0.0}}, "policy_gradient.clip must be positive or null, got 0.0"),
            ({"word_penalty_coef": -0.01}, "word_penalty_coef must be at least 0.0, got -0.01"),
            ({"word_limit": 0}, "word_limit must be at least 1, got 0"),
            ({"reply_max_new_tokens": 0}, "reply_max_new_tokens must be at least 1, got 0"),
            ({"policy_gradient": {"micro_batch": -1}}, "policy_gradient.micro_batch must be at least 0, got -1"),
        ),
        resume=(
            lm_run(
                name="debate_ab",
                config="debate_ab.yaml",  # two plies: the fork choice, Bob's turn and the judge's generator resume
                args=(
                    "--model.init_args.lm.name_or_path={tiny_lm_dir}",
                    "--model.init_args.policy_gradient.group_size=2",
                    "--model.init_args.sampling.max_new_tokens=4",
                    "--model.init_args.reply_max_new_tokens=4",
                    *TINY_LORA,
                    "--data.init_args.num_prompts=16",  # 8 train problems (4 batches of 2), 8 validation
                    "--data.init_args.batch_size=2",
                    *FOURTEEN_STEPS,  # one validation (batch 9): MCC, peak window, eval history
                ),
            ),
        ),
        rates=Rates(("lr=2.0", "multi_player_lr_scale=0.25"), [[0.5]]),  # two-player debate: lr·scale
        learns={"": _debate_learns},
        slow_learning=True,
    )
)


# ---------------------------------------------------------------------------------------------------------- pool
def _pool(lm, tmp_path, **kw):
    from alignment_games.datamodules.pool import InstructionPoolDataModule
    from alignment_games.datamodules.prompts import PromptSource
    from alignment_games.modules.games.pool_followers import FollowerTraining
    from alignment_games.modules.pool import StackelbergPool
    from alignment_games.modules.scorers.peer_judges import PeerJudging

    path = tmp_path / "pool.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"{a}+{a + 1}=?", "answer": str(2 * a + 1)}) for a in range(8)))
    args = {
        "lm": lm,
        "judging": PeerJudging(template="{prompt} {response}", mode="constrained", max_new_tokens=6),
        "duels_per_iteration": 3,
        "num_iterations": 3,
        "sampling": Sampling(temperature=0.7, top_p=0.9, max_new_tokens=6),
        "eval_max_new_tokens": 6,
        "followers": FollowerTraining(lr=1e-2, batch_size=4),
        **kw,
    }
    data = InstructionPoolDataModule(
        source=PromptSource(path=str(path), prompt_column="question", reference_column="answer"),
        val_fraction=0.25,
        batch_size=4,
        iterations_per_epoch=3,
    )
    return StackelbergPool(**args), {"datamodule": data}


def _pool_learns(algorithm: str, loss_type: str = "dpo") -> Learning:
    """Every peer judge scores a good response 10 and a bad one 1; the players learn from the duels."""

    def run(tiny_lm_dir, tmp_path, mirrored: bool) -> dict[str, tuple[float, float]]:
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
        trainer = learning.trainer(tmp_path, steps=-1)
        trainer.fit_loop.max_epochs = 6
        trainer.fit(model, datamodule=data)
        return {p: (before[p], good_mass(model.bank(p), p, shown[p])) for p in model.player_names}

    return run


add(
    Recipe(
        family="StackelbergPool",
        build=_pool,
        steps={"max_epochs": 1},  # the followers' steps per iteration vary
        options={
            "loader": {"num_players": 3},
            "4bit": {"duels_per_iteration": 2, "sampling": Sampling(max_new_tokens=4), "eval_max_new_tokens": 4},
        },
        refused=(
            ({"gamma": 0.0}, r"gamma must be in \(0.0, 1.0\], got 0.0"),
            ({"gamma": 1.5}, r"gamma must be in \(0.0, 1.0\], got 1.5"),
            ({"eval_max_new_tokens": 0}, "eval_max_new_tokens must be at least 1, got 0"),
        ),
        resume=(
            lm_run(
                name="pool_dpo",
                config="pool_dpo.yaml",
                args=(
                    "--model.init_args.lm.name_or_path={tiny_lm_dir}",
                    "--model.init_args.duels_per_iteration=2",
                    "--model.init_args.num_iterations=13",
                    "--model.init_args.sampling.max_new_tokens=4",
                    "--model.init_args.eval_max_new_tokens=4",
                    *TINY_LORA,
                    "--data.init_args.num_problems=20",
                    "--data.init_args.num_test_problems=2",
                    "--data.init_args.batch_size=2",
                    "--data.init_args.iterations_per_epoch=4",  # one batch = one game iteration, four per epoch
                    "--trainer.max_steps=39",  # 13 iterations: one DPO step per follower each (no iteration ties)
                    "--trainer.limit_val_batches=1",
                ),
                ckpt_every=5,  # batches 5 and 10: off the epoch ends (4, 8, 12), which are also the validations
                steps_per_batch=3,  # one AdamW step per follower (dpo_pairs=all, batch_size >= duels, no all-tied)
            ),
        ),
        rates=Rates(("followers.lr=0.5",), [[0.5]] * 3),
        learns={
            "dpo": _pool_learns("dpo"),
            "rpo": _pool_learns("dpo", loss_type="rpo"),  # RPO: DPO + the chosen's NLL
            "simpo": _pool_learns("dpo", loss_type="simpo"),  # no reference forward
            "grpo": _pool_learns("grpo"),
        },
    )
)
