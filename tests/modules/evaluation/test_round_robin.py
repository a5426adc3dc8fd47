"""Round-robin table: hand-computed rates and intervals, mirrored cells, refusals; the command on a tiny model."""

import hashlib
import json
import math
import os

import numpy as np
import pytest
import torch
from helpers.provenance import check_provenance

from alignment_games.commands.round_robin import main
from alignment_games.modules.evaluation.round_robin import adapter_tensors, markdown_table, round_robin_table
from alignment_games.modules.lm.base_identity import base_identity
from alignment_games.modules.lm.models import build_tiny_causal_lm


def test_table_matches_a_hand_computation():
    # 3 prompts, 2 pairs each; a ≻ b labels; NaN = unlabelled pair
    ab = torch.tensor([[1.0, 0.0], [1.0, 1.0], [math.nan, 0.5]])
    cb = torch.tensor([[0.25, 0.25], [0.75, 0.75], [0.5, 0.5]])  # given as (c, b): the table must mirror it
    ac = torch.tensor([[math.nan, math.nan], [0.0, 0.0], [1.0, 1.0]])
    t = round_robin_table({("a", "b"): ab, ("c", "b"): cb, ("a", "c"): ac}, ["a", "b", "c"], n_boot=4000, seed=0)
    # per-prompt a ≻ b: 0.5, 1.0, 0.5 -> 2/3
    assert t["rates"]["a"]["b"]["rate"] == pytest.approx(2 / 3)
    assert t["rates"]["b"]["a"]["rate"] == pytest.approx(1 / 3)
    # b ≻ c = 1 − (c ≻ b) = 1 − (0.25 + 0.75 + 0.5)/3 = 0.5
    assert t["rates"]["b"]["c"]["rate"] == pytest.approx(0.5)
    # a ≻ c: the first prompt has no label, so the mean is over 2 prompts: (0 + 1)/2
    assert t["rates"]["a"]["c"]["rate"] == pytest.approx(0.5)
    assert t["rates"]["a"]["c"]["n_prompts"] == 2
    # the interval of a ≻ b: resampled means of {0.5, 1, 0.5} range over [0.5, 1]; its 95% band is the extremes
    lo, hi = t["rates"]["a"]["b"]["ci"]
    assert lo == pytest.approx(0.5) and hi == pytest.approx(1.0)
    assert t["rates"]["b"]["a"]["ci"] == pytest.approx([0.0, 0.5])  # mirrored
    md = markdown_table(t)
    assert "| a | — | 0.6667 [0.5000, 1.0000] |" in md and md.count("\n") == 5


def test_table_bootstrap_against_an_independent_resampling():
    """The interval is the 95% percentile bootstrap of the mean over prompts, as scipy computes it on the prompts'
    rates with its own resamples. The two pairs of a prompt are close, so resampling pairs instead of prompts would
    narrow the band by about 1 / sqrt(2) (about 0.02 a side here), and another level (90%) by about 0.013."""
    from scipy.stats import bootstrap

    g = torch.Generator().manual_seed(3)
    first = torch.rand(50, 1, generator=g, dtype=torch.float64)
    v = (first + 0.02 * torch.rand(50, 2, generator=g, dtype=torch.float64)).clamp(0, 1)  # two close pairs a prompt
    t = round_robin_table({("x", "y"): v}, ["x", "y"], n_boot=20000, seed=7)
    rates = v.mean(1).numpy()
    ref = bootstrap((rates,), np.mean, n_resamples=20000, method="percentile", random_state=11).confidence_interval
    # Monte Carlo error of either 2.5% quantile with 20000 resamples: about 0.0006
    assert t["rates"]["x"]["y"]["ci"] == pytest.approx([ref.low, ref.high], abs=0.004)
    assert t["rates"]["x"]["y"]["rate"] == pytest.approx(rates.mean(), abs=1e-12)


def test_table_refuses_bad_input():
    v = torch.full((2, 1), 0.5)
    with pytest.raises(ValueError, match="exactly once"):
        round_robin_table({("a", "b"): v, ("b", "a"): v}, ["a", "b"])
    with pytest.raises(ValueError, match="exactly once"):
        round_robin_table({("a", "b"): v}, ["a", "b", "c"])
    with pytest.raises(ValueError, match="not two of"):
        round_robin_table({("a", "z"): v}, ["a", "b"])
    with pytest.raises(ValueError, match="same prompts"):
        round_robin_table({("a", "b"): v, ("a", "c"): torch.full((3, 1), 0.5), ("b", "c"): v}, ["a", "b", "c"])


def test_adapter_tensors_renames_one_player_and_refuses_none():
    state = {
        "players.model.base_model.model.l.q_proj.lora_A.leader.weight": torch.ones(2, 3),
        "players.model.base_model.model.l.q_proj.lora_A.follower.weight": torch.zeros(2, 3),
    }
    out = adapter_tensors(state, "leader", "smida", "ckpt")
    assert list(out) == ["model.base_model.model.l.q_proj.lora_A.smida.weight"]
    with pytest.raises(ValueError, match="ckpt holds no LoRA adapter tensors of player 'policy'"):
        adapter_tensors(state, "policy", "nlhf", "ckpt")


def _checkpoint(path, tiny_lm_dir, family, players, r=4, scale=0.0, seed=0, targets=None):
    """A checkpoint as the families write it: the family stamp and the players' adapter tensors only."""
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.policy_bank import PolicyBank

    torch.manual_seed(seed)
    lm = ModelConfig(tiny_lm_dir, lora_r=r, lora_alpha=2 * r, lora_target_modules=targets)
    bank = PolicyBank(lm, players=players)
    state = {}
    for k, v in bank.state_dict().items():
        if ".lora_" in k:
            state[f"players.{k}"] = v + scale * torch.randn_like(v)
    torch.save({"family": family, "state_dict": state}, path)
    return str(path)


def test_command_writes_the_table(tiny_lm_dir, tmp_path):
    a = _checkpoint(
        tmp_path / "a.ckpt",
        tiny_lm_dir,
        "alignment_games.modules.deep_smida.DeepSMIDA",
        ("leader", "follower"),
        scale=0.5,
    )
    b = _checkpoint(
        tmp_path / "b.ckpt", tiny_lm_dir, "alignment_games.modules.nlhf.NashMDPG", ("policy",), scale=0.5, seed=1
    )
    out = tmp_path / "rr"
    args = ["--runs", f"smida={a}", f"nlhf={b}", "--lm", tiny_lm_dir, "--lora-r", "4", "--lora-alpha", "8"]
    args += ["--num-prompts", "40", "--val-fraction", "0.25", "--max-prompts", "3", "--max-new-tokens", "4"]
    args += ["--oracle-queries", "2", "--n-boot", "50", "--out", str(out)]
    table = main(args)
    saved = json.loads((out / "round_robin.json").read_text())
    assert saved["names"] == ["smida", "nlhf", "reference"] and saved["n_prompts"] == 3
    assert saved["runs"]["smida"]["player"] == "leader" and saved["runs"]["nlhf"]["player"] == "policy"
    for x, y in (("smida", "nlhf"), ("smida", "reference"), ("nlhf", "reference")):
        assert table["rates"][x][y]["rate"] + table["rates"][y][x]["rate"] == pytest.approx(1.0)
    assert os.path.exists(out / "round_robin.md")
    digest = hashlib.sha256(open(a, "rb").read()).hexdigest()
    assert (saved["runs"]["smida"]["checkpoint"], saved["runs"]["smida"]["sha256"]) == (a, digest)
    rows = [json.loads(line) for line in (out / "round_robin.problems.jsonl").read_text().splitlines()]
    assert saved["per_problem"]["rows"] == len(rows) == 3
    assert sorted(rows[0]["preferred"]) == ["nlhf>reference", "smida>nlhf", "smida>reference"]
    check_provenance(saved, {"--lm": tiny_lm_dir, "--runs[0]": a, "--runs[1]": b})
    # the same checkpoint twice, or one trained on another base than --lm, is refused before anything is sampled
    with pytest.raises(ValueError, match=f"--runs: '{a}' and '{a}' are the same path"):
        main(["--runs", f"x={a}", f"y={a}", "--lm", tiny_lm_dir, "--out", str(out)])
    other = build_tiny_causal_lm(tmp_path / "other", seed=1)
    elsewhere = torch.load(b, weights_only=True)
    elsewhere["base_identity"] = {"players": base_identity(other)}  # as alignment_games.modules.base records it
    torch.save(elsewhere, tmp_path / "e.ckpt")
    with pytest.raises(ValueError, match=f"--runs '.*e.ckpt': .*frozen base '{other}'.*given is '{tiny_lm_dir}'"):
        main(["--runs", f"e={tmp_path / 'e.ckpt'}", "--lm", tiny_lm_dir, "--out", str(out)])
    # a checkpoint of another adapter rank, or of an unknown family, is refused naming the run
    c = _checkpoint(tmp_path / "c.ckpt", tiny_lm_dir, "alignment_games.modules.slhf.SLHF", ("leader", "follower"), r=2)
    with pytest.raises(ValueError, match="run 'slhf'.*shape"):
        main(["--runs", f"slhf={c}", "--lm", tiny_lm_dir, "--lora-r", "4", "--lora-alpha", "8", "--out", str(out)])
    d = _checkpoint(tmp_path / "d.ckpt", tiny_lm_dir, "alignment_games.modules.grpo.GRPO", ("policy",))
    with pytest.raises(ValueError, match="run 'g'.*give its player"):
        main(["--runs", f"g={d}", "--lm", tiny_lm_dir, "--lora-r", "4", "--lora-alpha", "8", "--out", str(out)])
    with pytest.raises(ValueError, match="NAME=CHECKPOINT"):
        main(["--runs", "smida", "--lm", tiny_lm_dir])
    # adapters on other modules than peft's default (the SmolLM2 configs adapt the MLP too) load when named
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    f = _checkpoint(
        tmp_path / "f.ckpt", tiny_lm_dir, "alignment_games.modules.nlhf.NashMDPG", ("policy",), targets=targets
    )
    few = ["--runs", f"nlhf={f}", "--lm", tiny_lm_dir, "--lora-r", "4", "--lora-alpha", "8", "--max-prompts", "1"]
    few += ["--num-prompts", "40", "--val-fraction", "0.25", "--max-new-tokens", "2", "--out", str(out)]
    with pytest.raises(ValueError, match=r"run 'nlhf' does not fit .*--lora-target-modules.*unexpected \['.*gate_proj"):
        main(few)
    assert main([*few, "--lora-target-modules", *targets])["n_prompts"] == 1
