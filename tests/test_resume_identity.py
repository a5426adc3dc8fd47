"""The right run resumed, or a clear refusal: ``--ckpt_path last`` of another experiment, torn and remote checkpoints.

CLI runs use the tabular SMIDA config (no language model; a few seconds a run).
"""

from __future__ import annotations

import glob
import hashlib
import math
import multiprocessing
import os
import shutil

import pytest
import torch
import yaml

from alignment_games import train
from alignment_games.callbacks.fault_tolerance import AtomicCheckpointIO
from alignment_games.modules.algorithms.tabular_games import random_game
from alignment_games.modules.checkpoints.run_identity import check_run_inputs, run_inputs
from alignment_games.modules.checkpoints.trust import (
    RUN_CONFIG_KEY,
    check_checkpoint_matches,
    check_checkpoint_source,
    check_resume_config,
    config_differences,
    read_checkpoint,
)
from alignment_games.modules.lm.base_identity import base_identity
from alignment_games.modules.training.run_lock import RunFolderInUse, RunFolderLock

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


def _dirpath_overlay(tmp_path, dirpath) -> str:
    """A config replacing the tabular config's checkpoint callback by one writing to ``dirpath``."""
    callback = {"dirpath": str(dirpath), "save_last": True, "save_top_k": 0}
    overlay = {
        "trainer": {"callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": callback}]}
    }
    path = tmp_path / f"dirpath_{os.path.basename(dirpath)}.yaml"
    path.write_text(yaml.safe_dump(overlay))
    return str(path)


def test_two_runs_sharing_a_dirpath_cannot_resume_each_others_checkpoints(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shared = tmp_path / "shared"
    overlay = _dirpath_overlay(tmp_path, shared)
    _fit("--config", overlay, "--trainer.max_steps=2")  # run a: eta_leader 1.0
    _fit("--config", overlay, "--trainer.max_steps=2", "--model.init_args.eta_leader=2.0")  # run b, beside it
    a, b = shared / "last.ckpt", shared / "last-v1.ckpt"
    os.utime(a, (1, 1))  # b's is the newest: `last` finds it
    with pytest.raises(ValueError, match="another experiment") as err:
        _fit("--config", overlay, "--trainer.max_steps=4", "--ckpt_path=last")  # run a resumes
    assert f"--ckpt_path last ({b})" in str(err.value)
    assert "model.init_args.eta_leader: 2.0 -> 1.0" in str(err.value)  # the field, b's value, a's value
    assert [torch.load(p, weights_only=True)["global_step"] for p in (a, b)] == [2, 2]  # nothing ran
    cli = _fit("--config", overlay, "--trainer.max_steps=4", "--model.init_args.eta_leader=2.0", "--ckpt_path=last")
    assert cli.trainer.global_step == 4  # run b continues its own


def _hold(folder: str, held, done) -> None:
    """A second process: lock ``folder`` and live until ``done``."""
    RunFolderLock.acquire(folder)
    held.set()
    done.wait(120)


@pytest.fixture
def live_holder():
    """A function that starts a live process holding a folder's lock and returns its pid (all ended at teardown)."""
    ctx, procs, done = multiprocessing.get_context("fork"), [], multiprocessing.get_context("fork").Event()

    def hold(folder) -> int:
        held = ctx.Event()
        proc = ctx.Process(target=_hold, args=(str(folder), held, done))
        proc.start()
        procs.append(proc)
        assert held.wait(60)
        return proc.pid

    yield hold
    done.set()
    for proc in procs:
        proc.join(60)


def test_a_checkpoint_folder_locked_by_a_live_process_is_not_written(tmp_path, monkeypatch, live_holder):
    monkeypatch.chdir(tmp_path)
    shared = tmp_path / "shared"
    pid = live_holder(shared)
    with pytest.raises(RunFolderInUse, match=f"run folder {shared} is in use by pid {pid} on "):
        _fit("--config", _dirpath_overlay(tmp_path, shared), "--trainer.max_steps=2")
    assert os.listdir(shared) == ["run.lock"]
    assert not glob.glob(str(tmp_path / "runs" / "smida_tabular" / "version_*"))  # the failed start left nothing
    # a checkpoint folder inside a folder another live process holds (its run folder) is refused like it
    other = tmp_path / "runs" / "other" / "version_0"
    pid = live_holder(other)
    with pytest.raises(RunFolderInUse, match=f"run folder {other} is in use by pid {pid} on "):
        _fit("--config", _dirpath_overlay(tmp_path, other / "checkpoints"), "--trainer.max_steps=2")
    assert os.listdir(other) == ["run.lock"]


def test_a_fresh_run_into_another_runs_fixed_version_folder_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _fit("--trainer.max_steps=2", "--trainer.logger.init_args.version=exp")
    folder = tmp_path / "runs" / "smida_tabular" / "exp"
    before = {p: open(p, "rb").read() for p in glob.glob(str(folder / "**"), recursive=True) if os.path.isfile(p)}
    with pytest.raises(FileExistsError) as err:
        _fit("--trainer.max_steps=2", "--trainer.logger.init_args.version=exp", "--model.init_args.eta_leader=2.0")
    message = str(err.value)
    assert message.startswith(f"run folder {os.path.join('runs', 'smida_tabular', 'exp')} already holds another run's")
    assert "checkpoints, config.yaml, events.out.tfevents." in message
    assert "--ckpt_path last" in message and "--trainer.logger.init_args.version" in message
    after = {p: open(p, "rb").read() for p in glob.glob(str(folder / "**"), recursive=True) if os.path.isfile(p)}
    assert after == before  # its config, curves and checkpoint untouched, no file added
    cli = _fit("--trainer.max_steps=4", "--trainer.logger.init_args.version=exp", "--ckpt_path=last")
    assert cli.trainer.global_step == 4  # continuing that run is still a resume into it
    # a job preempted before its first checkpoint restarts in its folder with `last` (nothing to resume)
    preempted = tmp_path / "runs" / "smida_tabular" / "pre"
    preempted.mkdir()
    (preempted / "config.yaml").write_text("the preempted attempt's")
    cli = _fit("--trainer.max_steps=2", "--trainer.logger.init_args.version=pre", "--ckpt_path=last")
    assert cli.trainer.global_step == 2 and os.path.isfile(preempted / "checkpoints" / "last.ckpt")


def _save_game(path, rho_first: float) -> str:
    game = random_game(16, 8, 5, "variance", "random", seed=0)
    rho = torch.full((16,), 1.0, dtype=torch.float64)
    rho[0] = rho_first
    torch.save({**game, "rho": rho / rho.sum()}, path)
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_a_data_file_changed_between_kill_and_resume_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    old = _save_game("game.pt", 1.0)
    _fit("--trainer.max_steps=2", "--model.init_args.game_path=game.pt")
    last = _last(tmp_path)
    assert torch.load(last, weights_only=True)["run_inputs"] == {
        "model.init_args.game_path": {"path": "game.pt", "kind": "file", "sha256": old}
    }
    new = _save_game("game.pt", 3.0)  # same path, another context prior (the tensors' shapes are the same)
    expected = f"the file 'game.pt' (model.init_args.game_path): sha256 {old} in the checkpoint, {new} now"
    for ckpt_path in ("last", last):  # `last` and an explicit file alike
        with pytest.raises(ValueError, match="what the run reads changed") as err:
            _fit("--trainer.max_steps=4", "--model.init_args.game_path=game.pt", f"--ckpt_path={ckpt_path}")
        assert expected in str(err.value)
    assert torch.load(last, weights_only=True)["global_step"] == 2  # nothing ran
    _save_game("game.pt", 1.0)  # the same bytes again: resumed
    cli = _fit("--trainer.max_steps=4", "--model.init_args.game_path=game.pt", "--ckpt_path=last")
    assert cli.trainer.global_step == 4


def test_run_inputs_hash_every_model_folder_and_file_and_refuse_a_changed_one(tmp_path, tiny_lm_dir):
    judge, data = tmp_path / "judge", tmp_path / "pairs.jsonl"
    shutil.copytree(tiny_lm_dir, judge)
    data.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    config = {
        "model": {
            "init_args": {
                "judge": {"class_path": "x.HFJudge", "init_args": {"model": str(judge)}},
                "reward_models": [str(judge)],
                "output_dir": str(judge),  # written by the run, not read: not an input
                "name": "judge",  # a word, not a path
            }
        },
        "data": {"init_args": {"path": str(data)}},
        "trainer": {"logger": {"init_args": {"save_dir": str(tmp_path)}}},
    }
    inputs = run_inputs(config)
    assert sorted(inputs) == [
        "data.init_args.path",
        "model.init_args.judge.init_args.model",
        "model.init_args.reward_models.0",
    ]
    assert inputs["data.init_args.path"]["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    folder_sha = inputs["model.init_args.judge.init_args.model"]["sha256"]
    assert (
        folder_sha == base_identity(str(judge))["sha256"]
        and inputs["model.init_args.reward_models.0"]["kind"] == "model folder"
    )
    check_run_inputs(inputs, run_inputs(config), "x")  # unchanged: passes
    weights = judge / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-8:] = bytes(8) if raw[-8:] != bytes(8) else b"\x01" * 8  # the same size, other weights
    weights.write_bytes(bytes(raw))
    now = run_inputs(config)["model.init_args.judge.init_args.model"]["sha256"]
    assert now != folder_sha
    with pytest.raises(ValueError) as err:
        check_run_inputs(inputs, run_inputs(config), "--ckpt_path last (x.ckpt)")
    assert str(err.value).startswith("--ckpt_path last (x.ckpt): what the run reads changed")
    for key in ("model.init_args.judge.init_args.model", "model.init_args.reward_models.0"):
        assert f"the model folder {str(judge)!r} ({key}): sha256 {folder_sha} in the checkpoint, {now} now" in str(
            err.value
        )
    assert "data.init_args.path" not in str(err.value)
    moved = {k: {**v, "path": "elsewhere"} for k, v in inputs.items()}  # another path: the config decides, not this
    check_run_inputs(moved, run_inputs(config), "x")
