"""NLHF (Nash-MD-PG) and SLHF families with tiny LM players: who learns, the mixture opponent, validation, refusals."""

import json
import os

import lightning as L
import pytest
import torch
from helpers.callback_helpers import make_trainer
from helpers.provenance import check_provenance

from alignment_games.modules.lm.mixture import generate_mixture
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.nlhf import NashMDPG
from alignment_games.modules.scorers.oracle import ProgrammaticOracle
from alignment_games.modules.scorers.utility import Utility
from alignment_games.modules.slhf import SLHF


class LengthPreference(Utility):
    """P(first ≻ second) = sigmoid of the length difference / 4: a real preference, leader-first."""

    def forward(self, prompts, first, second):
        d = torch.tensor([len(a) - len(b) for a, b in zip(first, second)], dtype=torch.float32)
        return torch.sigmoid(d / 4)


class RecordingLengthPreference(LengthPreference):
    """:class:`LengthPreference` that keeps what it says while ``recording`` (``validation``: one tensor per call)."""

    def __init__(self):
        super().__init__()
        self.validation, self.recording = [], False

    def forward(self, prompts, first, second):
        out = super().forward(prompts, first, second)
        if self.recording:
            self.validation.append(out.detach().clone())
        return out


class RecordValidation(L.Callback):
    """Switches the model's :class:`RecordingLengthPreference` on for the validation epochs."""

    def on_validation_epoch_start(self, trainer, pl_module):
        pl_module.preference.recording = True

    def on_validation_epoch_end(self, trainer, pl_module):
        pl_module.preference.recording = False


class BrokenPreference(Utility):
    def forward(self, prompts, first, second):
        return torch.full((len(prompts),), 1.5)


def _lm(tiny_lm_dir):
    return ModelConfig(tiny_lm_dir, lora_r=4)


def _trainer(tmp_path, steps, val=0, callbacks=()):
    return make_trainer(
        tmp_path,
        list(callbacks),
        max_steps=steps,
        max_epochs=None,
        limit_val_batches=val,
        val_check_interval=steps if val else None,
    )


def _dm():
    from alignment_games.datamodules.prompts import PromptDataModule

    return PromptDataModule(num_prompts=24, batch_size=2)


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_mixture_sampler_follows_beta(tiny_lm_dir):
    """β = 0 is the policy's and β = 1 the reference's greedy decode (temperature → 0), with a policy that differs;
    β = 0.3 is the greedy decode of the mixed logits, computed here without the sampler."""
    from alignment_games.modules.lm.policy_bank import PolicyBank

    torch.manual_seed(0)
    bank = PolicyBank(_lm(tiny_lm_dir), players=("policy",))
    with torch.no_grad():
        for p in bank.player_parameters("policy"):
            p.add_(torch.randn_like(p))  # LoRA B starts at zero: make the policy differ from the reference
    prompts = ["What is 2 + 3?", "Sam has 4 cards and finds 5 more."]
    greedy = {w: bank.generate(w, prompts, 1, Sampling(max_new_tokens=8), greedy=True) for w in ("policy", None)}
    assert greedy["policy"].texts != greedy[None].texts
    for beta, who in ((0.0, "policy"), (1.0, None)):
        out = generate_mixture(bank, "policy", prompts, 1, beta, Sampling(1e-4, max_new_tokens=8))
        assert out.texts == greedy[who].texts
        assert out.completion_mask.shape == greedy[who].completion_mask.shape
        assert torch.equal(out.sequences, greedy[who].sequences)
    # β = 0.3: as temperature → 0 the mixture's token is argmax((1 − β) logits_policy + β logits_ref) (the tempered
    # log-partition terms are constant per step); decoded here by a plain loop, one prompt at a time, no KV cache
    beta = 0.3
    out = generate_mixture(bank, "policy", prompts, 1, beta, Sampling(1e-4, max_new_tokens=8))
    eos = bank.tokenizer.eos_token_id
    for row, prompt in enumerate(prompts):
        ids = bank.encode_prompts([prompt])["input_ids"]
        tokens = []
        for _ in range(8):
            logits = {}
            for who in ("policy", None):
                with torch.no_grad(), bank.using(who) as model:
                    logits[who] = torch.log_softmax(model(input_ids=ids).logits[0, -1].double(), dim=-1)
            nxt = int(torch.argmax((1 - beta) * logits["policy"] + beta * logits[None]))
            tokens.append(nxt)
            if nxt == eos:
                break
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        got = out.sequences[row, out.prompt_width :][out.completion_mask[row].bool()].tolist()
        assert got == tokens, f"prompt {row}"
    assert out.texts != greedy["policy"].texts and out.texts != greedy[None].texts  # a mixture, neither model's own
    with pytest.raises(ValueError, match="beta"):
        generate_mixture(bank, "policy", prompts, 1, 1.5, Sampling())


def test_nlhf_trains_the_policy_only_and_validates_against_the_reference(tiny_lm_dir, tmp_path):
    L.seed_everything(0)
    model = NashMDPG(
        lm=_lm(tiny_lm_dir),
        preference=RecordingLengthPreference(),
        lr=1e-2,
        tau=0.1,
        beta=0.5,
        sampling=Sampling(temperature=0.6, max_new_tokens=8),
        oracle=ProgrammaticOracle(num_queries=2),
    )
    before = _snapshot(model)
    trainer = _trainer(tmp_path, steps=2, val=2, callbacks=[RecordValidation()])
    trainer.fit(model, _dm())
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".policy." in n for n in changed)  # the base (the reference) and P0 stay frozen
    assert trainer.global_step == 2
    saved = json.loads(open(os.path.join(tmp_path, "baseline_eval.json")).read())
    assert (
        saved["player"] == "policy" and saved["p0"]["n_prompts"] == 4 and saved["oracle"]["n_prompts"] == 4
    )  # 2 batches of 2
    check_provenance(saved, {"model.lm.name_or_path": tiny_lm_dir})
    # the P0 win rates the validation scored (2 prompts a batch, 2 pairs a prompt), each prompt's mean, by hand
    per_prompt = torch.cat(model.preference.validation).double().view(4, 2).mean(dim=1)
    assert len(set(per_prompt.tolist())) > 1  # prompts differ: an interval to speak of
    assert saved["p0"]["mean"] == pytest.approx(float(per_prompt.mean()), abs=1e-6)
    # the exact prompt-bootstrap distribution: the mean of every one of the 4^4 equally likely draws of 4 prompts
    draws = torch.cartesian_prod(*[torch.arange(4)] * 4)
    exact = per_prompt[draws].mean(dim=1)
    lo, hi = saved["p0"]["mean_ci"]  # a 95% percentile interval of 1000 draws: near the 2.5% and 97.5% quantiles
    assert float(exact.quantile(0.005)) - 1e-9 <= lo <= float(exact.quantile(0.05)) + 1e-9
    assert float(exact.quantile(0.95)) - 1e-9 <= hi <= float(exact.quantile(0.995)) + 1e-9


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
        samples_per_prompt=2,  # D = M = 2: the leave-one-out baselines (the larger budget, an option)
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


class _Counting:
    """Wraps a sampler and counts the answers it samples per call (rows of the rollouts it returns)."""

    def __init__(self, fn):
        self.fn, self.rows = fn, []

    def __call__(self, *args, **kwargs):
        out = self.fn(*args, **kwargs)
        self.rows.append(len(out.texts))
        return out


def test_defaults_sample_table_3s_two_responses_a_prompt(tiny_lm_dir, tmp_path, monkeypatch):
    """Table 3: 2 responses a prompt. NLHF: one policy answer and one mixture answer; SLHF: one Leader answer and one
    Follower refinement; one P0 comparison a prompt each."""
    import alignment_games.modules.nlhf as nlhf

    b = 2  # prompts a batch (_dm)
    counted = {}
    for cls in (NashMDPG, SLHF):
        L.seed_everything(0)
        model = cls(lm=_lm(tiny_lm_dir), preference=LengthPreference(), sampling=Sampling(max_new_tokens=4))
        model.players.generate = spy = _Counting(model.players.generate)
        mixture = _Counting(nlhf.generate_mixture)
        monkeypatch.setattr(nlhf, "generate_mixture", mixture)
        scored = []
        score = model.preference.forward
        model.preference.forward = lambda x, first, second, seen=scored, f=score: (
            seen.append(len(x)) or f(x, first, second)
        )
        steps = 1 if cls is NashMDPG else 2  # SLHF: two optimizer steps a batch
        _trainer(tmp_path, steps=steps).fit(model, _dm())
        counted[cls.__name__] = (sum(spy.rows) + sum(mixture.rows), scored)
    assert counted["NashMDPG"] == (2 * b, [b])
    assert counted["SLHF"] == (2 * b, [b])


def test_slhf_with_one_sample_a_player_takes_the_constant_baseline_one_half():
    """D = M = 1: u = 1 − P0 = 0.2; A = u − τ_F·1 = 0.1, so the follower's advantage is A − ½ = −0.4; the leader's
    L = A + τ_L·2 = 0.2, advantage −0.3 (hand values)."""
    from alignment_games.modules.algorithms.baselines import slhf_surrogate_losses

    lp_l = torch.tensor([[-3.0]], requires_grad=True)
    lp_f = torch.tensor([[[-4.0]]], requires_grad=True)
    out = slhf_surrogate_losses(
        torch.tensor([[[0.8]]]), lp_l, torch.tensor([[-5.0]]), lp_f, torch.tensor([[[-5.0]]]), 0.05, 0.1
    )
    (g_l,) = torch.autograd.grad(out["leader_loss"], lp_l)
    (g_f,) = torch.autograd.grad(out["follower_loss"], lp_f)
    assert g_l.item() == pytest.approx(-0.3)  # the leader won (0.8 > ½): descending raises log π(y)
    assert g_f.item() == pytest.approx(0.4)  # the follower lost: descending lowers log ω(y′)
    assert out["a_bar"].item() == pytest.approx(0.1)


def test_p0_is_a_named_member_or_the_ensemble_mean():
    """Member probabilities 0.9, 0.2, 0.4: member 0 gives 0.9, member 1 0.2, the ensemble mean 0.5."""
    from alignment_games.modules.preference import EnsembleUtility
    from alignment_games.modules.scorers.utility import utility_from_member_probs

    p = torch.tensor([[0.9, 0.2, 0.4]])
    assert utility_from_member_probs(p, "preference").item() == pytest.approx(0.9)
    assert utility_from_member_probs(p, "preference", member=1).item() == pytest.approx(0.2)
    assert utility_from_member_probs(p, "mean_preference").item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="member 3 is out of range for 3 ensemble members"):
        utility_from_member_probs(p, "preference", member=3)
    mean = EnsembleUtility(kind="mean_preference", num_members=3, allow_untrained=True)
    probs = mean.member_probs(["x", "y"], ["a long answer", "b"], ["b", "another answer"])
    assert torch.allclose(mean(["x", "y"], ["a long answer", "b"], ["b", "another answer"]), probs.mean(-1))


def _reference_and_players(model):
    """(reference weights, {player: weights}) of a model's policy bank, for either way of holding the players."""
    bank = model.players
    if bank.mode == "separate":
        ref = {n: p.detach().clone() for n, p in bank.reference.named_parameters()}
    else:  # the base under the adapters: every parameter that is no player's
        ref = {
            n: p.detach().clone()
            for n, p in bank.model.named_parameters()
            if not any(f".{q}." in n for q in bank.player_names)
        }
    players = {q: [p.detach().clone() for p in bank.player_parameters(q)] for q in bank.player_names}
    return ref, players


@pytest.mark.parametrize("players", ["lora", "separate"])
@pytest.mark.parametrize("cls", [NashMDPG, SLHF])
def test_full_fine_tuning_trains_every_weight_and_keeps_the_reference_fixed(tiny_lm_dir, tmp_path, cls, players):
    """``players: separate`` (the paper's "LoRA disabled"): each player is a full copy whose weights all may change
    and do; the frozen reference copy and its log-probabilities stay fixed. ``players: lora``: the base (the
    reference) stays fixed and only the adapters move."""
    L.seed_everything(0)
    lr = {"lr": 1e-2} if cls is NashMDPG else {"leader_lr": 1e-2, "follower_lr": 1e-2}
    model = cls(
        lm=ModelConfig(tiny_lm_dir, lora_r=4, players=players),
        preference=LengthPreference(),
        sampling=Sampling(max_new_tokens=6),
        **lr,
    )
    bank = model.players
    probe = bank.generate(None, [bank.chat(None, "What is 2 + 3?")], 2, Sampling(0.6, max_new_tokens=6))
    with torch.no_grad():
        ref_lp = bank.logprobs(None, probe)
    ref_before, players_before = _reference_and_players(model)
    _trainer(tmp_path, steps=2 if cls is NashMDPG else 4).fit(model, _dm())
    ref_after, players_after = _reference_and_players(model)
    assert ref_before.keys() == ref_after.keys() and len(ref_before) > 0
    assert all(torch.equal(ref_before[n], ref_after[n]) for n in ref_before)  # the reference never moves
    with torch.no_grad():
        assert torch.equal(bank.logprobs(None, probe), ref_lp)
    for q in bank.player_names:
        moved = [not torch.equal(a, b) for a, b in zip(players_before[q], players_after[q])]
        assert any(moved), q
        if players == "separate":  # a full copy: its embeddings and blocks, not an adapter, are what trains
            names = [n for n, _ in bank.models[q].named_parameters()]
            assert len(names) == len(ref_before) and not any("lora" in n for n in names)
            assert sum(moved) > len(moved) // 2, q  # most weight tensors change (every one gets a gradient)
