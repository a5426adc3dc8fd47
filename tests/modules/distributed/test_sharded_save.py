"""FSDP2Strategy's sharded saves: killed at any moment, the previous checkpoint stays whole and loads; read pickle-free.

The saves run in a child process (one rank, no process group: DCP's single-process mode) that is killed with
``os._exit`` at a chosen moment: while writing ``meta.pt`` (the shards written), after the whole new folder is
written (nothing renamed), and between the two renames (the old folder aside, the new one not yet in place).
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from alignment_games.modules.distributed.dcp_safe import read_dcp_metadata
from alignment_games.modules.distributed.strategies import FSDP2Strategy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class _OneRank(FSDP2Strategy):
    """FSDP2Strategy on one rank without a process group (collectives are identities)."""

    def broadcast(self, obj, src=0):
        return obj

    def barrier(self, name=None):
        return None

    def reduce_boolean_decision(self, decision, all=True):
        return decision

    @property
    def global_rank(self) -> int:
        return 0


CHILD = textwrap.dedent(
    """
    import os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from test_sharded_save import _OneRank, _checkpoint
    import alignment_games.modules.training.artifacts as artifacts

    path, kill_at = sys.argv[1], sys.argv[2]
    strategy = _OneRank()
    strategy.save_checkpoint(_checkpoint(1.0, step=1), path)
    if kill_at == "meta":
        real_save = torch.save
        def dying_save(obj, f, *a, **k):
            if str(f).endswith("meta.pt"):
                os._exit(17)
            return real_save(obj, f, *a, **k)
        torch.save = dying_save
    elif kill_at in ("written", "old_aside"):
        artifacts.SWAP_HOOK = lambda moment: os._exit(17) if moment == kill_at else None
    strategy.save_checkpoint(_checkpoint(2.0, step=2), path)
    """
)


def _checkpoint(value: float, step: int) -> dict:
    return {
        "state_dict": {"weight": torch.full((3, 4), value), "bias": torch.full((3,), value)},
        "optimizer_states": [],
        "global_step": step,
        "loops": {"fit_loop": {"step": step}},
    }


def _run_child(path: str, kill_at: str) -> int:
    here = os.path.dirname(os.path.abspath(__file__))  # the child imports this file's helpers
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, here])}
    proc = subprocess.run([sys.executable, "-c", CHILD, path, kill_at], env=env, capture_output=True, text=True)
    assert proc.returncode in (0, 17), proc.stderr[-3000:]
    return proc.returncode


def _load(path: str) -> tuple[nn.Linear, dict]:
    strategy = _OneRank()
    model = nn.Linear(4, 3)
    strategy.model = model
    meta = strategy.load_checkpoint(path)
    return model, meta


@pytest.mark.parametrize("kill_at", ["meta", "written", "old_aside"])
def test_a_save_killed_at_any_moment_leaves_the_previous_checkpoint_whole(tmp_path, kill_at):
    path = str(tmp_path / "last.ckpt")
    assert _run_child(path, kill_at) == 17
    if kill_at == "old_aside":  # the old folder is aside, nothing at the path until a reader recovers it
        assert not os.path.exists(path) and os.path.isdir(tmp_path / ".last.ckpt.previous")
    model, meta = _load(path)
    # weights, loop position and step all from the previous save: nothing of the killed one mixed in
    assert meta["global_step"] == 1 and meta["loops"]["fit_loop"]["step"] == 1
    assert torch.equal(model.weight.detach(), torch.full((3, 4), 1.0))
    assert torch.equal(model.bias.detach(), torch.full((3,), 1.0))
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]  # the killed save's leftovers removed


def test_a_finished_save_replaces_the_checkpoint_and_leaves_nothing_beside(tmp_path):
    path = str(tmp_path / "last.ckpt")
    assert _run_child(path, "none") == 0
    model, meta = _load(path)
    assert meta["global_step"] == 2 and torch.equal(model.weight.detach(), torch.full((3, 4), 2.0))
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]
    assert sorted(os.listdir(path)) == [".metadata", "SHA256SUMS", "__0_0.distcp", "meta.pt"]


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_metadata_naming_code_is_refused_with_the_file_named(tmp_path):
    path = str(tmp_path / "last.ckpt")
    _OneRank().save_checkpoint(_checkpoint(1.0, step=1), path)
    assert read_dcp_metadata(path).state_dict_metadata  # the real metadata reads
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(_Boom(), f)
    os.remove(os.path.join(path, "SHA256SUMS"))  # else the changed bytes are refused first (test_checkpoint_digest)
    with pytest.raises(pickle.UnpicklingError, match=r"\.metadata: refusing to build posix\.system"):
        _load(path)


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("torch.distributed.checkpoint.filesystem", "os.system"),  # pickle resolves dotted names attribute by attribute
        ("torch.distributed.checkpoint.metadata", "dataclasses.sys.modules"),
        ("torch.distributed.checkpoint.filesystem", "pickle"),  # a module the allowed module imports, not a class
        ("torch.distributed.checkpoint.filesystem", "FileSystemReader"),  # a class it imports, not one it defines
        ("torch", "float32.__class__"),
    ],
)
def test_metadata_naming_code_by_a_dotted_or_imported_name_is_refused(tmp_path, module, name):
    path = str(tmp_path / "last.ckpt")
    _OneRank().save_checkpoint(_checkpoint(1.0, step=1), path)
    marker = tmp_path / "pwned"
    # GLOBAL by hand (protocol 4's STACK_GLOBAL would do the same): module, name, then call it with one string
    payload = b"\x80\x04c" + module.encode() + b"\n" + name.encode() + b"\n"
    payload += pickle.dumps(f"touch {marker}", protocol=0)[:-1] + b"\x85R."
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(payload)
    os.remove(os.path.join(path, "SHA256SUMS"))  # else the changed bytes are refused first (test_checkpoint_digest)
    with pytest.raises(
        pickle.UnpicklingError, match=rf"\.metadata: refusing to build {re.escape(module)}\.{re.escape(name)}"
    ):
        _load(path)
    assert not marker.exists()


def test_loading_with_weights_only_false_is_refused(tmp_path):
    path = str(tmp_path / "last.ckpt")
    _OneRank().save_checkpoint(_checkpoint(1.0, step=1), path)
    with pytest.raises(ValueError, match="weights_only"):
        _OneRank().load_checkpoint(path, weights_only=False)


def _outside_checkpoint(tmp_path) -> tuple[str, str]:
    """A whole sharded checkpoint outside the run's folder, and a ``.last.ckpt.previous`` link to it in the run's."""
    outside = tmp_path / "elsewhere" / "last.ckpt"
    _OneRank().save_checkpoint(_checkpoint(5.0, step=5), str(outside))
    run = tmp_path / "run"
    run.mkdir()
    (run / ".last.ckpt.previous").symlink_to(outside)
    return str(run / "last.ckpt"), str(outside)


def test_a_previous_link_pointing_outside_is_not_restored_and_left_untouched(tmp_path):
    path, outside = _outside_checkpoint(tmp_path)
    link = os.path.join(os.path.dirname(path), ".last.ckpt.previous")
    with pytest.raises(ValueError, match=re.escape(f"{link!r} is a symbolic link (to {outside!r})")):
        _load(path)
    assert os.readlink(link) == outside and not os.path.lexists(path)  # nothing renamed, nothing followed
    assert sorted(os.listdir(outside)) == [".metadata", "SHA256SUMS", "__0_0.distcp", "meta.pt"]
    # the same through `--ckpt_path last`'s recovery of a run's checkpoint folder
    from alignment_games import train

    with pytest.raises(ValueError, match="not restored as 'last.ckpt'"):
        train.recover_interrupted_saves(os.path.dirname(path))
    assert os.readlink(link) == outside and not os.path.lexists(path)


def test_a_previous_link_beside_a_finished_swap_is_unlinked_not_followed(tmp_path):
    outside = tmp_path / "elsewhere" / "last.ckpt"
    _OneRank().save_checkpoint(_checkpoint(5.0, step=5), str(outside))
    path = str(tmp_path / "run" / "last.ckpt")
    _OneRank().save_checkpoint(_checkpoint(1.0, step=1), path)
    (tmp_path / "run" / ".last.ckpt.previous").symlink_to(outside)
    model, meta = _load(path)  # the checkpoint is in place: the leftover link goes, what it points to stays
    assert meta["global_step"] == 1 and torch.equal(model.bias.detach(), torch.full((3,), 1.0))
    assert sorted(os.listdir(tmp_path / "run")) == ["last.ckpt"]
    assert sorted(os.listdir(outside)) == [".metadata", "SHA256SUMS", "__0_0.distcp", "meta.pt"]


def test_a_sharded_checkpoint_holding_nan_or_inf_is_refused_naming_the_folder_and_the_tensor(tmp_path):
    path = str(tmp_path / "last.ckpt")
    poisoned = _checkpoint(1.0, step=1)
    poisoned["state_dict"]["bias"][2] = float("nan")
    _OneRank().save_checkpoint(poisoned, path)
    with pytest.raises(ValueError, match=re.escape(f"checkpoint {path!r} holds NaN or inf in state_dict['bias']")):
        _load(path)
