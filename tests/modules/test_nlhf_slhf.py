"""NLHF (Nash-MD-PG) and SLHF families with tiny LM players: who learns, the mixture opponent, validation, refusals."""

import json
import os

import lightning as L
import pytest
import torch

from modules.lm.mixture import generate_mixture
from modules.lm.model_config import ModelConfig
from modules.lm.sampling import Sampling
from modules.nlhf import NashMDPG
from modules.scorers.oracle import ProgrammaticOracle
from modules.scorers.utility import Utility
from modules.slhf import SLHF


class LengthPreference(Utility):
    """P(first ≻ second) = sigmoid of the length difference / 4: a real preference, leader-first."""

    def forward(self, prompts, first, second):
        d = torch.tensor([len(a) - len(b) for a, b in zip(first, second)], dtype=torch.float32)
        return torch.sigmoid(d / 4)


class BrokenPreference(Utility):
    def forward(self, prompts, first, second):
        return torch.full((len(prompts),), 1.5)


def _lm(tiny_lm_dir):
    return ModelConfig(tiny_lm_dir, lora_r=4)


def _trainer(tmp_path, steps, val=0):
    return L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=val,
        val_check_interval=steps if val else None,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )


def _dm():
    from datamodules.prompts import PromptDataModule

    return PromptDataModule(num_prompts=24, batch_size=2)


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_mixture_sampler_follows_beta(tiny_lm_dir):
    """β = 0 is the policy's and β = 1 the reference's greedy decode (temperature → 0), with a policy that differs."""
    from modules.lm.policy_bank import PolicyBank

    torch.manual_seed(0)
    bank = PolicyBank(_lm(tiny_lm_dir), players=("policy",))
    with torch.no_grad():
        for p in bank.player_parameters("policy"):
            p.add_(torch.randn_like(p))  # LoRA B starts at zero: make the policy differ from the reference
    prompts = ["What is 2 + 3?", "Sam has 4 cards and finds 5 more."]
    greedy = {w: bank.generate(w, prompts, 1, max_new_tokens=8, do_sample=False) for w in ("policy", None)}
    assert greedy["policy"].texts != greedy[None].texts
    for beta, who in ((0.0, "policy"), (1.0, None)):
        out = generate_mixture(bank, "policy", prompts, 1, beta, temperature=1e-4, max_new_tokens=8)
        assert out.texts == greedy[who].texts
        assert out.completion_mask.shape == greedy[who].completion_mask.shape
        assert torch.equal(out.sequences, greedy[who].sequences)
    with pytest.raises(ValueError, match="beta"):
        generate_mixture(bank, "policy", prompts, 1, 1.5)


def test_nlhf_trains_the_policy_only_and_validates_against_the_reference(tiny_lm_dir, tmp_path):
    L.seed_everything(0)
    model = NashMDPG(
        lm=_lm(tiny_lm_dir),
        preference=LengthPreference(),
        lr=1e-2,
        tau=0.1,
        beta=0.5,
        sampling=Sampling(temperature=0.6, max_new_tokens=8),
        oracle=ProgrammaticOracle(num_queries=2),
    )
    before = _snapshot(model)
    trainer = _trainer(tmp_path, steps=2, val=2)
    trainer.fit(model, _dm())
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".policy." in n for n in changed)  # the base (the reference) and P0 stay frozen
    assert trainer.global_step == 2
    saved = json.loads(open(os.path.join(tmp_path, "baseline_eval.json")).read())
    assert (
        saved["player"] == "policy" and saved["p0"]["n_prompts"] == 4 and saved["oracle"]["n_prompts"] == 4
    )  # 2 batches of 2
    lo, hi = saved["p0"]["mean_ci"]
    assert 0 <= lo <= saved["p0"]["mean"] <= hi <= 1


def test_nlhf_refuses_bad_arguments_and_non_probabilities(tiny_lm_dir, tmp_path):
    with pytest.raises(ValueError, match="beta"):
        NashMDPG(lm=_lm(tiny_lm_dir), preference=LengthPreference(), beta=1.5)
    with pytest.raises(ValueError, match="tau"):
        NashMDPG(lm=_lm(tiny_lm_dir), preference=LengthPreference(), tau=0.0)
    model = NashMDPG(lm=_lm(tiny_lm_dir), preference=BrokenPreference(), sampling=Sampling(max_new_tokens=4))
    with pytest.raises(ValueError, match="preference must be probabilities in \\[0, 1\\]; entry 0 is 1.5"):
        _trainer(tmp_path, steps=1).fit(model, _dm())


def test_slhf_trains_both_players_on_p0(tiny_lm_dir, tmp_path):
    L.seed_everything(0)
    model = SLHF(
        lm=_lm(tiny_lm_dir),
        preference=LengthPreference(),
        leader_lr=1e-2,
        follower_lr=1e-2,
        follower_samples=2,
        sampling=Sampling(temperature=0.6, max_new_tokens=8),
    )
    seen = []
    score = model.preference.forward

    def spy(prompts, first, second):
        out = score(prompts, first, second)
        seen.append(out)
        return out

    model.preference.forward = spy
    before = _snapshot(model)
    _trainer(tmp_path, steps=4).fit(model, _dm())  # two optimizer steps a batch
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert any(".leader." in n for n in changed) and any(".follower." in n for n in changed)
    assert all(".leader." in n or ".follower." in n for n in changed)
    assert len(seen) == 2 and seen[0].numel() == 2 * 2 * 2  # B·D·M triplets scored by P0 per batch
    with pytest.raises(NotImplementedError, match="round_robin"):
        model.predict_step({"prompt": ["x"], "reference": [None]}, 0)
