"""The right run resumed, or a clear refusal: ``--ckpt_path last`` of another experiment, torn and remote checkpoints.

CLI runs use the tabular SMIDA config (no language model; a few seconds a run).
"""

from __future__ import annotations

import glob
import math
import os
import shutil

import pytest
import torch
import yaml

from alignment_games import train
from alignment_games.callbacks.fault_tolerance import AtomicCheckpointIO
from alignment_games.modules.checkpoints.trust import (
    RUN_CONFIG_KEY,
    check_checkpoint_matches,
    check_checkpoint_source,
    check_resume_config,
    config_differences,
    read_checkpoint,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABULAR = os.path.join(ROOT, "configs", "smida_tabular.yaml")


def _fit(*args: str):
    return train.main(["fit", "--config", TABULAR, *args])


def _last(root) -> str:
    (path,) = glob.glob(str(root / "runs" / "smida_tabular" / "version_*" / "checkpoints" / "last.ckpt"))
    return path


@pytest.fixture
def first_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _fit("--trainer.max_steps=2")
    return tmp_path


def test_last_continues_its_own_run_and_refuses_another_experiment_naming_the_keys(first_run):
    saved = torch.load(_last(first_run), weights_only=True)
    recorded = yaml.safe_load(saved[RUN_CONFIG_KEY])
    assert recorded["model"]["init_args"]["seed"] == 0 and recorded["trainer"]["max_steps"] == 2
    # other seed and learning rate: refused before anything runs, both keys named with their values
    with pytest.raises(ValueError, match="another experiment") as err:
        _fit(
            "--trainer.max_steps=4", "--model.init_args.seed=1", "--model.init_args.eta_leader=2.0", "--ckpt_path=last"
        )
    assert "model.init_args.eta_leader" in str(err.value) and "model.init_args.seed" in str(err.value)
    assert "1.0 -> 2.0" in str(err.value) and "trainer.max_steps" not in str(err.value).split("Only")[0]
    assert torch.load(_last(first_run), weights_only=True)["global_step"] == 2  # nothing ran
    # the same experiment, longer and with another logging cadence: resume-safe keys, continued
    cli = _fit("--trainer.max_steps=4", "--trainer.log_every_n_steps=2", "--ckpt_path=last")
    assert cli.trainer.global_step == 4
    assert len(glob.glob(str(first_run / "runs" / "smida_tabular" / "version_*"))) == 1  # one run folder


def test_a_truncated_checkpoint_is_named_and_the_newest_intact_one_offered(first_run):
    last = _last(first_run)
    intact = os.path.join(os.path.dirname(last), "step=2.ckpt")
    shutil.copy(last, intact)
    os.utime(intact, (1, 1))  # older than last.ckpt: `last` still picks the torn one
    with open(last, "r+b") as f:
        f.truncate(os.path.getsize(last) // 2)
    with pytest.raises(ValueError, match="cannot be read") as err:
        _fit("--trainer.max_steps=4", "--ckpt_path=last")
    rel_last, rel_intact = os.path.relpath(last, first_run), os.path.relpath(intact, first_run)  # as the run found them
    assert f"checkpoint {rel_last!r} cannot be read (truncated or corrupt: " in str(err.value)
    assert f"newest intact checkpoint beside it is {rel_intact!r}" in str(err.value)
    with pytest.raises(ValueError, match=f"checkpoint {last!r} cannot be read"):  # an explicit path alike
        read_checkpoint(last, mmap=True)
    cli = _fit("--trainer.max_steps=4", f"--ckpt_path={intact}")  # the one offered resumes
    assert cli.trainer.global_step == 4


def test_a_remote_ckpt_path_is_refused_unless_its_source_is_trusted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"https://example\.org/m/x\.ckpt' is remote and not trusted"):
        train.main(["test", "--config", TABULAR, "--ckpt_path=https://example.org/m/x.ckpt"])
    check_checkpoint_source("https://example.org/m/x.ckpt", ["https://example.org/m/"])  # named: allowed
    check_checkpoint_source("/local/x.ckpt")
    with pytest.raises(ValueError, match="not trusted"):
        check_checkpoint_source("https://example.org.evil/m/x.ckpt", ["https://example.org/m/"])


@pytest.mark.parametrize(
    "url",
    [
        "https://models.example.org.evil.net/runs/last.ckpt",  # the trusted host as a prefix of another host
        "https://models.example.org@evil.net/last.ckpt",  # the trusted host as a user name
        "https://models.example.org:8443/last.ckpt",  # another port
        "http://models.example.org/last.ckpt",  # another scheme
        "https://evil.net/https://models.example.org/last.ckpt",
    ],
)
def test_a_host_that_only_starts_like_a_trusted_one_is_refused(url):
    with pytest.raises(ValueError, match=f"--ckpt_path '{url}' is remote and not trusted"):
        check_checkpoint_source(url, ["https://models.example.org"])


@pytest.mark.parametrize(
    "url",
    [
        "https://models.example.org/runs/../private/last.ckpt",  # .. out of the trusted folder
        "https://models.example.org/runs/pref/../../private/last.ckpt",
        "https://models.example.org/runs/%2e%2e/private/last.ckpt",  # the same, percent-encoded
        "https://models.example.org/runs-other/last.ckpt",  # a folder whose name starts like the trusted one
        "https://models.example.org/../runs/last.ckpt",  # above the root
    ],
)
def test_a_path_that_leaves_a_trusted_folder_is_refused(url):
    with pytest.raises(ValueError, match="is remote and not trusted"):
        check_checkpoint_source(url, ["https://models.example.org/runs/"])


@pytest.mark.parametrize(
    ("url", "trusted"),
    [
        ("https://models.example.org/runs/pref/last.ckpt", "https://models.example.org/runs/"),
        ("https://models.example.org/runs/pref/last.ckpt", "https://models.example.org/runs"),  # no slash
        ("https://models.example.org/runs/pref/last.ckpt", "https://models.example.org"),  # the whole host
        ("https://Models.Example.org:443/runs/./pref/last.ckpt", "https://models.example.org/runs/"),
        ("https://models.example.org/runs/a/../pref/last.ckpt", "https://models.example.org/runs/"),  # stays inside
        ("s3://bucket/runs/pref/last.ckpt", "s3://bucket/runs/"),
    ],
)
def test_a_checkpoint_under_a_trusted_source_is_allowed(url, trusted):
    check_checkpoint_source(url, ["https://elsewhere.example.com/", trusted])


def _poison(path: str, name: str, value: float) -> None:
    ckpt = torch.load(path, weights_only=True)
    ckpt["state_dict"][name] = ckpt["state_dict"][name].clone()
    ckpt["state_dict"][name].view(-1)[1] = value
    AtomicCheckpointIO().save_checkpoint(ckpt, path)


@pytest.mark.parametrize(("name", "value"), [("log_pi", float("nan")), ("log_omega", float("inf")), ("rho", -math.inf)])
def test_a_checkpoint_holding_nan_or_inf_is_refused_on_load_naming_the_file_and_the_tensor(first_run, name, value):
    last = _last(first_run)
    _poison(last, name, value)
    before = os.path.getmtime(last)
    with pytest.raises(ValueError, match=r"holds NaN or inf in state_dict\['" + name + r"'\]") as err:
        _fit("--trainer.max_steps=4", "--ckpt_path=last")
    assert os.path.relpath(last, first_run) in str(err.value) and "resume from an earlier checkpoint" in str(err.value)
    assert os.path.getmtime(last) == before  # nothing ran, nothing was written over it


def test_minus_inf_log_probabilities_still_resume(first_run):
    """Tabular SMIDA's log-probabilities may be -inf (a zero probability): such a checkpoint is a good state."""
    last = _last(first_run)
    _poison(last, "log_pi", -math.inf)
    cli = _fit("--trainer.max_steps=4", "--ckpt_path=last")
    assert cli.trainer.global_step == 4


def test_a_restoring_trainer_names_the_checkpoint_and_nonfinite_optimizer_state_is_refused(first_run, tmp_path):
    """Restored through Lightning alone (no train.py), the module's own check names the trainer's ckpt_path."""
    import lightning as L

    from alignment_games.modules.tabular_smida import TabularSMIDA

    last = _last(first_run)
    _poison(last, "log_omega", float("nan"))
    trainer = L.Trainer(max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match=r"holds NaN or inf in state_dict\['log_omega'\]") as err:
        trainer.fit(TabularSMIDA(**_model_args(last)), ckpt_path=last)
    assert f"checkpoint {last!r} holds" in str(err.value)
    # optimizer moments (floating) are checked, the integer step count is not; found in order
    model = torch.nn.Linear(2, 2)
    ckpt = {
        "state_dict": model.state_dict(),
        "optimizer_states": [
            {"state": {0: {"step": torch.tensor(3), "exp_avg": torch.zeros(2, 2)}}},
            {"state": {0: {"step": torch.tensor(3), "exp_avg_sq": torch.tensor([[0.0, math.inf], [0.0, 0.0]])}}},
        ],
    }
    with pytest.raises(
        ValueError, match=r"^x\.ckpt holds NaN or inf in optimizer_states\[1\]\.state\[0\]\['exp_avg_sq'\]:"
    ):
        check_checkpoint_matches(model, ckpt, source="x.ckpt")
    ckpt["optimizer_states"][1]["state"][0]["exp_avg_sq"][0, 1] = 0.0
    check_checkpoint_matches(model, ckpt, source="x.ckpt")


def _model_args(last: str) -> dict:
    """The tabular model's arguments as the run that wrote ``last`` had them."""
    recorded = yaml.safe_load(torch.load(last, weights_only=True)[RUN_CONFIG_KEY])
    return recorded["model"]["init_args"]


def test_config_differences_by_hand():
    stored = {"seed_everything": 1, "model": {"init_args": {"lr": 0.1, "k": [1, 2]}}, "trainer": {"max_steps": 5}}
    given = {"seed_everything": 2, "model": {"init_args": {"lr": 0.1, "k": [1, 3]}}, "trainer": {"max_steps": 9}}
    assert config_differences(stored, given) == ["model.init_args.k", "seed_everything"]
    assert config_differences(stored, {**stored, "data": {"n": 1}}) == ["data.n"]  # a key only in one
    assert not check_resume_config({}, "a: 1")  # no record: nothing compared
    assert check_resume_config({RUN_CONFIG_KEY: "trainer: {devices: 1}"}, "trainer: {devices: 2}")


def test_checkpoint_io_refuses_weights_only_false(tmp_path):
    path = tmp_path / "a.ckpt"
    AtomicCheckpointIO().save_checkpoint({"x": torch.ones(2)}, path)
    assert torch.equal(AtomicCheckpointIO().load_checkpoint(path)["x"], torch.ones(2))
    with pytest.raises(ValueError, match="weights_only"):
        AtomicCheckpointIO().load_checkpoint(path, weights_only=False)
