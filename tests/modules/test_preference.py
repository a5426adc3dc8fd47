import json
import math
import os

import lightning as L
import numpy as np
import pytest
import torch
from helpers.callback_helpers import make_trainer
from helpers.provenance import check_provenance, sha256_of

from alignment_games.datamodules.preference import PreferenceDataModule
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.preference import PreferenceEnsemble, skew_symmetric_block_matrix


@pytest.fixture(scope="module")
def ensemble():
    L.seed_everything(0)
    return PreferenceEnsemble(num_members=3, lr=1e-2)


def test_j_is_skew_symmetric_block_diagonal():
    j = skew_symmetric_block_matrix(6)
    assert torch.equal(j.T, -j)
    assert j[0, 1] == 1 and j[1, 0] == -1 and j[0, 2] == 0 and j[2, 3] == 1
    with pytest.raises(ValueError, match="even"):
        skew_symmetric_block_matrix(5)


def test_gpm_head_values_follow_eq_27():
    """Eq. (27), ``P_i(a ≻ b) = σ(λ_i ⟨J z_i(a), z_i(b)⟩)`` with ``z = Wh / ‖Wh‖``: by hand for member 0 and against
    numpy for member 1; dropping the L2 normalisation or λ changes both."""
    from alignment_games.modules.preference import GPMHead

    head = GPMHead(hidden_size=3, num_members=2, embed_dim=2, init_scale=1.0, seeds=[0, 1])
    weights = [[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], [[0.5, 0.0, 1.0], [0.0, -2.0, 0.5]]]
    lambdas = [2.0, 0.5]
    with torch.no_grad():
        head.weight.copy_(torch.tensor(weights))
        head.rho.copy_(torch.tensor([math.log(math.expm1(x)) for x in lambdas]))  # softplus(rho) = λ
    h = torch.tensor([[3.0, 4.0, 7.0], [0.0, 5.0, 1.0]])  # responses a and b
    z = head.embed(h)  # [k, 2, d]
    logits = head.logits(z[:, :1], z[:, 1:])  # [1, k]
    # member 0: z_a = (3, 4) / 5, z_b = (0, 1); J z_a = (0.8, -0.6); ⟨J z_a, z_b⟩ = -0.6; λ = 2: logit -1.2
    assert float(logits[0, 0]) == pytest.approx(-1.2, abs=1e-6)
    assert float(torch.sigmoid(logits[0, 0])) == pytest.approx(1 / (1 + math.exp(1.2)), abs=1e-7)  # 0.2314752
    w, ha, hb = np.array(weights[1]), np.array([3.0, 4.0, 7.0]), np.array([0.0, 5.0, 1.0])
    za, zb = w @ ha / np.linalg.norm(w @ ha), w @ hb / np.linalg.norm(w @ hb)
    j = np.array([[0.0, 1.0], [-1.0, 0.0]])
    assert float(logits[0, 1]) == pytest.approx(lambdas[1] * float((j @ za) @ zb), abs=1e-6)
    # one member at a time (the per-member path of LoRA and separate backbones) gives the same numbers
    for i in range(2):
        zi = head.embed(h, member=i)
        assert float(head.logits(zi[:1], zi[1:], member=i)[0]) == pytest.approx(float(logits[0, i]), abs=1e-6)


@pytest.mark.parametrize("member_type", ["gpm", "bt"])
def test_antisymmetry_and_self_preference(member_type):
    model = PreferenceEnsemble(num_members=4, member_type=member_type, seed=3).eval()
    xs = ["Ava has 3 apples. How many?", "What is 7 - 2?"]
    ya = ["She has 3 apples. \\boxed{3}", "7 - 2 = 5. \\boxed{5}"]
    yb = ["She has 4 apples. \\boxed{4}", "Nothing"]
    p_ab, p_ba, p_aa = model.score(xs, ya, yb), model.score(xs, yb, ya), model.score(xs, ya, ya)
    assert p_ab.shape == (2, 4)
    torch.testing.assert_close(p_ab + p_ba, torch.ones_like(p_ab), atol=1e-6, rtol=0)
    torch.testing.assert_close(p_aa, torch.full_like(p_aa, 0.5), atol=1e-6, rtol=0)
    assert p_ab.std(dim=1).min() > 0  # independently initialised members differ


def _datamodule(model, **kw):
    dm = PreferenceDataModule(num_prompts=40, batch_size=32, seed=1, **kw)
    dm._tokenizer = model.tokenizer
    dm.hparams.num_members = model.hparams.num_members
    return dm


def test_a_member_learns_only_from_its_own_rows(ensemble):
    dm = _datamodule(ensemble)
    dm.setup("fit")
    batch = dm.collate([it for it in dm.splits["train"] if it["member"] == 1][:16])
    before = {n: p.detach().clone() for n, p in ensemble.named_parameters()}
    opt = torch.optim.SGD(ensemble.parameters(), lr=0.5)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(ensemble._own_member_logits(batch), batch["label"])
    loss.backward()
    opt.step()
    opt.zero_grad()
    changed = {n for n, p in ensemble.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {"head.weight", "head.rho"}
    w0, w1 = before["head.weight"], ensemble.head.weight.detach()
    assert torch.equal(w0[0], w1[0]) and torch.equal(w0[2], w1[2]) and not torch.equal(w0[1], w1[1])
    assert torch.equal(before["head.rho"][[0, 2]], ensemble.head.rho.detach()[[0, 2]])
    bad = dict(batch, member=torch.full_like(batch["member"], 7))
    with pytest.raises(ValueError, match="member"):
        ensemble._own_member_logits(bad)


def test_feature_cache_gives_identical_scores(ensemble):
    dm = _datamodule(ensemble)
    dm.setup("fit")
    batch = next(iter(dm.val_dataloader()))
    ensemble.eval()
    ensemble._feature_cache.clear()
    first = ensemble(batch)
    hits = ensemble.cache_hits
    second = ensemble(batch)
    assert ensemble.cache_hits == hits + batch["input_ids"].shape[0]
    torch.testing.assert_close(first, second)
    ensemble.hparams.cache_features = False
    try:
        torch.testing.assert_close(ensemble(batch), first, atol=1e-5, rtol=0)
    finally:
        ensemble.hparams.cache_features = True


@pytest.mark.parametrize("sharing", ["lora", "separate"])
def test_decoder_backbone_with_lora_or_separate_copies(tiny_lm_dir, sharing):
    lm = ModelConfig(tiny_lm_dir, lora_r=2, lora_alpha=16)
    model = PreferenceEnsemble(lm, backbone_task="causal_lm", num_members=2, sharing=sharing, max_length=512)
    assert model.pooling == "last"
    dm = PreferenceDataModule(
        num_prompts=12, num_members=2, batch_size=8, max_length=512, val_fraction=0.2, heldout_fraction=0.2
    )
    dm._tokenizer = model.tokenizer
    dm.setup("fit")
    batch = dm.collate([it for it in dm.splits["train"] if it["member"] == 0][:4])
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    model._own_member_logits(batch).sum().backward()
    opt.step()
    changed = {n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])}
    own = "member_0" if sharing == "lora" else "backbones.0."
    other = "member_1" if sharing == "lora" else "backbones.1."
    assert any(own in n for n in changed)
    assert not any(other in n for n in changed)
    if sharing == "lora":
        assert all(("lora_" in n) or n.startswith("head.") for n in before)
    p = model.eval().score(["x"], ["an answer"], ["an answer"])
    torch.testing.assert_close(p, torch.full_like(p, 0.5), atol=1e-6, rtol=0)


@pytest.mark.e2e  # fit, test, predict and reload, about 20 s on 2 cores (`pytest -m e2e`, .ci/run)
def test_fit_test_report_predict_and_reload(tmp_path):
    L.seed_everything(0)
    model = PreferenceEnsemble(num_members=3, lr=1e-2, report_bootstrap=20)
    dm = PreferenceDataModule(num_prompts=60, batch_size=64, seed=2)
    trainer = L.Trainer(
        max_epochs=2,
        default_root_dir=tmp_path,
        accelerator="cpu",
        enable_progress_bar=False,
        logger=L.pytorch.loggers.TensorBoardLogger(tmp_path, name="t"),
        deterministic=True,
    )
    trainer.fit(model, dm)
    trainer.test(model, dm)
    log_dir = trainer.log_dir
    report = json.loads(open(os.path.join(log_dir, "report.json")).read())
    # the file is the whole report (its keys are tested in tests/modules/evaluation/test_preference_report.py)
    assert set(report) == set(model.last_report) | {"per_row", "provenance"} and "bands" in report
    check_provenance(report, {"model.lm.name_or_path": "builtin:minilm-l6"})  # the backbone, file by file
    rows_file = os.path.join(log_dir, "report.rows.jsonl")
    assert report["per_row"] == {"file": "report.rows.jsonl", "rows": report["n_pairs"], "sha256": sha256_of(rows_file)}
    assert set(report["auroc"]) == {"variance", "decision_uncertainty", "jsd"}
    assert len(report["decile_accuracy"]) == 10 and len(report["member_accuracy"]) == 3
    assert report["n_pairs"] == len(dm.splits["test"]) and report["n_prompts"] == dm.prompts_by_split["test"]
    rows = [json.loads(line) for line in open(os.path.join(log_dir, "report.rows.jsonl"))]  # each held-out pair once
    assert sorted(r["row"] for r in rows) == sorted({r["row"] for r in rows}) and len(rows) == report["n_pairs"]
    right = [(sum(r["members"]) / 3 >= 0.5) == (r["label"] == 1.0) for r in rows]
    assert abs(sum(right) / len(rows) - report["ensemble_accuracy"]) < 1e-12
    for png in ("decile_accuracy.png", "roc_curves.png", "error_rate_vs_fraction.png"):
        assert open(os.path.join(log_dir, png), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    ckpt = os.path.join(tmp_path, "model.ckpt")
    trainer.save_checkpoint(ckpt)
    sd = torch.load(ckpt, weights_only=False)["state_dict"]
    assert not any(k.startswith("backbone.") for k in sd)  # frozen base is not copied into checkpoints
    frozen = PreferenceEnsemble.load_frozen(ckpt, num_members=3)
    assert not any(p.requires_grad for p in frozen.parameters()) and not frozen.training
    xs, ya, yb = ["What is 2 + 3?"], ["2 + 3 = 5. The answer is \\boxed{5}."], ["2 + 3 = 6. \\boxed{6}"]
    torch.testing.assert_close(frozen.score(xs, ya, yb), model.eval().score(xs, ya, yb))
    # a checkpoint missing a trainable tensor is refused, not silently half-loaded
    broken = torch.load(ckpt, weights_only=False)
    del broken["state_dict"]["head.rho"]
    torch.save(broken, tmp_path / "broken.ckpt")
    with pytest.raises(KeyError, match="head.rho"):
        PreferenceEnsemble.load_frozen(str(tmp_path / "broken.ckpt"), num_members=3)


@pytest.mark.parametrize(
    ("field", "bad", "message"),
    [
        ("lr", -1e-2, "lr must be positive"),  # gradient ascent, which used to train and exit 0
        ("backbone_lr", 0.0, "backbone_lr must be positive"),
        ("init_scale", float("nan"), "init_scale must be positive"),
        ("weight_decay", -0.1, "weight_decay must be at least 0"),
    ],
)
def test_bad_rates_are_refused_by_name(field, bad, message):
    from alignment_games.modules.preference import PreferenceEnsemble

    with pytest.raises(ValueError, match=message):
        PreferenceEnsemble(**{field: bad})


def test_lora_sharing_trains_every_members_adapter_and_checkpoints_them_all(tiny_lm_dir, tmp_path):
    """peft's ``set_adapter`` froze every adapter but the active one: member 1's adapter was never in the optimizer,
    member 0's lost its gradient once member 1 ran, and the checkpoint dropped member 0's adapter as frozen (so
    ``--ckpt_path last`` was refused). Found by tests/test_outside_kill.py."""
    L.seed_everything(0)
    lm = ModelConfig(tiny_lm_dir, lora_r=4, lora_alpha=8)
    model = PreferenceEnsemble(lm, backbone_task="causal_lm", num_members=2, sharing="lora")
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)
    dm = PreferenceDataModule(num_prompts=24, responses_per_prompt=3, batch_size=8, max_length=64)
    trainer = make_trainer(tmp_path, [], max_steps=2, max_epochs=None, limit_val_batches=0)
    trainer.fit(model, dm)
    params = dict(model.named_parameters())
    for member in ("member_0", "member_1"):
        names = [n for n in lora if member in n]
        assert names and all(not torch.equal(lora[n], params[n].detach()) for n in names), member
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)["state_dict"]
    assert {n for n in params if "lora_" in n} <= set(saved)
    model.eval().requires_grad_(False)  # a frozen scorer stays frozen when it switches adapters
    model._member_features(dm.collate(dm.splits["train"][:2]), 1)
    assert not any(p.requires_grad for p in model.parameters())
