"""Deep-SMIDA with tiny LM players: who learns, what is batched, what is skipped, what is evaluated."""

import glob
import hashlib
import json
import math
import os
import types

import lightning as L
import numpy as np
import pytest
import torch
from helpers.callback_helpers import make_trainer
from helpers.decode_spy import spy_decodes
from helpers.deep_smida import tiny_deep_smida
from helpers.provenance import check_provenance

from alignment_games.modules.scorers.utility import Utility, utility_from_member_probs


class LengthUtility(Utility):
    """u = share of letters in the follower's reply that differ from the leader's first letter: a real function."""

    def forward(self, prompts, leader, follower):
        return torch.tensor([len(set(y2)) / 50.0 for y2 in follower], dtype=torch.float32)


class NaNUtility(Utility):
    def forward(self, prompts, leader, follower):
        return torch.full((len(prompts),), float("nan"))


def _model(tiny_lm_dir, **kw):
    args = dict(utility=LengthUtility(), leader_lr=1e-2, follower_lr=1e-2, tau_leader=0.1, tau_follower=0.1)
    args.update(kw)
    return tiny_deep_smida(tiny_lm_dir, **args)


def _trainer(tmp_path, steps=2, callbacks=(), **kw):
    return make_trainer(tmp_path, list(callbacks), max_steps=steps, max_epochs=None, limit_val_batches=0, **kw)


def _dm(**kw):
    from alignment_games.datamodules.prompts import PromptDataModule

    return PromptDataModule(num_prompts=24, batch_size=2, **kw)


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_both_adapters_learn_and_nothing_else_moves(tiny_lm_dir, tmp_path):
    L.seed_everything(0)
    model = _model(tiny_lm_dir)
    calls = spy_decodes(model.players)  # rows of each batched decode
    before = _snapshot(model)
    _trainer(tmp_path, steps=4).fit(model, _dm())
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert any(".leader." in n for n in changed) and any(".follower." in n for n in changed)
    assert all(".leader." in n or ".follower." in n for n in changed)  # base and utility frozen
    # one generate call per player per step: B*D leader rows, then B*D*M follower rows
    assert calls == [4, 8, 4, 8]  # max_steps counts optimizer steps: two per batch in manual optimization


def test_follower_only_keeps_the_leader_at_its_reference(tiny_lm_dir, tmp_path):
    L.seed_everything(0)
    model = _model(tiny_lm_dir, follower_only=True)
    before = _snapshot(model)
    trainer = _trainer(tmp_path, steps=2)
    trainer.fit(model, _dm())
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".follower." in n for n in changed)
    assert trainer.global_step == 2  # one optimizer step per batch: the leader's never steps
    assert trainer.callback_metrics["leader/grad_norm"] == 0 < trainer.callback_metrics["follower/grad_norm"]


def test_nonfinite_utility_skips_counts_and_stops(tiny_lm_dir, tmp_path):
    L.seed_everything(0)
    model = _model(tiny_lm_dir, utility=NaNUtility(), max_consecutive_nonfinite=3)
    before = _snapshot(model)
    with pytest.warns(UserWarning, match="NaN or inf; the update is skipped"):
        with pytest.raises(RuntimeError, match="3 consecutive steps had non-finite utilities"):
            _trainer(tmp_path, steps=20).fit(model, _dm())
    assert model.nonfinite_skipped == 3
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_validation_compares_trained_and_reference_pairs(tiny_lm_dir, tmp_path):
    from alignment_games.modules.preference import EnsembleUtility
    from alignment_games.modules.scorers.oracle import ProgrammaticOracle

    L.seed_everything(0)
    utility = EnsembleUtility(num_members=3, allow_untrained=True)
    model = _model(tiny_lm_dir, utility=utility, oracle=ProgrammaticOracle(num_queries=1))
    trainer = L.Trainer(
        max_steps=1,
        accelerator="cpu",
        logger=L.pytorch.loggers.CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        val_check_interval=1,
    )
    dm = _dm()
    trainer.fit(model, dm)
    result = json.load(open(os.path.join(trainer.log_dir, "game_eval.json")))
    assert result["n_prompts"] == 4 and result["pairs_per_prompt"] == 2
    per = result["per_prompt"]  # each prompt's pair variances, whose mean is the reported one
    assert len(set(per["item"])) == 4 and all(len(row) == 2 for row in per["trained"] + per["reference"])
    # each prompt named by its text's sha256 (a "same prompts" check between runs compares texts, not positions)
    val = dm.splits["val"]
    assert per["item"] == [hashlib.sha256(val[i]["prompt"].encode()).hexdigest() for i in per["index"]]
    check_provenance(result, {"model.lm.name_or_path": tiny_lm_dir})  # the base by each file's hash, commit, argv
    assert abs(sum(map(sum, per["trained"])) / 8 - result["trained"]["mean"]) < 1e-6
    gain = sum(map(sum, per["trained"])) / 8 - sum(map(sum, per["reference"])) / 8
    assert abs(gain - result["mean_gain"]) < 1e-6
    assert set(result["candidate_yield"]) == {"0.1", "0.05", "0.01"}
    assert set(result["adversarial_yield"]) == {"0.0", "0.1", "0.2", "0.3"}
    errors = result["oracle_errors"]
    assert set(errors) == {"trained", "reference"} and errors["trained"]["labelled"] == 8
    for tag in errors:  # the joint yield never exceeds the plain adversarial share nor the candidate yield
        for eps in ("0.0", "0.1", "0.2", "0.3"):
            joint = errors[tag][eps]["joint"]["0.1"]
            assert joint[0] <= errors[tag][eps]["adversarial"][0] + 1e-12
            assert joint[0] <= result["candidate_yield"]["0.1"][tag] + 1e-12
            assert joint[1] <= joint[0] <= joint[2]
    # how many queries each oracle label averages, and that none of the programmatic oracle's was left out
    assert (result["oracle_num_queries"], result["oracle_invalid_verdicts"], result["oracle_unlabelled_rows"]) == (
        1,
        0,
        0,
    )
    # the reference pair's yield at alpha is about alpha by construction of the thresholds (8 triplets here)
    assert result["candidate_yield"]["0.1"]["reference"] <= 0.25
    for png in ("variance_cdf.png", "candidate_yield.png"):
        assert open(os.path.join(trainer.log_dir, png), "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_checkpoint_keeps_the_adapters_and_the_game_state(tiny_lm_dir):
    model = _model(tiny_lm_dir)
    model.empty_generations, model.reference_thresholds = 5, {"0.1": 0.25}
    model.nonfinite_skipped = 2
    ckpt = {"state_dict": model.state_dict()}
    model.on_save_checkpoint(ckpt)
    assert ckpt["state_dict"] and all(".leader." in k or ".follower." in k for k in ckpt["state_dict"])
    assert ckpt["game_state"]["empty_generations"] == 5
    assert ckpt["game_state"]["reference_thresholds"] == {"0.1": 0.25}
    assert ckpt["game_state"]["nonfinite"]["nonfinite_skipped"] == 2
    fresh = _model(tiny_lm_dir)
    fresh.on_load_checkpoint(ckpt)
    assert (fresh.empty_generations, fresh.reference_thresholds, fresh.nonfinite_skipped) == (5, {"0.1": 0.25}, 2)
    del ckpt["state_dict"][next(iter(ckpt["state_dict"]))]
    with pytest.raises(KeyError, match="lacks trainable tensors"):
        fresh.on_load_checkpoint(ckpt)
    assert fresh.hparams["lm"]["name_or_path"] == tiny_lm_dir and fresh.hparams["lm"]["lora_r"] == 4


def test_bad_settings_are_refused(tiny_lm_dir):
    with pytest.raises(ValueError, match="at least 2"):
        _model(tiny_lm_dir, samples_per_prompt=1)
    with pytest.raises(ValueError, match="leader_response"):
        _model(tiny_lm_dir, follower_system_template="no placeholder")
    with pytest.raises(ValueError, match="leader_lr must be positive"):
        _model(tiny_lm_dir, leader_lr=-8e-6)
    with pytest.raises(ValueError, match="tau_follower must be positive"):
        _model(tiny_lm_dir, tau_follower=0.0)
    with pytest.raises(ValueError, match="unknown utility kind"):
        utility_from_member_probs(torch.rand(2, 3), kind="nope")


def test_utility_kinds_from_member_probs():
    p = torch.tensor([[0.2, 0.4, 0.9]])
    var = ((p - p.mean()) ** 2).mean()
    assert utility_from_member_probs(p, "variance").item() == pytest.approx(4 * var.item())
    assert utility_from_member_probs(p, "slhf").item() == pytest.approx(1 - 0.5)
    assert utility_from_member_probs(p, "decision_uncertainty").item() == pytest.approx(0.5)
    directed = utility_from_member_probs(p, "directed", lam=2.0, member=2)
    assert directed.item() == pytest.approx(4 * var.item() + 2.0 * 0.1)


def test_predict_writes_candidates_in_the_preference_format(tiny_lm_dir, tmp_path):
    from alignment_games.callbacks import JsonlPredictionWriter
    from alignment_games.datamodules.preference import validate_rows

    L.seed_everything(0)
    model = _model(tiny_lm_dir, candidate_threshold=0.0)  # every pair passes a zero threshold
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
        limit_predict_batches=2,
        callbacks=[JsonlPredictionWriter(str(tmp_path / "cand.jsonl"))],
    )
    trainer.predict(model, _dm())
    rows = [json.loads(line) for line in open(tmp_path / "cand.jsonl")]
    assert len(rows) == 2 * 2 * 2  # batches x prompts x pairs
    assert all(r["threshold"] == 0.0 and r["alpha"] == 0.1 for r in rows)
    nonempty = [dict(r, label=0.5) for r in rows if r["response_a"].strip() and r["response_b"].strip()]
    validate_rows(nonempty)  # loadable by the preference datamodule once labelled
    model.hparams.candidate_threshold = None
    with pytest.raises(ValueError, match="no reference threshold for alpha=0.1"):
        L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, limit_predict_batches=1).predict(
            model, _dm()
        )


@pytest.mark.distributed
def test_two_ddp_processes_train_the_game(tiny_lm_dir, tmp_path):
    """Two processes on 3 validation prompts: the sampler pads them to 4, game_eval.json holds each prompt once."""
    import subprocess
    import sys

    from helpers import ROOT as root

    from alignment_games.datamodules.prompts import PromptDataModule

    dm = PromptDataModule(num_prompts=30, val_fraction=0.1, batch_size=2)
    dm.setup("fit")
    n_val = len(dm.splits["val"])
    assert n_val % 2 == 1  # does not divide by the number of processes

    args = [
        sys.executable,
        os.path.join(root, "train.py"),
        "fit",
        "--config",
        os.path.join(root, "configs", "deep_smida.yaml"),
        f"--model.init_args.lm.name_or_path={tiny_lm_dir}",
        "--model.init_args.sampling.max_new_tokens=8",
        "--model.init_args.utility.init_args.num_members=3",
        "--model.init_args.utility.init_args.allow_untrained=true",
        "--data.init_args.num_prompts=30",
        "--data.init_args.batch_size=2",
        "--trainer.max_steps=4",
        "--trainer.val_check_interval=2",
        "--trainer.accelerator=cpu",
        "--trainer.devices=2",
        "--trainer.strategy=ddp",
    ]
    env = {**os.environ, "PYTHONPATH": root, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [json.load(open(p)) for p in glob.glob(str(tmp_path / "runs" / "**" / "game_eval.json"), recursive=True)]
    assert len(evals) == 1 and evals[0]["n_prompts"] == n_val  # 2 rows per rank, the padded repeat dropped
    ckpts = glob.glob(str(tmp_path / "runs" / "**" / "last.ckpt"), recursive=True)
    sd = torch.load(ckpts[0], weights_only=False)["state_dict"]
    assert sd and all(".leader." in k or ".follower." in k for k in sd)  # adapters only, no frozen base


TABLE = torch.tensor([[0.2, 0.9], [0.6, 0.1]], dtype=torch.float64)  # u(y, y′), two actions each


class TableUtility(Utility):
    """``u(x, y, y′) = TABLE[y, y′]`` for the replies ``action-y`` and ``action-y′``."""

    def forward(self, prompts, leader, follower):
        return torch.tensor([float(TABLE[int(y[-1]), int(y2[-1])]) for y, y2 in zip(leader, follower)])


class TabularPlayers(torch.nn.Module):
    """A stand-in for the policy bank with softmax policies over two one-token replies: ``π_θ(y)`` and ``ω_φ(y′|y)``.

    Both start at (and keep as references) the uniform policy, so expected utilities are exact sums.
    """

    def __init__(self):
        super().__init__()
        self.leader = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
        self.follower = torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.float64))

    def player_parameters(self, name):
        return [getattr(self, name)]

    def chat(self, system, prompt):
        return f"{system}\n{prompt}"

    def _logits(self, player, context):
        table = self.leader if player == "leader" else self.follower[context]
        return table if player is not None else torch.zeros_like(table)

    def generate(self, player, prompts, n, sampling, greedy=False):
        # the follower's prompt quotes the leader's reply: that is its context y
        contexts = [int(p.split("action-")[1][0]) if player == "follower" else 0 for p in prompts for _ in range(n)]
        with torch.no_grad():
            probs = torch.stack([self._logits(player, c).softmax(-1) for c in contexts])
        actions = torch.multinomial(probs, 1).flatten().tolist()
        return types.SimpleNamespace(
            texts=[f"action-{a}" for a in actions],
            num_empty=0,
            completion_mask=torch.ones(len(actions), 1),
            player=player,
            contexts=contexts,
            actions=actions,
        )

    def logprobs(self, player, rollout, temperature, micro_batch):
        role = rollout.player if player is not None else None
        return torch.stack(
            [
                (self._logits(role, c) if role else torch.zeros(2, dtype=torch.float64)).log_softmax(-1)[a]
                for c, a in zip(rollout.contexts, rollout.actions)
            ]
        )


def _expected_utility(leader_logits, follower_logits):
    """``E_{y∼π} E_{y′∼ω(·|y)} TABLE[y, y′]``, exactly."""
    pi, omega = leader_logits.softmax(-1), follower_logits.softmax(-1)
    return float((pi[:, None] * omega * TABLE).sum())


def test_follower_raises_and_leader_lowers_the_expected_utility(tiny_lm_dir, tmp_path):
    """Sign wiring of the module's training step on a 2 × 2 game with a known answer: the follower's best response
    to ``y = 0`` is ``y′ = 1`` (0.9 > 0.2) and to ``y = 1`` is ``y′ = 0`` (0.6 > 0.1); the leader, a minimiser, picks
    ``y = 1`` (its cost is lower against the uniform follower, 0.35 < 0.55, and against the best response, 0.6 < 0.9).
    """
    torch.manual_seed(0)
    model = _model(
        tiny_lm_dir,
        utility=TableUtility(),
        samples_per_prompt=4,
        follower_samples=4,
        leader_lr=0.05,
        follower_lr=0.2,
        tau_leader=1e-3,
        tau_follower=1e-3,
    )
    model.players = TabularPlayers()
    before = (model.players.leader.detach().clone(), model.players.follower.detach().clone())
    prompts = [{"prompt": f"question {i}"} for i in range(4 * 12)]
    loader = torch.utils.data.DataLoader(
        prompts, batch_size=4, collate_fn=lambda rows: {"prompt": [r["prompt"] for r in rows]}
    )
    _trainer(tmp_path, steps=2 * 12).fit(model, loader)  # two optimizer steps per batch
    leader, follower = model.players.leader.detach(), model.players.follower.detach()
    start = _expected_utility(*before)
    assert start == pytest.approx(0.45)  # the uniform pair: (0.2 + 0.9 + 0.6 + 0.1) / 4
    assert _expected_utility(before[0], follower) > start + 0.1  # the follower alone raises it
    assert _expected_utility(leader, before[1]) < start - 0.02  # the leader alone lowers it
    omega = follower.softmax(-1)
    assert omega[0, 1] > 0.8 and omega[1, 0] > 0.8  # towards the best responses
    assert leader.softmax(-1)[1] > 0.6


def test_compare_pairs_and_adversarial_by_hand():
    from alignment_games.modules.evaluation.game_eval import (
        adversarial_mask,
        adversarial_yield,
        candidate_thresholds,
        compare_pairs,
    )

    ref = torch.tensor([[0.0, 0.1], [0.2, 0.3], [0.4, 0.5], [0.6, 0.7], [0.8, 0.9]])
    trained = ref + 0.5
    th = candidate_thresholds(ref, [0.1])
    # ten sorted scores 0.0..0.9, the 0.9 quantile at position 0.9 * (10 - 1) = 8.1: 0.8 + 0.1 * (0.9 - 0.8)
    assert th[0.1] == pytest.approx(0.81)
    # unsorted, uneven scores against numpy's linear interpolation (an implementation other than torch's)
    scores = [3.0, -1.0, 7.5, 0.25, 2.0, 11.0, -4.0]
    uneven = candidate_thresholds(torch.tensor(scores).reshape(7, 1), [0.05, 0.3, 0.5, 0.9])
    for alpha, threshold in uneven.items():
        assert threshold == pytest.approx(float(np.quantile(scores, 1 - alpha, method="linear")))
    assert uneven[0.5] == 2.0  # the median of seven
    out = compare_pairs(trained, ref, alphas=(0.1,), n_boot=200)
    assert out["mean_gain"] == pytest.approx(0.5) and out["mean_gain_ci"] == pytest.approx([0.5, 0.5])
    assert out["share_prompts_higher"] == 1.0
    assert out["candidate_yield"]["0.1"] == {"reference": 0.1, "trained": 0.6}  # 0.9 and 0.9..1.4 are >= 0.81
    p_star = torch.tensor([0.9, 0.9, 0.55, 0.2])
    p_bar = torch.tensor([0.4, 0.6, 0.3, 0.7])
    assert adversarial_mask(p_star, p_bar, 0.0).tolist() == [True, False, True, True]
    assert adversarial_mask(p_star, p_bar, 0.1).tolist() == [True, False, False, True]
    with pytest.raises(ValueError, match="epsilon"):
        adversarial_mask(p_star, p_bar, 0.5)
    # the yield is over the labelled triplets (§5.3.2): a NaN label (no valid oracle verdict) counts in neither
    # the adversarial triplets nor the total; 4 triplets above, 3 adversarial at ε = 0, then two unlabelled ones
    unlabelled = torch.tensor([float("nan"), float("nan")])
    p_star_all, p_bar_all = torch.cat([p_star, unlabelled]), torch.cat([p_bar, torch.tensor([0.9, 0.1])])
    assert adversarial_yield(p_star_all, p_bar_all, 0.0) == 0.75  # 3 of 4, not 3 of 6
    assert adversarial_yield(p_star_all, p_bar_all, 0.1) == 0.5  # 2 of 4
    assert math.isnan(adversarial_yield(unlabelled, torch.tensor([0.9, 0.1]), 0.0))
    with pytest.raises(ValueError, match=r"\[P, R\]"):
        compare_pairs(trained[:2], ref)


def test_deep_smida_under_deepspeed_is_refused_by_name(tiny_lm_dir):
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DeepSpeedStrategy

    module = _model(tiny_lm_dir)
    module._trainer = SimpleNamespace(strategy=DeepSpeedStrategy(stage=3))
    with pytest.raises(ValueError, match=r"trainer.strategy: deep-SMIDA .* exactly one \(got DeepSpeedStrategy\)"):
        module.setup("fit")
    assert module.players.merge_for_generation  # refused before the bank was changed


def test_joint_yield_and_precision_by_hand():
    """Fig. 2(b)'s joint yield and Fig. 5's precision on a case counted by hand, both over the labelled triplets."""
    from alignment_games.modules.evaluation.game_eval import adversarial_report, prompt_bootstrap_share

    nan = float("nan")
    # two prompts × three triplets; the last triplet of prompt 1 has no valid oracle verdict
    variance = torch.tensor([[0.9, 0.2, 0.8], [0.7, 0.1, 0.95]])
    p_star = torch.tensor([[0.9, 0.9, 0.2], [0.3, 0.8, nan]])
    p_bar = torch.tensor([[0.3, 0.2, 0.6], [0.6, 0.9, 0.1]])
    # adversarial at ε = 0: (0,0) yes, (0,1) yes, (0,2) yes, (1,0) yes, (1,1) no (both above ½), (1,2) unlabelled
    # candidates at threshold 0.75: (0,0) 0.9, (0,2) 0.8; (1,2) 0.95 is unlabelled; (1,0) 0.7 is below
    out = adversarial_report(variance, p_star, p_bar, {"0.1": 0.75}, epsilons=(0.0, 0.35), n_boot=200)
    assert out["labelled"] == 5
    e0 = out["0.0"]
    assert e0["adversarial"][0] == pytest.approx(4 / 5)
    assert e0["candidates"]["0.1"] == 2
    assert e0["joint"]["0.1"][0] == pytest.approx(2 / 5)  # both candidates are adversarial, out of 5 labelled
    assert e0["precision"]["0.1"][0] == pytest.approx(2 / 2)
    assert e0["enrichment"]["0.1"] == pytest.approx(1.0 / (4 / 5))
    # ε = 0.35 keeps only |P* − ½| > 0.35: (0,0) 0.9 and (0,1) 0.9; of the candidates only (0,0)
    e35 = out["0.35"]
    assert e35["adversarial"][0] == pytest.approx(2 / 5)
    assert e35["joint"]["0.1"][0] == pytest.approx(1 / 5)
    assert e35["precision"]["0.1"][0] == pytest.approx(1 / 2)
    # intervals: a ratio of sums over resampled prompts; prompt 0 alone gives 3/3, prompt 1 alone 1/2, so every
    # resample's adversarial share lies in [1/2, 1] and both ends occur with 200 resamples of 2 prompts
    lo, hi = e0["adversarial"][1:]
    assert (lo, hi) == (pytest.approx(0.5), pytest.approx(1.0))
    # a share that every prompt has alike has a degenerate interval
    hits = torch.tensor([[True, False], [False, True], [True, False]])
    assert prompt_bootstrap_share(hits, torch.ones_like(hits)) == pytest.approx((0.5, 0.5, 0.5))
    assert all(math.isnan(v) for v in prompt_bootstrap_share(hits & False, hits & False))
    with pytest.raises(ValueError, match="every hit must be a counted"):
        prompt_bootstrap_share(hits, torch.zeros_like(hits))


def test_checkpoint_keeps_the_validation_oracles_generator_and_counters(tiny_lm_dir):
    """A resumed validation labels as the uninterrupted one: the oracle's draws continue, its counters carry on."""
    from alignment_games.modules.scorers.oracle import ProgrammaticOracle

    rows = (["q"] * 6, [r"\boxed{2}", "x", r"\boxed{3}"] * 2, [r"\boxed{3}", r"\boxed{2}", "y"] * 2, ["2"] * 6)
    model = _model(tiny_lm_dir, oracle=ProgrammaticOracle(num_queries=2, seed=3))
    model.oracle.label(*rows)
    model.oracle.invalid_verdicts, model.oracle.timeouts = 4, 1  # counters as a run with bad verdicts leaves them
    ckpt = {"state_dict": model.state_dict()}
    model.on_save_checkpoint(ckpt)
    saved = torch.load(_roundtrip(ckpt), weights_only=True)  # loadable with weights_only
    expected = model.oracle.label(*rows)  # what the uninterrupted run labels next
    fresh = _model(tiny_lm_dir, oracle=ProgrammaticOracle(num_queries=2, seed=3))
    assert not torch.equal(fresh.oracle.label(*rows), expected)  # a fresh generator draws otherwise (the control)
    fresh.on_load_checkpoint(saved)
    assert (fresh.oracle.invalid_verdicts, fresh.oracle.timeouts) == (4, 1)
    assert torch.equal(fresh.oracle.label(*rows), expected)


def _roundtrip(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf
