"""A 4-bit (bitsandbytes NF4) frozen base trains one step of every family that loads a causal LM, on CPU.

Each run checks what QLoRA promises: the base's projections are ``Linear4bit``, their packed NF4 bytes, their
quantisation constants and every other frozen weight are unchanged by the step (under ``bf16-mixed`` the frozen
floats are cast to bf16 once at setup, then fixed), the trainable parameters (adapters, heads) are fp32 and moved,
and the logged losses are finite. GRPO also runs with gradient checkpointing and under ``bf16-mixed``. Cost: about
10 s of test calls on 2 busy cores."""

from __future__ import annotations

import json

import bitsandbytes as bnb  # the quantization extra, also in the dev extra: these tests run wherever the suite does
import lightning as L
import pytest
import torch
from helpers.callback_helpers import make_trainer
from helpers.four_bit import four_bit_lm
from helpers.threads import one_torch_thread

from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.scorers.utility import Utility


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with one_torch_thread():
        yield


class Letters(Utility):
    """A score in [0, 1] that varies with the reply (distinct characters)."""

    def forward(self, prompts, leader, follower):
        return torch.tensor([len(set(y)) / 50.0 for y in follower], dtype=torch.float32)


def _prompts():
    from alignment_games.datamodules.prompts import PromptDataModule

    return {"datamodule": PromptDataModule(num_prompts=8, batch_size=2)}


def _grpo(path, tmp_path, **lm):
    from alignment_games.modules.grpo import GRPO

    model = GRPO(
        lm=four_bit_lm(path, **lm),
        policy_gradient={"group_size": 2, "kl_coef": 0.1},
        sampling=Sampling(max_new_tokens=4),
    )
    model.rewards = lambda inputs, completions, references, **_: torch.tensor([[len(c) / 10.0] for c in completions])
    return model, _prompts()


def _deep_smida(path, tmp_path):
    from helpers.deep_smida import tiny_deep_smida

    return tiny_deep_smida(path, Letters(), lm=four_bit_lm(path), sampling=Sampling(max_new_tokens=4)), _prompts()


def _nlhf(path, tmp_path):
    from alignment_games.modules.nlhf import NashMDPG

    model = NashMDPG(
        lm=four_bit_lm(path), preference=Letters(), samples_per_prompt=2, sampling=Sampling(max_new_tokens=4)
    )
    return model, _prompts()


def _slhf(path, tmp_path):
    from alignment_games.modules.slhf import SLHF

    model = SLHF(
        lm=four_bit_lm(path),
        preference=Letters(),
        samples_per_prompt=2,
        follower_samples=2,
        sampling=Sampling(max_new_tokens=4),
    )
    return model, _prompts()


def _debate(path, tmp_path):
    from alignment_games.datamodules.debate import DebateDataModule
    from alignment_games.modules.debate import DebateSelfPlay
    from alignment_games.modules.scorers.judges import ProgrammaticJudge

    model = DebateSelfPlay(
        lm=four_bit_lm(path),
        protocol="debate_ab",
        policy_gradient={"group_size": 2},
        sampling=Sampling(max_new_tokens=4),
        reply_max_new_tokens=4,
        require_thinking=False,
        alice_prompt="{problem}",
        judge=ProgrammaticJudge(num_votes=4, seed=1),
    )
    return model, {"datamodule": DebateDataModule(problems="single_step", num_prompts=8, batch_size=2)}


def _pool(path, tmp_path):
    from alignment_games.datamodules.pool import InstructionPoolDataModule
    from alignment_games.datamodules.prompts import PromptSource
    from alignment_games.modules.games.pool_followers import FollowerTraining
    from alignment_games.modules.pool import StackelbergPool
    from alignment_games.modules.scorers.peer_judges import PeerJudging

    data = tmp_path / "pool.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"{a}+{a + 1}=?", "answer": str(2 * a + 1)}) for a in range(8)))
    model = StackelbergPool(
        lm=four_bit_lm(path),
        judging=PeerJudging(template="{prompt} {response}", mode="constrained", max_new_tokens=4),
        duels_per_iteration=2,
        num_iterations=1,
        sampling=Sampling(max_new_tokens=4),
        eval_max_new_tokens=4,
        followers=FollowerTraining(lr=1e-2, batch_size=2),
    )
    source = PromptSource(path=str(data), prompt_column="question", reference_column="answer")
    dm = InstructionPoolDataModule(source=source, val_fraction=0.25, batch_size=2, iterations_per_epoch=1)
    return model, {"datamodule": dm}


def _preference(sharing):
    def build(path, tmp_path):
        from alignment_games.datamodules.preference import PreferenceDataModule
        from alignment_games.modules.preference import PreferenceEnsemble

        model = PreferenceEnsemble(
            four_bit_lm(path), backbone_task="causal_lm", sharing=sharing, num_members=2, cache_features=False
        )
        dm = PreferenceDataModule(num_prompts=8, responses_per_prompt=2, batch_size=4, max_length=32)
        return model, {"datamodule": dm}

    return build


def _sft(path, tmp_path):
    from alignment_games.datamodules.sft import ArithmeticSFTDataModule
    from alignment_games.modules.sft import CausalLMSFT

    model = CausalLMSFT(lm=four_bit_lm(path), lora=True, output_dir=str(tmp_path / "out"), max_length=32)
    return model, {"datamodule": ArithmeticSFTDataModule(num_prompts=8, batch_size=2)}


# family: (builder of the model and its data, trainer limit: one step of every optimizer)
FAMILIES = {
    "GRPO": (_grpo, {"max_steps": 1}),
    "GRPO-checkpointing": (lambda *a: _grpo(*a, gradient_checkpointing=True), {"max_steps": 1}),
    "GRPO-bf16-mixed": (_grpo, {"max_steps": 1, "precision": "bf16-mixed"}),
    "DeepSMIDA": (_deep_smida, {"max_steps": 2}),  # the leader's and the follower's step
    "NashMDPG": (_nlhf, {"max_steps": 1}),
    "SLHF": (_slhf, {"max_steps": 2}),
    "DebateSelfPlay": (_debate, {"max_steps": 1}),
    "StackelbergPool": (_pool, {"max_epochs": 1}),
    "PreferenceEnsemble-lora": (_preference("lora"), {"max_steps": 1}),
    "PreferenceEnsemble-frozen": (_preference("frozen"), {"max_steps": 1}),
    "CausalLMSFT": (_sft, {"max_steps": 1}),
}


def _frozen_state(model) -> dict[str, torch.Tensor]:
    """Every frozen tensor of ``model``: parameters, each ``Linear4bit``'s packed bytes and quantisation constants."""
    state = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    for name, m in model.named_modules():
        if isinstance(m, bnb.nn.Linear4bit):
            qs = m.weight.quant_state
            state[f"{name}.absmax"] = qs.absmax.detach().clone()
            state[f"{name}.code"] = qs.code.detach().clone()
    return state


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_4bit_base_trains_one_step(name, tiny_lm_dir, tmp_path):
    build, limit = FAMILIES[name]
    L.seed_everything(0)
    model, data = build(tiny_lm_dir, tmp_path)
    quantised = [n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert quantised, "no Linear4bit layer in the model"
    packed = [n for n, p in model.named_parameters() if isinstance(p, bnb.nn.Params4bit)]
    assert packed and all(p.dtype == torch.uint8 for p in model.parameters() if isinstance(p, bnb.nn.Params4bit))
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(p.dtype == torch.float32 for p in trainable.values())
    frozen = _frozen_state(model)
    losses = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.extend(float(v) for k, v in trainer.callback_metrics.items() if "loss" in k)

    trainer = make_trainer(tmp_path, [Losses()], **{"max_epochs": None, "limit_val_batches": 0, **limit})
    trainer.fit(model, **data)
    assert trainer.global_step >= 1
    after = _frozen_state(model)
    assert after.keys() == frozen.keys()
    for key, value in frozen.items():  # under bf16-mixed the frozen floats are held in bf16: cast once, then fixed
        assert torch.equal(after[key], value.to(after[key].dtype)), f"the frozen {key} changed"
    moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, trainable[n])]
    assert moved, "no trainable parameter moved"
    assert losses and all(torch.isfinite(torch.tensor(losses))), losses
