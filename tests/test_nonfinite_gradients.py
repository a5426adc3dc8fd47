"""A NaN gradient never reaches the weights, the optimizer's moments or a checkpoint, in every family.

A finite loss can still give a NaN gradient (an fp16/bf16 overflow in the backward). Each test poisons the gradient
of one parameter per optimizer during one chosen batch (a tensor hook), and requires: the weights and every optimizer
state unchanged across that batch, the skip counted and logged (``train/nonfinite_skipped``), ``global_step`` not
advanced by it (so ``max_steps`` still counts applied updates), and the run going on to train. Tabular SMIDA has no
gradient: its exact update is poisoned instead. A checkpoint holding a NaN weight or moment is refused.
"""

import copy
import json
import math

import lightning as L
import pytest
import torch
from helpers.callback_helpers import make_trainer
from helpers.threads import one_torch_thread
from torch.utils.data import DataLoader

from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.scorers.utility import Utility

NAN = float("nan")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models on a shared CPU: one intra-op thread is faster than two spinning."""
    with one_torch_thread():
        yield


class PoisonGradients(L.Callback):
    """During batch ``at`` (counted from 0 over the whole fit), every gradient of the first parameter of each
    optimizer (or only of ``optimizers``) becomes NaN; records the state around that batch."""

    def __init__(self, at: int, every: bool = False, optimizers: list[int] | None = None):
        self.at, self.every, self.only = at, every, optimizers
        self.calls, self.handles, self.record = 0, [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        index, self.calls = self.calls, self.calls + 1
        if index != self.at and not (self.every and index >= self.at):
            return
        self.record = {
            "weights": _trainable(pl_module),
            "optimizers": [copy.deepcopy(o.state_dict()) for o in trainer.optimizers],
            "step": trainer.global_step,
            "skipped": pl_module.nonfinite_skipped,
        }
        for i, opt in enumerate(trainer.optimizers):
            if self.only is None or i in self.only:
                first = next(p for g in opt.param_groups for p in g["params"] if p.requires_grad)
                self.handles.append(first.register_hook(lambda g: torch.full_like(g, NAN)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self.handles:
            return
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.record.update(
            weights_after=_trainable(pl_module),
            optimizers_after=[copy.deepcopy(o.state_dict()) for o in trainer.optimizers],
            step_after=trainer.global_step,
            skipped_after=pl_module.nonfinite_skipped,
            logged=float(trainer.callback_metrics["train/nonfinite_skipped"]),
        )


def _trainable(module):
    return {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}


def _same(a, b) -> bool:
    """Nested equality with exact tensor comparison (a NaN is never equal to anything)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _trainer(tmp_path, callbacks, **kw):
    return make_trainer(tmp_path, callbacks, **{"max_epochs": None, "limit_val_batches": 0, **kw})


def _assert_poisoned_batch_changed_nothing(model, poison, before_fit):
    r = poison.record
    assert r is not None and "weights_after" in r, "the poisoned batch never ran"
    for name, value in r["weights"].items():
        assert torch.equal(r["weights_after"][name], value), f"{name} moved in the poisoned batch"
    assert _same(r["optimizers"], r["optimizers_after"]), "an optimizer state changed in the poisoned batch"
    assert r["step_after"] == r["step"], "the skipped step advanced global_step"
    assert r["skipped_after"] > r["skipped"] and r["logged"] == float(r["skipped_after"])
    after = _trainable(model)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(after[n], before_fit[n]) for n in after), "the good steps did not train"


# ------------------------------------------------------------------------------------------------ families
class Letters(Utility):
    def forward(self, prompts, leader, follower):
        return torch.tensor([len(set(y)) / 50.0 for y in follower], dtype=torch.float32)


def _prompts(**kw):
    from alignment_games.datamodules.prompts import PromptDataModule

    return PromptDataModule(num_prompts=24, batch_size=2, **kw)


def _preference(tiny_lm_dir, tmp_path, **kw):
    from alignment_games.datamodules.preference import PreferenceDataModule
    from alignment_games.modules.preference import PreferenceEnsemble

    model = PreferenceEnsemble(ModelConfig(tiny_lm_dir), backbone_task="causal_lm", num_members=2, **kw)
    return model, {
        "datamodule": PreferenceDataModule(num_prompts=24, responses_per_prompt=3, batch_size=8, max_length=64)
    }


def _sft(tiny_lm_dir, tmp_path, **kw):
    from alignment_games.datamodules.sft import ArithmeticSFTDataModule
    from alignment_games.modules.sft import CausalLMSFT

    tiny = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    model = CausalLMSFT(tiny_config=tiny, output_dir=str(tmp_path / "out"), max_length=64, **kw)
    return model, {"datamodule": ArithmeticSFTDataModule(num_prompts=40, batch_size=4)}


def _grpo(tiny_lm_dir, tmp_path, **kw):
    from alignment_games.modules.grpo import GRPO

    lm = ModelConfig(tiny_lm_dir, lora_r=4, lora_alpha=8)
    sampling = Sampling(max_new_tokens=6)
    model = pg = {"group_size": 2, "kl_coef": 0.1}
    model = GRPO(lm=lm, policy_gradient=pg, sampling=sampling, lr=5e-2, chat_template=False, **kw)
    # the answer reward of a random tiny policy is 0 everywhere (no advantage, no update); the length varies
    model.rewards = lambda inputs, completions, references, **_: torch.tensor([[len(c) / 10.0] for c in completions])
    return model, {"datamodule": _prompts()}


def _deep_smida(tiny_lm_dir, tmp_path, **kw):
    from helpers.deep_smida import tiny_deep_smida

    sampling = Sampling(temperature=0.6, max_new_tokens=6)
    model = tiny_deep_smida(tiny_lm_dir, Letters(), sampling=sampling, leader_lr=1e-2, follower_lr=1e-2, **kw)
    return model, {"datamodule": _prompts()}


def _nlhf(tiny_lm_dir, tmp_path, **kw):
    from alignment_games.modules.nlhf import NashMDPG

    model = NashMDPG(
        lm=ModelConfig(tiny_lm_dir, lora_r=4),
        preference=Letters(),  # a number in [0, 1] that varies with the opponent's reply
        samples_per_prompt=2,
        sampling=Sampling(temperature=0.6, max_new_tokens=6),
        lr=1e-2,
        **kw,
    )
    return model, {"datamodule": _prompts()}


def _slhf(tiny_lm_dir, tmp_path, **kw):
    from alignment_games.modules.slhf import SLHF

    model = SLHF(
        lm=ModelConfig(tiny_lm_dir, lora_r=4),
        preference=Letters(),
        samples_per_prompt=2,
        follower_samples=2,
        sampling=Sampling(temperature=0.6, max_new_tokens=6),
        leader_lr=1e-2,
        follower_lr=1e-2,
        **kw,
    )
    return model, {"datamodule": _prompts()}


def _debate(tiny_lm_dir, tmp_path, **kw):
    from alignment_games.modules.debate import DebateSelfPlay
    from alignment_games.modules.scorers.judges import ProgrammaticJudge

    model = DebateSelfPlay(
        lm=ModelConfig(tiny_lm_dir, lora_r=4, lora_alpha=8),
        protocol="debate_ab",
        policy_gradient={"group_size": 2},
        sampling=Sampling(temperature=0.6, max_new_tokens=6),
        reply_max_new_tokens=4,
        require_thinking=False,
        alice_prompt="{problem}",
        judge=ProgrammaticJudge(num_votes=8, seed=1),
        **kw,
    )
    rows = [("What is 4 + 4?", "8"), ("1 + 1?", "2")]
    collate = lambda items: {"prompt": [x[0] for x in items], "reference": [x[1] for x in items]}  # noqa: E731
    return model, {"train_dataloaders": DataLoader(rows, batch_size=2, collate_fn=collate)}


def _pool(tiny_lm_dir, tmp_path, **kw):
    from alignment_games.datamodules.pool import InstructionPoolDataModule
    from alignment_games.datamodules.prompts import PromptSource
    from alignment_games.modules.games.pool_followers import FollowerTraining
    from alignment_games.modules.pool import StackelbergPool
    from alignment_games.modules.scorers.peer_judges import PeerJudging

    path = tmp_path / "pool.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"{a}+{a + 1}=?", "answer": str(2 * a + 1)}) for a in range(8)))
    model = StackelbergPool(
        lm={"name_or_path": str(tiny_lm_dir), "lora_r": 4, "lora_alpha": 8},
        judging=PeerJudging(template="{prompt} {response}", mode="constrained", max_new_tokens=6),
        duels_per_iteration=3,
        num_iterations=3,
        sampling=Sampling(temperature=0.7, top_p=0.9, max_new_tokens=6),
        eval_max_new_tokens=6,
        followers=FollowerTraining(lr=1e-2, batch_size=4),
        **kw,
    )
    data = InstructionPoolDataModule(
        source=PromptSource(path=str(path), prompt_column="question", reference_column="answer"),
        val_fraction=0.25,
        batch_size=4,
        iterations_per_epoch=3,
    )
    return model, {"datamodule": data}


# family: (builder of the model and its data, trainer limit)
FAMILIES = {
    "PreferenceEnsemble": (_preference, {"max_steps": 3}),
    "CausalLMSFT": (_sft, {"max_steps": 3}),
    "GRPO": (_grpo, {"max_steps": 3}),
    "DeepSMIDA": (_deep_smida, {"max_steps": 6}),  # two optimizer steps per batch
    "NashMDPG": (_nlhf, {"max_steps": 3}),
    "SLHF": (_slhf, {"max_steps": 6}),  # two optimizer steps per batch
    "DebateSelfPlay": (_debate, {"max_steps": 3}),
    "StackelbergPool": (_pool, {"max_epochs": 1}),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_nan_gradient_is_skipped_and_changes_nothing(name, tiny_lm_dir, tmp_path):
    build, limit = FAMILIES[name]
    L.seed_everything(0)
    model, data = build(tiny_lm_dir, tmp_path)
    before = _trainable(model)
    poison = PoisonGradients(at=1)
    trainer = _trainer(tmp_path, [poison], **limit)
    with pytest.warns(UserWarning, match="gradients are NaN or inf; the update is skipped"):
        trainer.fit(model, **data)
    _assert_poisoned_batch_changed_nothing(model, poison, before)
    assert model.consecutive_nonfinite == 0  # the good step after it ended the streak
    if "max_steps" in limit:  # the skip did not shorten the run: max_steps applied updates, one batch more
        assert trainer.global_step == limit["max_steps"]
        # one optimizer step per optimizer and batch (deep-SMIDA, SLHF: the leader's and the follower's)
        assert poison.calls == limit["max_steps"] // len(trainer.optimizers) + 1


@pytest.mark.parametrize("name", ["CausalLMSFT", "DeepSMIDA"])
def test_nan_gradients_in_a_row_stop_the_run(name, tiny_lm_dir, tmp_path):
    """deep-SMIDA: only the leader's gradients are NaN; the follower's steps must not hide the streak."""
    build, _ = FAMILIES[name]
    L.seed_everything(0)
    model, data = build(tiny_lm_dir, tmp_path, max_consecutive_nonfinite=2)
    poison = PoisonGradients(at=1, every=True, optimizers=[0])
    with pytest.warns(UserWarning, match="update is skipped"):
        with pytest.raises(RuntimeError, match="2 consecutive steps had non-finite gradients"):
            _trainer(tmp_path, [poison], max_steps=20).fit(model, **data)
    assert model.nonfinite_skipped == 2 and poison.calls == 3


def test_tabular_smida_skips_a_nonfinite_iterate(tmp_path):
    from alignment_games.datamodules.steps import StepDataModule
    from alignment_games.modules.tabular_smida import TabularSMIDA

    model = TabularSMIDA(num_contexts=3, num_actions=4, max_consecutive_nonfinite=2)
    seen = {"batches": 0}

    class NaNStep:
        """The exact update, with the leader's new log-probabilities NaN."""

        def __init__(self, real):
            self.real, self.cost_base = real, real.cost_base

        def __call__(self, log_pi, log_omega):
            new_pi, new_omega = self.real(log_pi, log_omega)
            return new_pi * NAN, new_omega

    class PoisonIterate(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen["batches"] += 1
            if seen["batches"] == 2:
                pl_module._stepper = NaNStep(pl_module._make_stepper())
                seen["before"] = (pl_module.log_pi.clone(), pl_module.log_omega.clone(), trainer.global_step)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if seen["batches"] == 2:
                pl_module._stepper = pl_module._make_stepper()
                seen["after"] = (pl_module.log_pi.clone(), pl_module.log_omega.clone(), trainer.global_step)
                seen["logged"] = float(trainer.callback_metrics["train/nonfinite_skipped"])

    trainer = _trainer(tmp_path, [PoisonIterate()], max_steps=4)
    with pytest.warns(UserWarning, match="log-probabilities of the iterate are NaN or inf; the update is skipped"):
        trainer.fit(model, datamodule=StepDataModule(steps_per_epoch=10))
    (pi0, om0, step0), (pi1, om1, step1) = seen["before"], seen["after"]
    assert torch.equal(pi0, pi1) and torch.equal(om0, om1) and step0 == step1 == 1
    assert seen["logged"] == 1.0 and model.nonfinite_skipped == 1
    assert trainer.global_step == int(model.iteration) == 4  # four applied iterations, on five batches
    assert torch.isfinite(model.log_pi).all()


# ------------------------------------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize("name", ["PreferenceEnsemble", "GRPO"])
def test_a_checkpoint_with_a_nan_weight_or_moment_is_refused(name, tiny_lm_dir, tmp_path):
    build, _ = FAMILIES[name]
    L.seed_everything(0)
    model, data = build(tiny_lm_dir, tmp_path)
    trainer = _trainer(tmp_path, [], max_steps=1)
    trainer.fit(model, **data)
    name_, param = next((n, p) for n, p in model.named_parameters() if p.requires_grad)
    path = tmp_path / "bad.ckpt"
    good = param.detach().clone()
    with torch.no_grad():
        param.view(-1)[0] = NAN
    with pytest.raises(RuntimeError, match=rf"refusing to write a checkpoint .*state_dict\['{name_}'\]"):
        trainer.save_checkpoint(path)
    assert not path.exists()
    with torch.no_grad():
        param.copy_(good)
    state = trainer.optimizers[0].state[param]
    state["exp_avg_sq"].view(-1)[0] = math.inf
    with pytest.raises(
        RuntimeError, match=r"refusing to write a checkpoint .*optimizer_states\[0\]\.state\[\d+\]\['exp_avg_sq'\]"
    ):
        trainer.save_checkpoint(path)
    assert not path.exists()
    state["exp_avg_sq"].view(-1)[0] = 0.0
    trainer.save_checkpoint(path)  # finite again: written
    assert path.exists()


def test_a_tabular_checkpoint_with_a_nan_iterate_is_refused(tmp_path):
    from alignment_games.datamodules.steps import StepDataModule
    from alignment_games.modules.tabular_smida import TabularSMIDA

    model = TabularSMIDA(num_contexts=3, num_actions=4)
    trainer = _trainer(tmp_path, [], max_steps=1)
    trainer.fit(model, datamodule=StepDataModule(steps_per_epoch=2))
    model.log_omega[0, 0, 0] = NAN
    with pytest.raises(RuntimeError, match=r"refusing to write a checkpoint .*\['log_omega'\]"):
        trainer.save_checkpoint(tmp_path / "bad.ckpt")
    assert not (tmp_path / "bad.ckpt").exists()
