"""A checkpoint carries tensors and state, never configuration: its stored hyper-parameters cannot load code, and a
checkpoint of another family, or whose tensors do not fit the config's model, is refused naming both.

The poisoned checkpoint is a real ``last.ckpt`` of the preference ensemble whose hyper-parameters were edited to name
a local model folder with ``auto_map`` code and ``trust_remote_code: true``; that code writes a marker file and
raises when imported, so the test fails if it runs.
"""

import glob
import json
import os
import shutil

import pytest
import torch
import yaml
from helpers import ROOT

from alignment_games import train
from alignment_games.modules.preference import PreferenceEnsemble

CONFIG = os.path.join(ROOT, "configs", "preference_ensemble.yaml")
TABULAR = os.path.join(ROOT, "configs", "smida_tabular.yaml")
SMALL = [
    "--trainer.accelerator=cpu",
    "--trainer.limit_val_batches=0",
    "--data.init_args.num_prompts=24",
    "--model.init_args.num_members=2",
    "--model.init_args.report_bootstrap=5",
]
EVIL_CODE = """
import os
open(os.environ["EVIL_MARKER"], "w").write("the checkpoint ran code")
raise RuntimeError("remote code from a checkpoint ran")
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_lm_dir):
    """A one-step preference run, a poisoned copy of its last.ckpt, and a one-step tabular SMIDA run."""
    root = tmp_path_factory.mktemp("trust")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        train.main(["fit", "--config", CONFIG, *SMALL, "--trainer.max_steps=1", "--test_after_fit=false"])
        train.main(["fit", "--config", TABULAR, "--trainer.max_steps=2"])
    finally:
        os.chdir(cwd)
    (last,) = glob.glob(str(root / "runs" / "preference_ensemble" / "version_0" / "checkpoints" / "last.ckpt"))
    (tabular,) = glob.glob(str(root / "runs" / "smida_tabular" / "version_0" / "checkpoints" / "last.ckpt"))
    # a loadable model folder (the tiny LM's files) whose config maps AutoConfig to code of its own
    evil_dir = root / "evil_model"
    shutil.copytree(tiny_lm_dir, evil_dir)
    config = json.loads((evil_dir / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel"}
    (evil_dir / "config.json").write_text(json.dumps(config))
    (evil_dir / "evil.py").write_text(EVIL_CODE)
    ckpt = torch.load(last, map_location="cpu", weights_only=True)
    ckpt["hyper_parameters"]["lm"] = {**ckpt["hyper_parameters"]["lm"], "name_or_path": str(evil_dir)}
    ckpt["hyper_parameters"]["lm"]["trust_remote_code"] = True
    ckpt["hyper_parameters"]["lm"]["dtype"] = "bfloat16"
    ckpt["hyper_parameters"]["backbone_task"] = "causal_lm"
    poisoned = root / "evil.ckpt"
    torch.save(ckpt, poisoned)
    return {"root": root, "last": last, "poisoned": str(poisoned), "evil_dir": str(evil_dir), "tabular": tabular}


@pytest.fixture
def marker(tmp_path, monkeypatch):
    path = tmp_path / "remote_code_ran"
    monkeypatch.setenv("EVIL_MARKER", str(path))
    yield path
    assert not path.exists(), "code named by a checkpoint's hyper-parameters ran"


def _run_config(cli):
    return yaml.safe_load(open(os.path.join(cli.trainer.log_dir, "config.yaml")))


def test_the_poisoned_folder_does_run_code_when_trusted(work, marker):
    """The control: the folder's code does run when the config itself trusts it, so the tests below mean something."""
    from transformers import AutoConfig

    with pytest.raises(RuntimeError, match="remote code from a checkpoint ran"):
        AutoConfig.from_pretrained(work["evil_dir"], trust_remote_code=True)
    assert marker.exists()
    marker.unlink()


def test_an_explicit_ckpt_path_never_configures_the_model(work, marker, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = train.main(["test", "--config", CONFIG, *SMALL, f"--ckpt_path={work['poisoned']}"])
    lm = cli.model.hparams["lm"]
    assert lm["name_or_path"] == "builtin:minilm-l6" and lm["trust_remote_code"] is False and lm["dtype"] == "auto"
    assert cli.model.hparams["backbone_task"] == "encoder"
    assert _run_config(cli)["model"]["init_args"]["lm"]["name_or_path"] == "builtin:minilm-l6"  # the config ran
    assert os.path.isfile(os.path.join(cli.trainer.log_dir, "report.json"))  # and the checkpoint's tensors tested
    # a command-line model option is applied with an explicit path too (it was silently overridden)
    cli = train.main(
        ["test", "--config", CONFIG, *SMALL, "--model.init_args.max_length=64", f"--ckpt_path={work['poisoned']}"]
    )
    assert cli.model.hparams["max_length"] == 64


def test_ckpt_path_last_behaves_like_an_explicit_path(work, marker, tmp_path, monkeypatch):
    run = tmp_path / "runs" / "preference_ensemble" / "version_0" / "checkpoints"
    run.mkdir(parents=True)
    shutil.copy(work["poisoned"], run / "last.ckpt")
    monkeypatch.chdir(tmp_path)
    cli = train.main(
        ["fit", "--config", CONFIG, *SMALL, "--trainer.max_steps=2", "--test_after_fit=false", "--ckpt_path=last"]
    )
    assert cli.trainer.global_step == 2  # resumed at step 1 from the poisoned file's tensors
    assert cli.model.hparams["lm"]["name_or_path"] == "builtin:minilm-l6"
    assert cli.model.hparams["lm"]["trust_remote_code"] is False


def test_load_frozen_and_the_utility_build_from_the_callers_arguments(work, marker):
    from alignment_games.modules.preference import EnsembleUtility

    model = PreferenceEnsemble.load_frozen(work["poisoned"], num_members=2)
    assert model.hparams["lm"]["name_or_path"] == "builtin:minilm-l6" and not model.hparams["lm"]["trust_remote_code"]
    saved = torch.load(work["poisoned"], map_location="cpu", weights_only=True)["state_dict"]
    assert torch.equal(model.head.weight, saved["head.weight"])  # the tensors did load
    utility = EnsembleUtility(checkpoint=work["poisoned"], num_members=2)
    assert utility.ensemble.hparams["lm"]["name_or_path"] == "builtin:minilm-l6"
    assert torch.equal(utility.ensemble.head.weight, saved["head.weight"])
    with pytest.raises(ValueError, match="hparams_file"):
        PreferenceEnsemble.load_from_checkpoint(work["poisoned"], hparams_file="h.yaml", num_members=2)


def test_a_checkpoint_of_another_family_is_refused_naming_both(work, marker, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    both = r"modules\.tabular_smida\.TabularSMIDA.*modules\.preference\.PreferenceEnsemble"
    for command in ("test", "fit"):
        with pytest.raises(ValueError, match=both):
            train.main([command, "--config", CONFIG, *SMALL, "--trainer.max_steps=2", f"--ckpt_path={work['tabular']}"])
    assert not (tmp_path / "runs" / "preference_ensemble" / "version_0" / "config.yaml").exists()  # nothing ran
    with pytest.raises(ValueError, match=both):
        PreferenceEnsemble.load_frozen(work["tabular"], num_members=2)
    # a stamp edited to another family is refused too, whatever the hyper-parameters say
    ckpt = torch.load(work["last"], map_location="cpu", weights_only=True)
    assert ckpt["family"] == "alignment_games.modules.preference.PreferenceEnsemble"
    ckpt["family"] = "alignment_games.modules.grpo.GRPO"
    torch.save(ckpt, tmp_path / "other.ckpt")
    with pytest.raises(ValueError, match=r"modules\.grpo\.GRPO.*modules\.preference\.PreferenceEnsemble"):
        train.main(["test", "--config", CONFIG, *SMALL, f"--ckpt_path={tmp_path / 'other.ckpt'}"])


def test_tensors_that_do_not_fit_the_config_are_refused_naming_both(work, marker, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ValueError, match=r"'head\.weight' has shape \[2, 16, 384\] in the checkpoint but \[3, 16, 384\]"
    ):
        train.main(
            ["test", "--config", CONFIG, *SMALL, "--model.init_args.num_members=3", f"--ckpt_path={work['last']}"]
        )
    with pytest.raises(ValueError, match=r"'head\.weight' has shape \[2, 16, 384\].*\[3, 16, 384\]"):
        PreferenceEnsemble.load_frozen(work["last"], num_members=3)
    ckpt = torch.load(work["last"], map_location="cpu", weights_only=True)
    ckpt["state_dict"]["head.extra"] = torch.zeros(2)
    torch.save(ckpt, tmp_path / "extra.ckpt")
    with pytest.raises(ValueError, match=r"holds tensors the config's model .* does not have: \['head\.extra'\]"):
        train.main(["test", "--config", CONFIG, *SMALL, f"--ckpt_path={tmp_path / 'extra.ckpt'}"])
    del ckpt["state_dict"]["head.extra"], ckpt["state_dict"]["head.rho"]
    torch.save(ckpt, tmp_path / "missing.ckpt")
    with pytest.raises(KeyError, match=r"lacks trainable tensors .*\['head\.rho'\]"):
        PreferenceEnsemble.load_frozen(str(tmp_path / "missing.ckpt"), num_members=2)


def test_every_familys_load_from_checkpoint_ignores_the_stored_hyper_parameters(work, marker, tmp_path, tiny_lm_dir):
    from alignment_games.modules.grpo import GRPO
    from alignment_games.modules.lm.model_config import ModelConfig
    from alignment_games.modules.tabular_smida import TabularSMIDA

    ckpt = torch.load(work["tabular"], map_location="cpu", weights_only=True)
    ckpt["hyper_parameters"].update(game_path=str(tmp_path / "elsewhere.pt"), dtype="float32", num_actions=3)
    torch.save(ckpt, tmp_path / "tabular.ckpt")
    model = TabularSMIDA.load_from_checkpoint(tmp_path / "tabular.ckpt")  # the arguments given: none, the defaults
    assert model.hparams["game_path"] is None and model.log_pi.dtype == torch.float64
    assert torch.equal(model.log_pi, ckpt["state_dict"]["log_pi"]) and int(model.iteration) == 2
    with pytest.raises(ValueError, match=r"weights_only"):
        TabularSMIDA.load_from_checkpoint(tmp_path / "tabular.ckpt", weights_only=False)
    # the language-model games' base refuses another family's checkpoint the same way
    lm = ModelConfig(tiny_lm_dir, lora_r=4, lora_alpha=8)
    with pytest.raises(ValueError, match=r"modules\.preference\.PreferenceEnsemble.*modules\.grpo\.GRPO"):
        GRPO.load_from_checkpoint(work["last"], lm=lm, chat_template=False)


def _rates(optimizer_state: dict) -> set[float]:
    return {group["lr"] for group in optimizer_state["param_groups"]}


@pytest.mark.e2e  # a preference fit, 13-16 s on 2 busy cores; the mechanism: test_callbacks_given_settings.py
def test_an_explicit_checkpoint_resumes_with_the_given_learning_rate(work, tmp_path, monkeypatch):
    """Lightning restored the stored param groups whole: ``--model.init_args.lr=0.5`` trained at the stored 0.01."""
    monkeypatch.chdir(tmp_path)
    assert [_rates(s) for s in torch.load(work["last"], weights_only=True)["optimizer_states"]] == [{0.01}]
    args = ["fit", "--config", CONFIG, *SMALL, "--trainer.max_steps=2", "--test_after_fit=false"]
    cli = train.main([*args, "--model.init_args.lr=0.5", f"--ckpt_path={work['last']}"])
    assert cli.trainer.global_step == 2
    (optimizer,) = cli.trainer.optimizers
    assert _rates(optimizer.state_dict()) == {0.5}  # the given rate, after one resumed step
    assert {float(state["step"]) for state in optimizer.state.values()} == {2.0}  # the stored moments went on
    saved = torch.load(os.path.join(cli.trainer.log_dir, "checkpoints", "last.ckpt"), weights_only=True)
    assert [_rates(s) for s in saved["optimizer_states"]] == [{0.5}]  # the next checkpoint shows it
    assert yaml.safe_load(saved["run_config"])["model"]["init_args"]["lr"] == 0.5


@pytest.mark.e2e
def test_a_resume_whose_frozen_backbone_changed_is_refused_naming_the_folder(tmp_path, monkeypatch):
    """The ensemble's frozen backbone is reloaded from its path: other weights there (same size) are refused."""
    from alignment_games.modules.lm.models import resolve_name_or_path

    backbone = tmp_path / "backbone"
    shutil.copytree(resolve_name_or_path("builtin:minilm-l6"), backbone)
    monkeypatch.chdir(tmp_path)
    args = [
        "fit",
        "--config",
        CONFIG,
        *SMALL,
        "--test_after_fit=false",
        f"--model.init_args.lm.name_or_path={backbone}",
    ]
    train.main([*args, "--trainer.max_steps=1"])
    weights = backbone / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-64:] = bytes(64) if raw[-64:] != bytes(64) else b"\x01" * 64  # other weights, the same size
    weights.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="what the run reads changed") as err:
        train.main([*args, "--trainer.max_steps=2", "--ckpt_path=last"])
    assert f"the model folder {str(backbone)!r} (model.init_args.lm.name_or_path): sha256 " in str(err.value)
    (last,) = glob.glob(str(tmp_path / "runs" / "preference_ensemble" / "version_0" / "checkpoints" / "last.ckpt"))
    assert torch.load(last, weights_only=True)["global_step"] == 1  # nothing ran
