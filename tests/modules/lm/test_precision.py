"""Precision per device: the dtype ``auto`` loads, fp32 adapters and optimizer moments over a bf16 base, TF32 on CUDA
only, and frozen weights cast once (not at every decoded token) under Lightning's ``bf16-mixed``."""

from types import SimpleNamespace

import pytest
import torch
from helpers.callback_helpers import make_trainer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch.utils._python_dispatch import TorchDispatchMode

from alignment_games.modules.lm import precision
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.precision import autocast_dtype, resolve_dtype, set_tf32
from alignment_games.modules.lm.sampling import Sampling


@pytest.mark.parametrize(
    "dtype, frozen, bf16_device, expected",
    [
        ("auto", True, True, "bfloat16"),  # the frozen base on a bf16 GPU
        ("auto", False, True, "float32"),  # trainable weights: fp32 (and so their Adam moments)
        ("auto", True, False, "float32"),  # CPU: fp32, results unchanged
        ("auto", False, False, "float32"),
        ("float16", True, True, "float16"),  # an explicit dtype is kept everywhere
        ("bfloat16", False, False, "bfloat16"),
    ],
)
def test_auto_dtype_per_device(dtype, frozen, bf16_device, expected):
    assert resolve_dtype(dtype, frozen, bf16_device) == expected


def test_the_default_dtype_is_auto_and_bad_decode_options_name_their_field():
    assert ModelConfig("a/b").dtype == "auto" and ModelConfig("a/b").tf32 is True
    with pytest.raises(ValueError, match=r"lm\.dtype: 'float8' is not one of \['auto', "):
        ModelConfig("a/b", dtype="float8")
    with pytest.raises(ValueError, match=r"lm\.decode: .* got 'fast'"):
        ModelConfig("a/b", decode="fast")
    with pytest.raises(ValueError, match=r"lm\.compile_decode: .*lm\.decode is 'grouped'"):
        ModelConfig("a/b", decode="grouped", compile_decode=True)


def test_tf32_is_set_on_cuda_only(monkeypatch):
    before = torch.get_float32_matmul_precision()
    try:
        assert set_tf32(True) is (torch.cuda.is_available())
        if not torch.cuda.is_available():
            assert torch.get_float32_matmul_precision() == before  # CPU: untouched
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert set_tf32(True) is True and torch.get_float32_matmul_precision() == "high"
        assert set_tf32(False) is True and torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)


def test_on_a_bf16_gpu_the_base_is_bf16_the_adapters_and_adam_moments_fp32(tiny_lm_dir, monkeypatch):
    """``dtype: auto`` as a bf16 GPU resolves it (the device check patched; everything runs on CPU): a step of AdamW
    moves the adapter only, with fp32 moments, and leaves every bf16 base weight as it was."""
    monkeypatch.setattr(precision, "cuda_bf16_available", lambda: True)
    bank = PolicyBank(ModelConfig(tiny_lm_dir, lora_r=4, lora_alpha=8), players=["alice", "bob"])
    adapters = {n: p for n, p in bank.model.named_parameters() if ".alice." in n or ".bob." in n}
    base = {n: p for n, p in bank.model.named_parameters() if n not in adapters}
    assert adapters and base
    assert {p.dtype for p in base.values()} == {torch.bfloat16}
    assert {p.dtype for p in adapters.values()} == {torch.float32}  # the second adapter too (peft casts the first)
    before = {n: p.detach().clone() for n, p in bank.model.named_parameters()}
    opt = torch.optim.AdamW(bank.player_parameters("alice"), lr=1e-2)
    torch.manual_seed(0)
    rollout = bank.generate("alice", ["1+1=", "two plus two"], 2, Sampling(0.6, max_new_tokens=4))
    bank.logprobs("alice", rollout).sum().backward()
    opt.step()
    moments = [s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert moments and {m.dtype for m in moments} == {torch.float32}
    changed = {n for n, p in bank.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".alice." in n for n in changed)  # alice's adapter moved, nothing else


def test_separate_players_auto_keep_trainable_copies_fp32_and_the_reference_bf16(tiny_lm_dir, monkeypatch):
    monkeypatch.setattr(precision, "cuda_bf16_available", lambda: True)
    bank = PolicyBank(ModelConfig(tiny_lm_dir, players="separate"), players=["alice"])
    assert {p.dtype for p in bank.models["alice"].parameters()} == {torch.float32}
    assert {p.dtype for p in bank.reference.parameters()} == {torch.bfloat16}


class _WeightCasts(TorchDispatchMode):
    """Counts fp32 → bf16 copies of 2-D tensors shaped like a frozen weight (activations here are 3-D)."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.count = shapes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default:
            x = args[0]
            if x.dim() == 2 and x.dtype == torch.float32 and out.dtype == torch.bfloat16 and x.shape in self.shapes:
                self.count += 1
        return out


def _strategy(plugin):
    return SimpleNamespace(precision_plugin=plugin)


def _casts_over_decode(bank, steps):
    shapes = {p.shape for n, p in bank.model.named_parameters() if p.dim() == 2 and not p.requires_grad}
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16), _WeightCasts(shapes) as spy:
        bank.generate("alice", ["3 + 4 =", "9*9"], 2, Sampling(0.6, 1.0, steps, steps))
    return spy.count


def test_bf16_mixed_casts_the_frozen_base_once_not_at_every_decoded_token(tiny_lm_dir):
    """Lightning's bf16-mixed autocast recasts frozen fp32 weights in every forward (it caches casts of trainable
    leaves only): 15 weight casts per decoded token of the tiny Qwen2 (7 linears × 2 layers + the tied head). The bank
    casts its frozen weights to bf16 once when it meets that plugin, and then no decode step casts a weight."""
    # the model's own forward at every token (LeanDecoder's steps are counted below)
    bank = PolicyBank(ModelConfig(tiny_lm_dir, lora_r=4, lora_alpha=8, decode="grouped_forward"), players=["alice"])
    layers = bank.model.get_base_model().config.num_hidden_layers
    per_forward = 7 * layers + 1
    # before: every forward (the prompt prefill, then one per token) casts every weight again
    assert _casts_over_decode(bank, 3) == per_forward * (1 + 3)
    assert _casts_over_decode(bank, 6) == per_forward * (1 + 6)
    bank.use_strategy(_strategy(Precision()))  # 32-true: nothing is cast
    assert {p.dtype for p in bank.model.parameters()} == {torch.float32}
    bank.use_strategy(_strategy(MixedPrecision("bf16-mixed", "cpu")))
    frozen = [p for n, p in bank.model.named_parameters() if ".alice." not in n]
    assert {p.dtype for p in frozen} == {torch.bfloat16}
    assert {p.dtype for p in bank.player_parameters("alice")} == {torch.float32} and all(
        p.requires_grad for p in bank.player_parameters("alice")
    )
    assert _casts_over_decode(bank, 6) == 0
    lean = PolicyBank(ModelConfig(tiny_lm_dir, lora_r=4, lora_alpha=8, decode="grouped"), players=["alice"])
    lean.use_strategy(_strategy(MixedPrecision("bf16-mixed", "cpu")))
    assert _casts_over_decode(lean, 6) == 0


def test_only_the_plain_bf16_autocast_plugin_asks_for_a_cast():
    assert autocast_dtype(MixedPrecision("bf16-mixed", "cpu")) is torch.bfloat16
    assert autocast_dtype(MixedPrecision("16-mixed", "cpu")) is None  # fp16 weights would carry an fp16 residual
    assert autocast_dtype(Precision()) is None and autocast_dtype(None) is None


def _sft(lm):
    from alignment_games.modules.sft import CausalLMSFT

    return CausalLMSFT(lm=lm, lora=True), "setup", "model", ".default."


def _preference(lm):
    from alignment_games.modules.preference import PreferenceEnsemble

    module = PreferenceEnsemble(lm=lm, backbone_task="causal_lm", sharing="lora", num_members=2, cache_features=False)
    return module, "configure_model", "backbone", ".member_"


@pytest.mark.parametrize("build", [_sft, _preference], ids=["sft", "preference"])
def test_sft_and_preference_under_bf16_mixed_hold_the_frozen_base_in_bf16_and_adapters_in_fp32(build, tiny_lm_dir):
    module, hook, attr, adapter = build(ModelConfig(tiny_lm_dir))
    module._trainer = SimpleNamespace(strategy=_strategy(MixedPrecision("bf16-mixed", "cpu")))
    getattr(module, hook)(*(["fit"] if hook == "setup" else []))
    model = getattr(module, attr)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(adapter in n for n in trainable)
    for n, p in model.named_parameters():
        assert p.dtype == (torch.float32 if n in trainable else torch.bfloat16), n


def test_grpo_trains_under_bf16_mixed_with_a_bf16_base_and_fp32_adapters(tiny_lm_dir, tmp_path):
    """Lightning's bf16-mixed on CPU, end to end: setup casts the frozen base to bf16 (the values autocast would use,
    never changed by training), the adapter stays fp32 and moves, and AdamW's moments are fp32."""
    import lightning as L

    from alignment_games.datamodules.prompts import PromptDataModule
    from alignment_games.modules.grpo import GRPO
    from alignment_games.modules.lm.models import build_tiny_reward_model
    from alignment_games.modules.lm.sampling import Sampling

    L.seed_everything(0)
    model = GRPO(
        lm=ModelConfig(tiny_lm_dir, lora_r=4, lora_alpha=8),
        policy_gradient={"group_size": 2, "kl_coef": 0.04},
        sampling=Sampling(temperature=1.0, max_new_tokens=4),
        lr=5e-2,
        reward_models=[build_tiny_reward_model(tmp_path / "rm", seed=1)],  # rewards that differ within a group
        answer_reward=False,
        chat_template=False,
    )
    before = {n: p.detach().clone() for n, p in model.players.named_parameters()}
    trainer = make_trainer(tmp_path, [], max_steps=2, max_epochs=None, precision="bf16-mixed", limit_val_batches=0)
    trainer.fit(model, PromptDataModule(num_prompts=24, batch_size=2))
    for n, p in model.players.named_parameters():
        if ".policy." in n:
            assert p.dtype == torch.float32, n
        else:
            assert p.dtype == torch.bfloat16 and torch.equal(p, before[n].to(torch.bfloat16)), n
    assert any(not torch.equal(p, before[n]) for n, p in model.players.named_parameters() if "lora_B" in n)
    state = trainer.optimizers[0].state
    assert state and {s[k].dtype for s in state.values() for k in ("exp_avg", "exp_avg_sq")} == {torch.float32}
