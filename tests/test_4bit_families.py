"""A 4-bit (bitsandbytes NF4) frozen base trains one step of every family that loads a causal LM, on CPU.

Each run checks what QLoRA promises: the base's projections are ``Linear4bit``, their packed NF4 bytes, their
quantisation constants and every other frozen weight are unchanged by the step (under ``bf16-mixed`` the frozen
floats are cast to bf16 once at setup, then fixed), the trainable parameters (adapters, heads) are fp32 and moved,
and the logged losses are finite. GRPO also runs with gradient checkpointing and under ``bf16-mixed``. Cost: about
10 s of test calls on 2 busy cores."""

from __future__ import annotations

import bitsandbytes as bnb  # the quantization extra, also in the dev extra: these tests run wherever the suite does
import lightning as L
import pytest
import torch
from helpers.callback_helpers import make_trainer
from helpers.four_bit import four_bit_lm
from helpers.recipes import RECIPES
from helpers.threads import one_torch_thread


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with one_torch_thread():
        yield


#: every family that loads a causal LM, in each of its recipe's 4-bit variants: test id -> (recipe, variant)
FAMILIES = {
    f"{name}-{suffix}" if suffix else name: (recipe, variant)
    for name, recipe in RECIPES.items()
    if recipe.build is not None
    for suffix, variant in recipe.four_bit
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
    recipe, variant = FAMILIES[name]
    variant = dict(variant)
    lm, limit = four_bit_lm(tiny_lm_dir, **variant.pop("lm", {})), variant.pop("trainer", {})
    L.seed_everything(0)
    model, data = recipe.make(lm, tmp_path, "4bit", **variant)
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

    # one batch: one step of every optimizer
    trainer = make_trainer(tmp_path, [Losses()], max_epochs=1, limit_train_batches=1, limit_val_batches=0, **limit)
    trainer.fit(model, **data)
    assert trainer.global_step >= 1
    after = _frozen_state(model)
    assert after.keys() == frozen.keys()
    for key, value in frozen.items():  # under bf16-mixed the frozen floats are held in bf16: cast once, then fixed
        assert torch.equal(after[key], value.to(after[key].dtype)), f"the frozen {key} changed"
    moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, trainable[n])]
    assert moved, "no trainable parameter moved"
    assert losses and all(torch.isfinite(torch.tensor(losses))), losses
