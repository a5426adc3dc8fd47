import lightning as L
import pytest

from alignment_games.datamodules.sft import ArithmeticSFTDataModule
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.sft import CausalLMSFT


def _trainer(tmp_path, **kwargs):
    return L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        **kwargs,
    )


def test_cosine_schedule_reaches_its_floor_at_max_steps(tiny_lm_dir, tmp_path):
    model = CausalLMSFT(
        lm=ModelConfig(tiny_lm_dir), output_dir=str(tmp_path / "out"), max_length=96, lr=1e-3,
        warmup_steps=2, cosine_decay=True, min_lr_ratio=0.1,
    )  # fmt: skip
    seen = []
    trainer = _trainer(tmp_path, max_steps=4, callbacks=[_LrSpy(seen)])
    trainer.fit(model, ArithmeticSFTDataModule(num_prompts=24, batch_size=4))
    # lr used at steps 0..3: warmup 1/2, 2/2, then cosine over 2 steps: 1.0, (1 + 0.1) / 2 = 0.55; after: 0.1
    assert seen == pytest.approx([5e-4, 1e-3, 1e-3, 5.5e-4])
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-4)


def test_cosine_schedule_needs_max_steps(tiny_lm_dir, tmp_path):
    model = CausalLMSFT(
        lm=ModelConfig(tiny_lm_dir), output_dir=str(tmp_path / "out"), warmup_steps=2, cosine_decay=True
    )
    with pytest.raises(ValueError, match="cosine_decay needs trainer.max_steps"):
        _trainer(tmp_path, max_epochs=1).fit(model, ArithmeticSFTDataModule(num_prompts=24, batch_size=4))
    with pytest.raises(ValueError, match="min_lr_ratio"):
        CausalLMSFT(lm=ModelConfig(tiny_lm_dir), min_lr_ratio=1.5)


class _LrSpy(L.Callback):
    """The learning rate of each optimizer step, read before the step."""

    def __init__(self, seen: list[float]) -> None:
        self.seen = seen

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.seen.append(optimizer.param_groups[0]["lr"])
