"""A full disk while the suite writes its own files (checkpoints, reports, artifact folders, exports): the error names
the path being written, chains the original ``OSError`` and keeps its errno, and the previous version stays whole.

The write is made to fail as a full disk does: the file's ``write`` raises ``OSError(ENOSPC)`` part-way.
"""

import builtins
import contextlib
import errno
import io
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.one_rank import OneRank

from alignment_games.callbacks.fault_tolerance import atomic_torch_save
from alignment_games.modules.training.artifacts import atomic_folder, atomic_write_text


class _FullDisk(io.FileIO):
    """A file on a disk with ``room`` bytes left: the write that goes past them raises ``ENOSPC``."""

    room = 64

    def write(self, data):
        type(self).room -= len(data)
        if type(self).room < 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(data)


def _full_disk_file(raw, mode):
    if "b" in mode:
        return raw
    return io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8")  # text: the error comes at flush or close


def _fill_disk(monkeypatch, room):
    """From now on every file opened for writing (``open``, ``os.fdopen``) has ``room`` bytes left in all."""
    monkeypatch.setattr(_FullDisk, "room", room)
    real_open, real_fdopen = builtins.open, os.fdopen

    def fake_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax"):
            return _full_disk_file(_FullDisk(file, mode.replace("t", "").replace("b", "")), mode)
        return real_open(file, mode, *args, **kwargs)

    def fake_fdopen(fd, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax"):
            return _full_disk_file(_FullDisk(fd, mode.replace("t", "").replace("b", "")), mode)
        return real_fdopen(fd, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(os, "fdopen", fake_fdopen)


def _check_named(err, path):
    assert isinstance(err.value, OSError) and err.value.errno == errno.ENOSPC
    assert str(err.value) == (
        f"[Errno {errno.ENOSPC}] cannot write {path}: No space left on device; its previous version is left as it was"
    )
    cause = err.value.__cause__
    while cause is not None and not isinstance(cause, OSError):  # torch.save wraps it in a RuntimeError
        cause = cause.__context__
    assert cause is not None and cause.errno == errno.ENOSPC


def test_a_full_disk_during_a_checkpoint_save_names_the_checkpoint_and_keeps_the_old_one(tmp_path, monkeypatch):
    path = str(tmp_path / "last.ckpt")
    atomic_torch_save({"step": 1, "w": torch.zeros(1000)}, path)
    _fill_disk(monkeypatch, 64)
    with pytest.raises(OSError) as err:  # torch.save used to say only "unexpected pos 64 vs 0" (a RuntimeError)
        atomic_torch_save({"step": 2, "w": torch.ones(1000)}, path)
    _check_named(err, path)
    old = torch.load(path, weights_only=True)
    assert old["step"] == 1 and torch.equal(old["w"], torch.zeros(1000))
    assert os.listdir(tmp_path) == ["last.ckpt"]  # no temporary left behind


def test_a_full_disk_during_an_artifact_write_names_the_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    path = str(tmp_path / "eval.json")
    atomic_write_text(path, json.dumps({"accuracy": 0.5}))
    _fill_disk(monkeypatch, 8)
    with pytest.raises(OSError) as err:
        atomic_write_text(path, json.dumps({"accuracy": 0.75, "rows": list(range(100))}))
    _check_named(err, path)
    with open(path) as f:
        assert json.load(f) == {"accuracy": 0.5}
    assert os.listdir(tmp_path) == ["eval.json"]


def test_the_preference_report_on_a_full_disk_names_the_report_and_keeps_the_old_one(tmp_path, monkeypatch):
    from alignment_games.modules.preference import PreferenceEnsemble

    path = str(tmp_path / "report.json")
    with open(path, "w") as f:
        f.write('{"accuracy": 0.5}')
    _fill_disk(monkeypatch, 8)
    with pytest.raises(OSError) as err:  # raised before anything else of the module is used
        out = {"report": {"accuracy": 0.75, "n": 1000}, **{k: torch.zeros(1) for k in ("rows", "prompts", "labels")}}
        out["probs"] = torch.zeros(1, 2)
        PreferenceEnsemble._write_report(SimpleNamespace(_trainer=None), out, str(tmp_path))
    _check_named(err, path)
    with open(path) as f:
        assert f.read() == '{"accuracy": 0.5}'
    assert os.listdir(tmp_path) == ["report.json"]


def test_a_full_disk_while_a_folder_is_written_names_the_folder_and_keeps_the_old_one(tmp_path, monkeypatch):
    path = str(tmp_path / "model")
    with atomic_folder(path) as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write("old")
    with pytest.raises(OSError) as err:
        with atomic_folder(path) as tmp:
            _fill_disk(monkeypatch, 2)
            with open(os.path.join(tmp, "config.json"), "w") as f:  # as save_pretrained's write would
                f.write("new content")
    _check_named(err, path)
    assert os.listdir(tmp_path) == ["model"] and os.listdir(path) == ["config.json"]
    with open(os.path.join(path, "config.json")) as f:
        assert f.read() == "old"


# ------------------------------------------------------------------------------------------------ writers of others
def test_a_full_disk_at_the_start_of_a_fit_names_the_config_file_being_written(tmp_path, monkeypatch):
    """jsonargparse's config.yaml (then Lightning's hparams.yaml) used to raise a bare ``No space left on device``."""
    from alignment_games import train

    monkeypatch.chdir(tmp_path)
    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "smida_tabular.yaml")
    _fill_disk(monkeypatch, 1000)  # room for the run's lock file, not for its config
    with pytest.raises(OSError) as err:
        train.main(["fit", "--config", config, "--trainer.max_steps=1", "--trainer.enable_progress_bar=false"])
    path = tmp_path / "runs" / "smida_tabular" / "version_0" / "config.yaml"
    assert str(err.value) == f"[Errno {errno.ENOSPC}] cannot write {path}: No space left on device"
    assert err.value.errno == errno.ENOSPC and isinstance(err.value.__cause__, OSError)


def test_lightnings_hparams_yaml_on_a_full_disk_is_named(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import TensorBoardLogger

    from alignment_games.callbacks.functional.files import disk_full_error

    logger = TensorBoardLogger(str(tmp_path), name="run", version=0, default_hp_metric=False)
    logger.log_hyperparams({"lr": 0.1})
    _fill_disk(monkeypatch, 0)
    with pytest.raises(OSError) as err:
        logger.save()  # Lightning's save_hparams_to_yaml
    assert str(err.value) == f"[Errno {errno.ENOSPC}] No space left on device"  # what Lightning raises: no path
    named = disk_full_error(err.value)
    assert str(named) == f"[Errno {errno.ENOSPC}] cannot write {tmp_path / 'run' / 'version_0' / 'hparams.yaml'}: " + (
        "No space left on device"
    )
    assert disk_full_error(named) is None and disk_full_error(OSError(errno.EACCES, "denied")) is None


def _sharded_state():
    return {"state_dict": {"w": torch.ones(256)}, "optimizer_0": {"state": {}, "param_groups": []}}


def test_a_full_disk_during_a_sharded_save_names_the_checkpoint_and_the_shard_and_keeps_the_old_one(
    tmp_path, monkeypatch
):
    """FSDP2's save (DCP): the failure comes back as a CheckpointException that named no path."""
    import torch.distributed.checkpoint.filesystem as dcp_fs
    from lightning.fabric.strategies.model_parallel import _distributed_checkpoint_save

    from alignment_games.modules.training.artifacts import saved_beside

    path = tmp_path / "last.ckpt"
    with saved_beside(OneRank(), path, "fsdp2") as tmp:
        _distributed_checkpoint_save(_sharded_state(), Path(tmp))
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    real_stream = dcp_fs.FileSystem.create_stream

    def full_stream(self, p, mode):  # the shard files DCP writes, on a full disk
        return contextlib.nullcontext(_FullDisk(os.fspath(p), "w")) if "w" in mode else real_stream(self, p, mode)

    monkeypatch.setattr(_FullDisk, "room", 16)
    monkeypatch.setattr(dcp_fs.FileSystem, "create_stream", full_stream)
    with pytest.raises(OSError) as err:
        with saved_beside(OneRank(), path, "fsdp2") as tmp:
            _distributed_checkpoint_save(_sharded_state(), Path(tmp))
    assert err.value.errno == errno.ENOSPC
    assert re.fullmatch(
        rf"\[Errno {errno.ENOSPC}\] cannot write {re.escape(str(path))}: No space left on device \(writing "
        rf"{re.escape(str(tmp_path))}/\.last\.ckpt\.partial/__0_0\.distcp\); its previous version is left as it was",
        str(err.value),
    ), str(err.value)
    assert type(err.value.__cause__).__name__ == "CheckpointException"
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before


def test_a_full_disk_under_torchs_own_writer_names_the_checkpoint(tmp_path, monkeypatch):
    """DeepSpeed saves with ``torch.save(state, path)``: torch's C++ writer raises a RuntimeError without an errno;
    with (almost) no room left on the device it is named as a full disk."""
    from alignment_games.callbacks.functional import files
    from alignment_games.modules.training.artifacts import saved_beside

    path = tmp_path / "last.ckpt"
    real = os.statvfs(tmp_path)
    full = os.statvfs_result((*real[:4], 0, *real[5:]))  # f_bavail = 0

    def torch_writer_fails(tmp):
        os.makedirs(os.path.join(tmp, "checkpoint"))
        monkeypatch.setattr(files.os, "statvfs", lambda p: full)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file")

    with pytest.raises(OSError) as err:
        with saved_beside(OneRank(), path, "deepspeed") as tmp:
            torch_writer_fails(tmp)
    assert str(err.value).startswith(
        f"[Errno {errno.ENOSPC}] cannot write {path}: No space left on device (0 bytes free after: [enforce fail"
    )
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="PytorchStreamWriter"):  # with room left: torch's error, as it was
        with saved_beside(OneRank(), path, "deepspeed") as tmp:
            raise RuntimeError("PytorchStreamWriter failed writing file")
