"""A NaN gradient never reaches the weights, the optimizer's moments or a checkpoint, in every family.

A finite loss can still give a NaN gradient (an fp16/bf16 overflow in the backward). Each test poisons the gradient
of one parameter per optimizer during one chosen batch (a tensor hook), and requires: the weights and every optimizer
state unchanged across that batch, the skip counted and logged (``train/nonfinite_skipped``), ``global_step`` not
advanced by it (so ``max_steps`` still counts applied updates), and the run going on to train. Tabular SMIDA has no
gradient: its exact update is poisoned instead. A checkpoint holding a NaN weight or moment is refused.
"""

import copy
import math

import lightning as L
import pytest
import torch
from helpers.callback_helpers import make_trainer
from helpers.recipes import RECIPES, tiny_lm
from helpers.threads import one_torch_thread

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
#: every family with gradients, built tiny by its recipe
FAMILIES = {name: recipe for name, recipe in RECIPES.items() if recipe.build is not None}


def _build(name, tiny_lm_dir, tmp_path, **kw):
    L.seed_everything(0)
    return FAMILIES[name].make(tiny_lm(tiny_lm_dir), tmp_path, **kw)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_nan_gradient_is_skipped_and_changes_nothing(name, tiny_lm_dir, tmp_path):
    limit = FAMILIES[name].steps
    model, data = _build(name, tiny_lm_dir, tmp_path)
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
    model, data = _build(name, tiny_lm_dir, tmp_path, max_consecutive_nonfinite=2)
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
    model, data = _build(name, tiny_lm_dir, tmp_path)
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
