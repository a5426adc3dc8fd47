"""The frozen base's identity: path, revision and a hash of its config and weights index, recorded and checked."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct

import pytest

from modules.lm.base_identity import base_identity, check_base_identity


def test_the_hash_is_of_the_config_and_the_weights_header_and_follows_content_not_path(tiny_lm_dir, tmp_path):
    here = base_identity(tiny_lm_dir)
    # an independent reference: sha256 of the name-tagged config.json bytes and the safetensors header
    h = hashlib.sha256()
    h.update(b"config.json\0" + open(f"{tiny_lm_dir}/config.json", "rb").read())
    with open(f"{tiny_lm_dir}/model.safetensors", "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        h.update(b"model.safetensors\0" + f.read(size))
    assert here == {"name_or_path": tiny_lm_dir, "revision": None, "sha256": h.hexdigest()}
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
    assert base_identity("no/such-model-anywhere")["sha256"] is None  # not local: recorded without a hash
    with pytest.raises(ValueError, match="revision 'v2'"):
        check_base_identity({**here, "revision": "v2"}, here, "x")


def test_a_game_checkpoint_records_its_base_and_refuses_another(tiny_lm_dir, tmp_path):
    from modules.deep_smida import DeepSMIDA
    from modules.lm.model_config import ModelConfig
    from modules.lm.sampling import Sampling
    from modules.scorers.utility import Utility

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
