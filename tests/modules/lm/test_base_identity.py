"""The frozen base's identity: path, revision and a hash of its config and weights' content, recorded and checked."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import warnings

import pytest

import alignment_games.modules.lm.base_identity as identity
from alignment_games.modules.lm.base_identity import base_identity, check_base_identity
from alignment_games.modules.lm.models import build_tiny_causal_lm


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test its own hash cache (``$XDG_CACHE_HOME/alignment-games``), none of the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "alignment-games" / "weights-sha256.json"


def _counting_hash(monkeypatch) -> list[str]:
    """Count the weight files hashed (read whole) from now on."""
    calls: list[str] = []
    real = identity._hash_file

    def counted(path):
        calls.append(path)
        return real(path)

    monkeypatch.setattr(identity, "_hash_file", counted)
    return calls


def _reference(folder) -> tuple[str, str]:
    """Independently: the content hash (config + each weight file's sha256) and the earlier header hash."""
    config = open(f"{folder}/config.json", "rb").read()
    weights = open(f"{folder}/model.safetensors", "rb").read()
    content = hashlib.sha256(b"config.json\0" + config)
    content.update(b"weights\0model.safetensors\0" + hashlib.sha256(weights).hexdigest().encode())
    (size,) = struct.unpack("<Q", weights[:8])
    header = hashlib.sha256(b"config.json\0" + config + b"model.safetensors\0" + weights[8 : 8 + size])
    return content.hexdigest(), header.hexdigest()


def test_the_hash_is_of_the_config_and_the_weights_content_and_follows_content_not_path(tiny_lm_dir, tmp_path):
    here = base_identity(tiny_lm_dir)
    content, header = _reference(tiny_lm_dir)
    assert here == {
        "name_or_path": tiny_lm_dir,
        "revision": None,
        "sha256": content,
        "hashed": "content",
        "header_sha256": header,
    }
    moved = tmp_path / "moved"
    shutil.copytree(tiny_lm_dir, moved)
    assert base_identity(str(moved))["sha256"] == here["sha256"]  # a copy elsewhere is the same base
    config = json.loads((moved / "config.json").read_text())
    config["rope_theta"] = config.get("rope_theta", 10000.0) * 2
    (moved / "config.json").write_text(json.dumps(config))
    other = base_identity(str(moved))
    assert other["sha256"] != here["sha256"]
    with pytest.raises(ValueError, match=r"deep-SMIDA \(players\): the checkpoint was trained on the frozen base"):
        check_base_identity(here, other, "deep-SMIDA (players)")
    check_base_identity(here, base_identity(tiny_lm_dir), "same")
    missing = base_identity("no/such-model-anywhere")
    assert missing["sha256"] is None and missing["header_sha256"] is None  # not local: recorded without a hash
    with pytest.raises(ValueError, match="revision 'v2'"):
        check_base_identity({**here, "revision": "v2"}, here, "x")


def test_a_same_shape_weight_swap_is_refused_on_resume_naming_both_bases(tiny_lm_dir, tmp_path):
    """Another seed's weights of the same shapes saved over the base's folder: the adapters' checkpoint is refused."""
    from alignment_games.modules.deep_smida import DeepSMIDA
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.sampling import Sampling
    from alignment_games.modules.scorers.utility import Utility

    class Zero(Utility):
        def forward(self, prompts, leader, follower):
            raise AssertionError("not called")

    def build(path):
        return DeepSMIDA(lm=ModelConfig(path, lora_r=4), utility=Zero(), sampling=Sampling(max_new_tokens=4))

    base = tmp_path / "base"
    shutil.copytree(tiny_lm_dir, base)
    model = build(str(base))
    ckpt = {"state_dict": model.state_dict()}
    model.on_save_checkpoint(ckpt)
    (bank,) = ckpt["base_identity"]
    trained_on = ckpt["base_identity"][bank]["sha256"]
    other = build_tiny_causal_lm(tmp_path / "seed1", seed=1)
    header = identity._safetensors_header(f"{other}/model.safetensors")
    assert header == identity._safetensors_header(f"{base}/model.safetensors")  # names, dtypes, shapes, offsets
    shutil.copyfile(f"{other}/model.safetensors", base / "model.safetensors")  # in place: the same path and size
    swapped = build(str(base))
    now = swapped.policy_banks()[bank].base_identity["sha256"]
    assert now != trained_on and now == base_identity(other)["sha256"]
    with pytest.raises(ValueError, match="trained on the frozen base") as err:
        swapped.on_load_checkpoint(ckpt)
    assert f"sha256 {trained_on}" in str(err.value) and f"sha256 {now}" in str(err.value)
    assert str(err.value).count(repr(str(base))) == 2  # both bases named (here the same path)


def test_each_weight_file_is_hashed_once_and_again_when_its_size_or_mtime_changes(tiny_lm_dir, tmp_path, monkeypatch):
    folder = tmp_path / "m"
    shutil.copytree(tiny_lm_dir, folder)
    weights = folder / "model.safetensors"
    calls = _counting_hash(monkeypatch)
    first = base_identity(str(folder))
    assert calls == [os.path.realpath(weights)]
    assert base_identity(str(folder)) == first and len(calls) == 1  # the cache answered: nothing read again
    st = os.stat(weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # the same bytes, another mtime
    assert base_identity(str(folder)) == first and len(calls) == 2
    assert base_identity(str(folder)) == first and len(calls) == 2
    with open(weights, "ab") as f:  # another size (and content)
        f.write(b"\0")
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # the mtime the cache holds
    changed = base_identity(str(folder))
    assert len(calls) == 3 and changed["sha256"] != first["sha256"]


def test_a_file_replaced_with_its_old_size_and_mtime_is_hashed_again(tiny_lm_dir, tmp_path, monkeypatch):
    folder = tmp_path / "m"
    shutil.copytree(tiny_lm_dir, folder)
    weights = folder / "model.safetensors"
    first = base_identity(str(folder))
    calls = _counting_hash(monkeypatch)
    st = os.stat(weights)
    other = build_tiny_causal_lm(tmp_path / "seed2", seed=2)
    shutil.copyfile(f"{other}/model.safetensors", weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime as the cache recorded them
    assert os.stat(weights).st_size == st.st_size
    assert base_identity(str(folder))["sha256"] != first["sha256"] and len(calls) == 1  # the ctime told


def test_a_cache_that_cannot_be_written_does_not_break_the_identity(tiny_lm_dir, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    calls = _counting_hash(monkeypatch)
    expected = _reference(tiny_lm_dir)[0]
    assert base_identity(tiny_lm_dir)["sha256"] == expected
    assert base_identity(tiny_lm_dir)["sha256"] == expected and len(calls) == 2  # hashed each time, no error


def test_a_torn_cache_is_ignored_and_rewritten(tiny_lm_dir, own_cache, monkeypatch):
    own_cache.parent.mkdir(parents=True)
    own_cache.write_text('{"torn')
    calls = _counting_hash(monkeypatch)
    assert base_identity(tiny_lm_dir)["sha256"] == _reference(tiny_lm_dir)[0] and len(calls) == 1
    assert os.path.realpath(f"{tiny_lm_dir}/model.safetensors") in json.loads(own_cache.read_text())


def _hub_snapshot(root, source) -> str:
    """``source``'s files laid out as huggingface_hub caches them: snapshot links to blobs named by their sha256."""
    repo = root / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / ("a" * 40), repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for name in os.listdir(source):
        data = open(f"{source}/{name}", "rb").read()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    return str(snapshot)


def test_a_hub_snapshot_is_identified_by_its_blobs_names_without_reading_them(tiny_lm_dir, tmp_path, monkeypatch):
    """A hub cache snapshot links each file to a blob named by its sha256: the same base, nothing hashed."""
    monkeypatch.setattr(identity, "_hub_cache", lambda: os.path.realpath(tmp_path / "hub"))
    snapshot = _hub_snapshot(tmp_path / "hub", tiny_lm_dir)
    calls = _counting_hash(monkeypatch)
    assert base_identity(snapshot)["sha256"] == base_identity(tiny_lm_dir)["sha256"] == _reference(tiny_lm_dir)[0]
    assert calls == [os.path.realpath(f"{tiny_lm_dir}/model.safetensors")]  # the plain folder's file only


def test_a_blob_named_link_outside_the_hub_cache_is_hashed_not_believed(tiny_lm_dir, tmp_path, monkeypatch):
    """A swapped base dressed as a hub snapshot: its blob keeps the old sha256 as its name, but holds other weights."""
    monkeypatch.setattr(identity, "_hub_cache", lambda: os.path.realpath(tmp_path / "real-hub"))
    snapshot = _hub_snapshot(tmp_path / "fake-hub", tiny_lm_dir)
    other = build_tiny_causal_lm(tmp_path / "seed3", seed=3)
    shutil.copyfile(f"{other}/model.safetensors", os.path.realpath(f"{snapshot}/model.safetensors"))
    assert base_identity(snapshot)["sha256"] == base_identity(other)["sha256"] != _reference(tiny_lm_dir)[0]


def test_sharded_weights_hash_every_shard_and_an_escaping_shard_name_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "sharded"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    index = {"metadata": {}, "weight_map": {"a": "s-1.safetensors", "b": "s-2.safetensors", "c": "s-2.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "s-1.safetensors").write_bytes(b"one")
    (folder / "s-2.safetensors").write_bytes(b"two")
    calls = _counting_hash(monkeypatch)
    first = base_identity(str(folder))["sha256"]
    assert sorted(os.path.basename(c) for c in calls) == ["s-1.safetensors", "s-2.safetensors"]
    (folder / "s-2.safetensors").write_bytes(b"owt")  # the second shard only, same size
    assert base_identity(str(folder))["sha256"] != first
    index["weight_map"]["d"] = "../outside.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: weight_map names '\.\./outside"):
        base_identity(str(folder))


def test_an_earlier_checkpoints_identity_is_compared_on_its_header_hash(tiny_lm_dir, tmp_path):
    """Written before the content hash: resumes (with a warning) on an unchanged config and header, else refused."""
    old = {"name_or_path": tiny_lm_dir, "revision": None, "sha256": _reference(tiny_lm_dir)[1]}
    with pytest.warns(UserWarning, match="weights themselves were not verified"):
        check_base_identity(old, base_identity(tiny_lm_dir), "GRPO (policy)")
    moved = tmp_path / "moved"
    shutil.copytree(tiny_lm_dir, moved)
    config = json.loads((moved / "config.json").read_text())
    config["rope_theta"] = config.get("rope_theta", 10000.0) * 2
    (moved / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"weights-header sha256 \(a checkpoint of an earlier version\)"):
        check_base_identity(old, base_identity(str(moved)), "GRPO (policy)")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a content identity: compared without a warning
        check_base_identity(base_identity(tiny_lm_dir), base_identity(str(tiny_lm_dir)), "GRPO (policy)")


def test_a_game_checkpoint_records_its_base_and_refuses_another(tiny_lm_dir, tmp_path):
    from alignment_games.modules.deep_smida import DeepSMIDA
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.lm.sampling import Sampling
    from alignment_games.modules.scorers.utility import Utility

    class Zero(Utility):
        def forward(self, prompts, leader, follower):
            raise AssertionError("not called")

    def build(path):
        return DeepSMIDA(lm=ModelConfig(path, lora_r=4), utility=Zero(), sampling=Sampling(max_new_tokens=4))

    model = build(tiny_lm_dir)
    ckpt = {"state_dict": model.state_dict()}
    model.on_save_checkpoint(ckpt)
    (bank,) = ckpt["base_identity"]
    assert ckpt["base_identity"][bank] == base_identity(tiny_lm_dir)
    build(tiny_lm_dir).on_load_checkpoint(ckpt)  # the same base: loads
    ckpt["base_identity"][bank]["sha256"] = "0" * 64
    with pytest.raises(ValueError, match="trained on the frozen base"):
        build(tiny_lm_dir).on_load_checkpoint(ckpt)
