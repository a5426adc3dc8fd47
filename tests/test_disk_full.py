"""A full disk while the suite writes its own files (checkpoints, reports, artifact folders, exports): the error names
the path being written, chains the original ``OSError`` and keeps its errno, and the previous version stays whole.

The write is made to fail as a full disk does: the file's ``write`` raises ``OSError(ENOSPC)`` part-way.
"""

import builtins
import errno
import io
import json
import os
from types import SimpleNamespace

import pytest
import torch

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
