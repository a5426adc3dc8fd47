"""A checkpoint's own sha256 is written beside it (``last.ckpt.sha256``) and checked before it is believed.

Finite corruption (a float's bytes changed, same size) leaves the zip readable, and ``torch.load`` does not check the
zip's CRCs: without the sidecar such a file resumes silently. The reference digest is ``hashlib`` over the file.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import warnings

import pytest
import torch
from helpers.corrupt import change_a_number
from helpers.one_rank import OneRank

from alignment_games import train
from alignment_games.callbacks.fault_tolerance import AtomicCheckpointIO
from alignment_games.modules.checkpoints.trust import read_checkpoint, read_checkpoint_or_explain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABULAR = os.path.join(ROOT, "configs", "smida_tabular.yaml")


def _sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(64)}, "global_step": 3}, path)
    return str(path)


def test_the_sidecar_holds_the_files_sha256_in_sha256sum_format(saved):
    with open(saved + ".sha256") as f:
        assert f.read() == f"{_sha256(saved)}  last.ckpt\n"
    assert sorted(os.listdir(os.path.dirname(saved))) == ["last.ckpt", "last.ckpt.sha256"]  # no temporary left


def test_finite_corruption_is_refused_naming_the_file_on_every_load_path(saved):
    change_a_number(saved, torch.ones(64))
    assert torch.load(saved, weights_only=True)["state_dict"]["w"][0] == 1.5  # the zip alone does not notice
    for load in (AtomicCheckpointIO().load_checkpoint, read_checkpoint, read_checkpoint_or_explain):
        with pytest.raises(ValueError, match=f"checkpoint {saved!r}") as err:
            load(saved)
        assert f"its sha256 is {_sha256(saved)}" in str(err.value) and "corrupt" in str(err.value)


def test_a_checkpoint_without_a_sidecar_loads_with_a_warning(saved):
    os.remove(saved + ".sha256")
    with pytest.warns(UserWarning, match=r"has no \.sha256 sidecar"):
        assert AtomicCheckpointIO().load_checkpoint(saved)["global_step"] == 3


def test_a_verified_file_is_hashed_once_until_it_changes(saved, monkeypatch):
    from alignment_games.callbacks.functional import digests

    calls = []
    real = digests.sha256_file
    monkeypatch.setattr(digests, "sha256_file", lambda p: calls.append(p) or real(p))
    read_checkpoint(saved)
    read_checkpoint(saved)
    assert len(calls) == 1
    change_a_number(saved, torch.ones(64))  # a new mtime/ctime: hashed again, and refused
    with pytest.raises(ValueError, match="corrupt"):
        read_checkpoint(saved)


@pytest.mark.parametrize("killed_at", ["checkpoint rename", "sidecar rewrite"])
def test_a_kill_between_the_renames_leaves_a_checkpoint_that_verifies(saved, monkeypatch, killed_at):
    real_replace = os.replace

    def replace(src, dst):
        if (killed_at == "checkpoint rename" and dst == saved) or (
            killed_at == "sidecar rewrite" and dst.endswith(".sha256") and os.path.exists(saved + ".new")
        ):
            raise KeyboardInterrupt  # the process dies here
        real_replace(src, dst)
        if dst == saved:
            open(saved + ".new", "w").close()  # marks that the checkpoint itself was renamed

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(64)}, "global_step": 4}, saved)
    monkeypatch.setattr(os, "replace", real_replace)
    step = read_checkpoint(saved)["global_step"]
    assert step == (3 if killed_at == "checkpoint rename" else 4)


def test_removing_a_checkpoint_removes_its_sidecar(saved):
    AtomicCheckpointIO().remove_checkpoint(saved)
    assert os.listdir(os.path.dirname(saved)) == []


def test_a_resume_from_a_corrupted_last_ckpt_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train.main(["fit", "--config", TABULAR, "--trainer.max_steps=2"])
    (last,) = glob.glob(str(tmp_path / "runs" / "smida_tabular" / "version_*" / "checkpoints" / "last.ckpt"))
    state = torch.load(last, weights_only=True)["state_dict"]
    change_a_number(last, next(v for v in state.values() if v.is_floating_point() and v.numel() >= 4))
    rel = os.path.relpath(last, tmp_path)
    for ckpt_path in ("last", last):
        with warnings.catch_warnings(), pytest.raises(ValueError, match="corrupt") as err:
            train.main(["fit", "--config", TABULAR, "--trainer.max_steps=4", f"--ckpt_path={ckpt_path}"])
        assert repr(rel if ckpt_path == "last" else last) in str(err.value)


def test_a_sharded_checkpoints_files_are_listed_and_a_changed_shard_is_refused_naming_it(tmp_path):
    """A DCP folder as FSDP2 writes it (through ``saved_beside``): its SHA256SUMS lists every file; a shard whose bytes
    changed is refused when the folder is read and before a strategy loads it."""
    from pathlib import Path

    from lightning.fabric.strategies.model_parallel import _distributed_checkpoint_save

    from alignment_games.modules.training.artifacts import recover_folder_on_rank_zero, saved_beside

    path = tmp_path / "last.ckpt"
    weights = torch.arange(64, dtype=torch.float32)
    with saved_beside(OneRank(), path, "fsdp2") as tmp:
        _distributed_checkpoint_save({"state_dict": {"w": weights}}, Path(tmp))
        torch.save({"global_step": 3}, Path(tmp) / "meta.pt")
    files = sorted(p.name for p in path.iterdir() if p.name != "SHA256SUMS")
    assert files == [".metadata", "__0_0.distcp", "meta.pt"]
    assert (path / "SHA256SUMS").read_text() == "".join(f"{_sha256(path / f)}  {f}\n" for f in files)
    assert read_checkpoint_or_explain(path)["global_step"] == 3
    recover_folder_on_rank_zero(OneRank(), path, "load")
    change_a_number(path / "__0_0.distcp", weights)
    refused = f"checkpoint '{path}' is corrupt: __0_0.distcp has sha256 {_sha256(path / '__0_0.distcp')}"
    with pytest.raises(ValueError, match=re.escape(refused)):
        read_checkpoint_or_explain(path)
    with pytest.raises(ValueError, match=re.escape(refused)):
        recover_folder_on_rank_zero(OneRank(), path, "load")  # FSDP2's and DeepSpeed's loads begin here
    (path / "planted.pt").write_bytes(b"x")
    with pytest.raises(ValueError, match="planted.pt was not written by the save"):
        recover_folder_on_rank_zero(OneRank(), path, "load")
