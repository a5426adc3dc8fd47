"""The provenance block every report carries: inputs by hash, the commit (None outside a checkout), the command."""

import glob
import hashlib
import os
import sys
from types import SimpleNamespace

import torch
from helpers.provenance import check_provenance, sha256_of
from torch import nn

from alignment_games.callbacks.run_config import RunConfigRecord
from alignment_games.datamodules.prompts import PromptDataModule, PromptSource
from alignment_games.modules.evaluation import audit
from alignment_games.modules.evaluation.audit import digests_from_tensor, digests_tensor, provenance, run_provenance


def test_files_folders_and_lists_by_hash_and_the_command(tmp_path, monkeypatch):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1 + 1?"}\n')
    adapter = tmp_path / "adapter"
    (adapter / "sub").mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "sub" / "b.bin").write_bytes(b"\0\1")
    (adapter / ".lock").write_text("x")  # hidden: not content
    monkeypatch.setattr(sys, "argv", ["prog", "--data", str(data)])
    block = provenance({"--data": str(data), "--trained": [str(adapter)], "--base": None})
    assert sorted(block["inputs"]) == ["--data", "--trained[0]"]  # an option not given is left out
    check_provenance({"provenance": block}, {"--data": str(data), "--trained[0]": str(adapter)})
    assert sorted(block["inputs"]["--trained[0]"]["files"]) == ["adapter_config.json", "sub/b.bin"]
    assert "model" not in block["inputs"]["--trained[0]"]  # no config.json: not a model by itself
    missing = provenance({"x": str(tmp_path / "gone")})["inputs"]["x"]
    assert missing == {"path": str(tmp_path / "gone"), "sha256": None}


def test_a_model_folder_carries_its_base_identity(tiny_lm_dir):
    from alignment_games.modules.lm.base_identity import base_identity

    entry = provenance({"--base": tiny_lm_dir})["inputs"]["--base"]
    assert entry["model"] == base_identity(tiny_lm_dir)
    assert entry["files"]["model.safetensors"] == sha256_of(f"{tiny_lm_dir}/model.safetensors")


def test_outside_a_checkout_commit_and_dirty_are_none(tmp_path, monkeypatch):
    monkeypatch.setattr(audit, "SOURCE_ROOT", tmp_path)  # a copy of the code: no repository
    assert audit.git_commit() == {"commit": None, "dirty": None}
    (tmp_path / "inner").mkdir()
    monkeypatch.setattr(audit, "SOURCE_ROOT", tmp_path / "inner")  # another project's repository around it
    monkeypatch.setattr(audit, "_git", lambda *a: f"{tmp_path}\n")
    assert audit.git_commit() == {"commit": None, "dirty": None}


def test_prompt_digests_survive_the_int64_round_trip():
    texts = ["a", "1 + 1?", "ü" * 40]
    assert digests_from_tensor(digests_tensor(texts)) == [hashlib.sha256(t.encode()).hexdigest() for t in texts]


def test_a_runs_inputs_from_its_config_settings_utility_data_and_checkpoint(tmp_path, monkeypatch):
    """What a training run read: train.py's hashed config inputs, the module's and data's settings, the utility's
    checkpoint (a child module's attribute), the judge's model folder (an object attribute's) and the checkpoint
    resumed from; each path named once."""
    files = {n: tmp_path / n for n in ("judge.bin", "ensemble.ckpt", "prompts.jsonl", "last.ckpt")}
    for i, f in enumerate(files.values()):
        f.write_bytes(bytes([i]) * 3)
    module = nn.Module()
    module.hparams = {"lm": {"name_or_path": str(files["judge.bin"])}, "output_dir": str(files["last.ckpt"])}
    module.utility = nn.Module()
    module.utility.checkpoint = str(files["ensemble.ckpt"])
    judge = tmp_path / "judge_model"  # a judge is a plain object naming its model folder
    judge.mkdir()
    (judge / "config.json").write_text("{}")
    module.judge = SimpleNamespace(model_name=str(judge), prompt="Is it right?")
    datamodule = PromptDataModule(source=PromptSource(path=str(files["prompts.jsonl"])))
    record = RunConfigRecord("model: {}\n")
    record.inputs = {"model.init_args.judge.init_args.model": {"path": str(files["judge.bin"]), "sha256": "old"}}
    trainer = SimpleNamespace(callbacks=[record], datamodule=datamodule, ckpt_path=str(files["last.ckpt"]))
    block = run_provenance(trainer, module)
    expected = {
        "model.init_args.judge.init_args.model": str(files["judge.bin"]),  # named by the config first: once
        "model.utility.checkpoint": str(files["ensemble.ckpt"]),
        "model.judge.model_name": str(judge),
        "data.source.path": str(files["prompts.jsonl"]),
        "ckpt_path": str(files["last.ckpt"]),
    }
    check_provenance({"provenance": block}, expected)  # hashed now, not the config's recorded "old"
    assert sorted(block["inputs"]) == sorted(expected)  # output_dir is what a run writes: never an input


def test_a_train_py_run_records_the_inputs_its_config_names(tmp_path, monkeypatch):
    """Through train.py: the game file the config names is in the run's report by sha256, with the command given."""
    from helpers import ROOT

    from alignment_games import train
    from alignment_games.modules.algorithms.tabular_games import random_game

    monkeypatch.chdir(tmp_path)
    torch.save(random_game(16, 8, 5, "variance", "random", seed=0), "game.pt")
    config = os.path.join(ROOT, "configs", "smida_tabular.yaml")
    argv = ["train.py", "fit", "--config", config, "--trainer.max_steps=2", "--model.init_args.game_path=game.pt"]
    monkeypatch.setattr(sys, "argv", argv)
    train.main(argv[1:])
    (path,) = glob.glob(str(tmp_path / "runs" / "**" / "smida_result.pt"), recursive=True)
    result = torch.load(path, weights_only=True)
    check_provenance(result, {"model.init_args.game_path": "game.pt"})  # the config's key, from train.py's record
