"""Export: the players' adapters as peft folders that plain peft/transformers load to the suite's own log-probs."""

import dataclasses
import json
import os
import shutil

import lightning as L
import pytest
import torch
import yaml
from helpers import ROOT
from helpers.callback_helpers import make_trainer
from helpers.corrupt import change_a_number
from helpers.deep_smida import tiny_deep_smida
from helpers.threads import one_torch_thread
from safetensors.torch import load_file

from alignment_games import train
from alignment_games.modules.checkpoints.export import EXPORT_RECORD, export_module, run_record
from alignment_games.modules.deep_smida import DeepSMIDA
from alignment_games.modules.grpo import GRPO
from alignment_games.modules.lm.base_identity import base_identity
from alignment_games.modules.lm.model_config import ModelConfig
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.scorers.utility import Utility

PROMPTS = ["What is 2 + 3?", "Name a colour.", "x"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: the tiny model's ops gain nothing from more, and the machine's cores are shared."""
    with one_torch_thread():
        yield


class LengthUtility(Utility):
    """u = distinct characters of the follower's reply / 50: a real function of the text."""

    def forward(self, prompts, leader, follower):
        return torch.tensor([len(set(y)) / 50.0 for y in follower], dtype=torch.float32)


def _perturb(bank, seed):
    """Non-zero LoRA B (peft starts it at zero, where every adapter is the base): a different draw per player."""
    for i, player in enumerate(bank.player_names):
        gen = torch.Generator().manual_seed(seed + i)
        with torch.no_grad():
            for name, p in bank.model.named_parameters():
                if f".{player}." in name and "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def _smida(tiny_lm_dir):
    model = tiny_deep_smida(tiny_lm_dir, LengthUtility(), sampling=Sampling(temperature=1.0, max_new_tokens=6))
    _perturb(model.players, seed=1)
    return model


def _rollout(bank, player, seed=0):
    torch.manual_seed(seed)
    return bank.generate(player, PROMPTS, 2, Sampling(max_new_tokens=6))


def _plain_logprobs(model, rollout):
    """Per-token log-probs of each row's completion by a plain forward of its unpadded tokens: ``[N, C]``."""
    out = torch.zeros(rollout.completion_mask.shape)
    width = rollout.prompt_width
    for i in range(rollout.sequences.shape[0]):
        ids = rollout.sequences[i][rollout.attention_mask[i].bool()]
        p, c = int(rollout.attention_mask[i, :width].sum()), int(rollout.completion_mask[i].sum())
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids[None]).logits[0].float(), dim=-1)
        out[i, :c] = lp[p - 1 : p + c - 1].gather(1, ids[p : p + c, None])[:, 0]
    return out


def _suite_logprobs(bank, player, rollout):
    with torch.no_grad():
        return bank.token_logprobs(player, rollout, temperature=1.0)


def _check_loads_to_the_suites_logprobs(bank, out, player, base_dir, merged=True):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    roll = _rollout(bank, player)
    suite = _suite_logprobs(bank, player, roll)
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), os.path.join(out, player))
    torch.testing.assert_close(_plain_logprobs(adapter, roll), suite, atol=1e-5, rtol=0)
    if merged:
        merged_model = AutoModelForCausalLM.from_pretrained(os.path.join(out, "merged", player))
        torch.testing.assert_close(_plain_logprobs(merged_model, roll), suite, atol=1e-5, rtol=0)
    # the adapter matters: the base alone is far from these numbers (so the comparison above can fail)
    base = _plain_logprobs(AutoModelForCausalLM.from_pretrained(base_dir), roll)
    assert (base - suite).abs().max() > 1e-2


def test_exported_adapters_and_merged_models_give_the_suites_logprobs(tiny_decoder_dir, tmp_path):
    tiny_lm_dir = tiny_decoder_dir  # the tiny Qwen2, then the tiny Llama
    model = _smida(tiny_lm_dir)
    out = tmp_path / "export"
    assert export_module(model, out, merge=True) == ["leader", "follower"]
    for player in ("leader", "follower"):
        _check_loads_to_the_suites_logprobs(model.players, str(out), player, tiny_lm_dir)
        record = json.loads((out / player / EXPORT_RECORD).read_text())
        assert record["base_model_name_or_path"] == tiny_lm_dir and record["adapter"] == player
        assert record["kind"] == "lora_adapter" and record["family"] == "alignment_games.modules.deep_smida.DeepSMIDA"
        assert json.loads((out / "merged" / player / EXPORT_RECORD).read_text())["kind"] == "merged_model"
        assert (out / player / "tokenizer_config.json").exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # the staging folder is gone


def test_two_players_adapters_are_their_own_weights(tiny_decoder_dir, tmp_path):
    tiny_lm_dir = tiny_decoder_dir  # the tiny Qwen2, then the tiny Llama
    model = _smida(tiny_lm_dir)
    export_module(model, tmp_path / "x")
    saved = {p: load_file(tmp_path / "x" / p / "adapter_model.safetensors") for p in ("leader", "follower")}
    assert saved["leader"].keys() == saved["follower"].keys() and saved["leader"]
    for key in saved["leader"]:
        assert not torch.equal(saved["leader"][key], saved["follower"][key])
    params = dict(model.players.model.named_parameters())
    for player, tensors in saved.items():
        for key, value in tensors.items():  # peft's names without the adapter's: ...lora_A.weight
            own = params[key.replace(".lora_A.", f".lora_A.{player}.").replace(".lora_B.", f".lora_B.{player}.")]
            assert torch.equal(value, own.detach())


def test_the_record_names_the_base_and_its_revision(tiny_lm_dir, tmp_path):
    model = _smida(tiny_lm_dir)
    model.players.lm = dataclasses.replace(model.players.lm, revision="v1.2")
    export_module(model, tmp_path / "x", players=["follower"])
    assert sorted(os.listdir(tmp_path / "x")) == ["follower"]
    record = json.loads((tmp_path / "x" / "follower" / EXPORT_RECORD).read_text())
    assert (record["base_model_name_or_path"], record["base_revision"]) == (tiny_lm_dir, "v1.2")
    assert record["base_identity"] == base_identity(tiny_lm_dir, "v1.2") and record["base_identity"]["sha256"]
    adapter_config = json.loads((tmp_path / "x" / "follower" / "adapter_config.json").read_text())
    assert (adapter_config["base_model_name_or_path"], adapter_config["revision"]) == (tiny_lm_dir, "v1.2")
    assert adapter_config["r"] == 4 and adapter_config["inference_mode"] is True


def test_bad_players_and_out_folders_are_refused(tiny_lm_dir, tmp_path):
    model = _smida(tiny_lm_dir)
    with pytest.raises(KeyError, match=r"unknown player\(s\) \['nobody'\].*'follower', 'leader'"):
        export_module(model, tmp_path / "a", players=["nobody"])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="full.*not an empty folder"):
        export_module(model, tmp_path / "full")
    assert os.listdir(tmp_path / "full") == ["keep.txt"]
    (tmp_path / "empty").mkdir()
    export_module(model, tmp_path / "empty", players=["leader"])  # an empty folder is taken
    assert os.listdir(tmp_path / "empty") == ["leader"]


def test_fit_writes_the_players_adapters_under_the_log_dir(tiny_lm_dir, tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from alignment_games.datamodules.prompts import PromptDataModule

    L.seed_everything(0)
    model = _smida(tiny_lm_dir)
    trainer = L.Trainer(
        max_steps=1,
        accelerator="cpu",
        logger=CSVLogger(tmp_path, name="run"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
    )
    trainer.fit(model, PromptDataModule(num_prompts=8, batch_size=1))
    out = tmp_path / "run" / "version_0" / "export"
    assert sorted(os.listdir(out)) == ["follower", "leader"]
    record = json.loads((out / "leader" / EXPORT_RECORD).read_text())
    assert record["global_step"] == trainer.global_step and record["written_at"] == "end of fit"
    _check_loads_to_the_suites_logprobs(model.players, str(out), "leader", tiny_lm_dir, merged=False)


# ------------------------------------------------------------------------------------------------ the command
def _grpo_args(tiny_lm_dir):
    return dict(
        lm={"name_or_path": tiny_lm_dir, "lora_r": 4, "lora_alpha": 8},
        policy_gradient={"group_size": 2, "kl_coef": 0.04},
        sampling={"temperature": 1.0, "max_new_tokens": 6},
        chat_template=False,
    )


@pytest.fixture
def grpo_run(tiny_lm_dir, tmp_path):
    """A GRPO module with non-zero adapters, its one-file checkpoint (as a fit saves it) and its config."""
    args = _grpo_args(tiny_lm_dir)
    model = GRPO(**{**args, "lm": ModelConfig(**args["lm"]), "sampling": Sampling(**args["sampling"])})
    _perturb(model.players, seed=5)
    checkpoint = {"state_dict": model.state_dict(), "global_step": 7, "hyper_parameters": dict(model.hparams)}
    model.on_save_checkpoint(checkpoint)  # trimmed to the adapters and stamped, as Lightning's save does
    ckpt = tmp_path / "last.ckpt"
    torch.save(checkpoint, ckpt)
    config = tmp_path / "grpo.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "seed_everything": 0,
                "trainer": {"max_steps": 3, "accelerator": "gpu"},  # read, never built: no GPU needed to export
                "model": {"class_path": "alignment_games.modules.grpo.GRPO", "init_args": args},
                "data": {
                    "class_path": "alignment_games.datamodules.prompts.PromptDataModule",
                    "init_args": {"num_prompts": 8},
                },
            }
        )
    )
    return model, str(ckpt), str(config)


def test_the_export_command_writes_a_checkpoints_adapter_and_merged_model(grpo_run, tiny_lm_dir, tmp_path):
    model, ckpt, config = grpo_run
    out = tmp_path / "out"
    assert train.dispatch(["export", "--config", config, "--ckpt_path", ckpt, "--out", str(out), "--merge", "true"])
    assert sorted(os.listdir(out)) == ["merged", "policy"]
    _check_loads_to_the_suites_logprobs(model.players, str(out), "policy", tiny_lm_dir)
    record = json.loads((out / "policy" / EXPORT_RECORD).read_text())
    assert record["checkpoint"] == os.path.abspath(ckpt) and record["global_step"] == 7
    assert not train.dispatch(["fit", "--config", config])  # other subcommands are LightningCLI's


def test_the_record_carries_the_runs_seed_and_a_hash_of_its_config(grpo_run, tmp_path, monkeypatch):
    _, ckpt, config = grpo_run
    cfg = yaml.safe_load(open(config))
    record = run_record(yaml.safe_dump(cfg))
    assert record["seed"] == 0 and len(record["config_sha256"]) == 64
    # the same config laid out otherwise, or resumed from a checkpoint: the same hash
    reordered = yaml.safe_dump({"ckpt_path": "last", **dict(reversed(cfg.items()))}, sort_keys=False)
    assert run_record(reordered) == record
    seed1 = run_record(yaml.safe_dump({**cfg, "seed_everything": 1}))
    assert seed1["seed"] == 1 and seed1["config_sha256"] != record["config_sha256"]
    cfg["model"]["init_args"]["lm"]["lora_r"] = 8  # another config, the same seed
    other = run_record(yaml.safe_dump(cfg))
    assert other["seed"] == 0 and other["config_sha256"] != record["config_sha256"]
    monkeypatch.setenv("PL_GLOBAL_SEED", "5")
    assert run_record(None) == {"seed": 5, "config_sha256": None}  # no config: the seed this process was given
    # the export command takes both from the checkpoint's record of its run's config
    checkpoint = torch.load(ckpt, weights_only=True)
    checkpoint["run_config"] = open(config).read()
    torch.save(checkpoint, tmp_path / "recorded.ckpt")
    out = tmp_path / "out"
    train.dispatch(["export", "--config", config, "--ckpt_path", str(tmp_path / "recorded.ckpt"), "--out", str(out)])
    exported = json.loads((out / "policy" / EXPORT_RECORD).read_text())
    assert (exported["seed"], exported["config_sha256"]) == (0, record["config_sha256"])


def test_the_export_command_refuses_bad_input(grpo_run, tmp_path):
    _, ckpt, config = grpo_run
    run = ["export", "--config", config, "--out", str(tmp_path / "out")]
    with pytest.raises(FileNotFoundError, match="--ckpt_path: checkpoint .*missing.ckpt' is not a file"):
        train.dispatch([*run, "--ckpt_path", str(tmp_path / "missing.ckpt")])
    with pytest.raises(IsADirectoryError, match="sharded checkpoint folder"):
        train.dispatch([*run, "--ckpt_path", str(tmp_path)])
    with pytest.raises(KeyError, match=r"unknown player\(s\) \['leader'\].*\['policy'\]"):
        train.dispatch([*run, "--ckpt_path", ckpt, "--players", "[leader]"])
    (tmp_path / "out" / "x").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="out.*not an empty folder"):
        train.dispatch([*run, "--ckpt_path", ckpt])
    # a checkpoint of another family is refused by the trust rule before any tensor is loaded
    other = torch.load(ckpt, weights_only=True)
    other["family"] = "alignment_games.modules.debate.DebateSelfPlay"
    torch.save(other, tmp_path / "other.ckpt")
    wrong_family = (
        "written by alignment_games.modules.debate.DebateSelfPlay.*config's model is alignment_games.modules.grpo"
    )
    with pytest.raises(ValueError, match=wrong_family):
        train.dispatch([*run[:-1], str(tmp_path / "new"), "--ckpt_path", str(tmp_path / "other.ckpt")])
    # ... and one whose adapters do not fit the config's (another LoRA rank), naming the tensor and both shapes
    rank8 = yaml.safe_load(open(config))
    rank8["model"]["init_args"]["lm"]["lora_r"] = 8
    (tmp_path / "rank8.yaml").write_text(yaml.safe_dump(rank8))
    with pytest.raises(ValueError, match=r"lora_A.policy.weight' has shape \[4, 64\] in the checkpoint but \[8, 64\]"):
        train.dispatch(
            ["export", "--config", str(tmp_path / "rank8.yaml"), "--ckpt_path", ckpt, "--out", str(tmp_path / "n")]
        )
    assert not (tmp_path / "new").exists() and not (tmp_path / "n").exists()


def test_the_export_command_refuses_a_checkpoint_whose_bytes_changed_naming_it(grpo_run, tmp_path):
    from alignment_games.callbacks.fault_tolerance import AtomicCheckpointIO

    _, ckpt, config = grpo_run
    saved = str(tmp_path / "sealed.ckpt")
    checkpoint = torch.load(ckpt, weights_only=True)
    AtomicCheckpointIO().save_checkpoint(checkpoint, saved)  # as a fit saves it: with its sha256 beside it
    change_a_number(saved, next(v for v in checkpoint["state_dict"].values() if v.is_floating_point()))
    with pytest.raises(ValueError, match=f"checkpoint {saved!r} is corrupt: its sha256 is"):
        train.dispatch(["export", "--config", config, "--ckpt_path", saved, "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ other layouts
def test_full_copies_are_exported_as_models_with_the_suites_logprobs(tiny_decoder_dir, tmp_path):
    """``players: separate``: each player's folder is a whole transformers model; there is nothing to merge."""
    from transformers import AutoModelForCausalLM

    tiny_lm_dir = tiny_decoder_dir  # the tiny Qwen2, then the tiny Llama
    model = DeepSMIDA(
        lm=ModelConfig(tiny_lm_dir, players="separate"),
        utility=LengthUtility(),
        samples_per_prompt=2,
        follower_samples=2,
        sampling=Sampling(temperature=1.0, max_new_tokens=6),
    )
    for i, copy in enumerate(model.players.models.values()):  # each copy trained its own way
        with torch.no_grad():
            for p in copy.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.02)
    export_module(model, tmp_path / "x", merge=True)
    assert sorted(os.listdir(tmp_path / "x")) == ["follower", "leader"]  # no merged/: the players are whole
    for player in ("leader", "follower"):
        assert json.loads((tmp_path / "x" / player / EXPORT_RECORD).read_text())["kind"] == "full_model"
        roll = _rollout(model.players, player)
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "x" / player)
        torch.testing.assert_close(_plain_logprobs(plain, roll), _suite_logprobs(model.players, player, roll))


@pytest.mark.parametrize("other_architecture", ["qwen2", "llama"])
def test_pool_players_on_their_own_bases_record_each_base(tiny_lm_dir, tmp_path, other_architecture):
    """Three players, the middle one on another base: another Qwen2, or a Llama among Qwen2s."""
    from alignment_games.modules.lm.models import build_tiny_causal_lm
    from alignment_games.modules.pool import StackelbergPool

    other = build_tiny_causal_lm(tmp_path / "other_base", seed=7, architecture=other_architecture)
    pool = StackelbergPool(
        lm={"name_or_path": tiny_lm_dir, "lora_r": 4, "lora_alpha": 8},
        models=[tiny_lm_dir, other, tiny_lm_dir],
        sampling=Sampling(temperature=1.0, max_new_tokens=6),
    )
    for i, bank in enumerate(pool.banks):
        _perturb(bank, seed=10 * i)
    export_module(pool, tmp_path / "x")
    bases = {
        p: json.loads((tmp_path / "x" / p / EXPORT_RECORD).read_text())["base_model_name_or_path"]
        for p in pool.player_names
    }
    assert bases == {"m0": tiny_lm_dir, "m1": other, "m2": tiny_lm_dir}
    _check_loads_to_the_suites_logprobs(pool.bank("m1"), str(tmp_path / "x"), "m1", other, merged=False)


def test_sft_records_its_base_and_its_checkpoint_exports(tiny_lm_dir, tmp_path):
    """SFT's own save (output_dir) carries the same record; ``train.py export`` takes an SFT checkpoint too."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from alignment_games.datamodules.sft import ArithmeticSFTDataModule
    from alignment_games.modules.sft import CausalLMSFT

    L.seed_everything(0)
    lm = {"name_or_path": tiny_lm_dir, "lora_r": 4, "lora_alpha": 8}
    model = CausalLMSFT(lm=ModelConfig(**lm), lora=True, output_dir=str(tmp_path / "sft"), max_length=64, lr=1e-2)
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = make_trainer(
        tmp_path, [ckpt], max_steps=1, max_epochs=None, limit_val_batches=0, enable_checkpointing=True
    )
    trainer.fit(model, ArithmeticSFTDataModule(num_prompts=8, batch_size=4))
    record = json.loads((tmp_path / "sft" / EXPORT_RECORD).read_text())
    assert (record["base_model_name_or_path"], record["kind"], record["global_step"]) == (
        tiny_lm_dir,
        "lora_adapter",
        1,
    )
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".sft_save")]
    config = tmp_path / "sft.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {
                    "class_path": "alignment_games.modules.sft.CausalLMSFT",
                    "init_args": {"lm": lm, "lora": True, "output_dir": str(tmp_path / "sft2")},
                }
            }
        )
    )
    out = tmp_path / "out"
    train.dispatch(
        ["export", "--config", str(config), "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt"), "--out", str(out)]
    )
    # the command's adapter is the one SFT saved at the end of fit: the same tensors
    assert (
        load_file(out / "policy" / "adapter_model.safetensors").keys()
        == load_file(tmp_path / "sft" / "adapter_model.safetensors").keys()
    )
    for key, value in load_file(out / "policy" / "adapter_model.safetensors").items():
        assert torch.equal(value, load_file(tmp_path / "sft" / "adapter_model.safetensors")[key])
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_lm_dir), out / "policy")
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in loaded.named_parameters())


def test_a_model_without_players_is_refused(grpo_run, tmp_path):
    """Tabular SMIDA and the like have no players; a model outside the suite's loader never reaches Lightning's own
    ``load_from_checkpoint`` (which would configure it from the checkpoint's hyper-parameters)."""
    with pytest.raises(TypeError, match="Linear has no language-model players to export"):
        export_module(torch.nn.Linear(2, 2), tmp_path / "x")
    _, ckpt, _ = grpo_run
    config = tmp_path / "boring.yaml"
    config.write_text(yaml.safe_dump({"model": {"class_path": "lightning.pytorch.demos.boring_classes.BoringModel"}}))
    with pytest.raises(TypeError, match="BoringModel has no language-model players"):
        train.dispatch(["export", "--config", str(config), "--ckpt_path", ckpt, "--out", str(tmp_path / "y")])
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_replace_puts_a_new_export_over_an_old_one(tiny_lm_dir, tmp_path):
    """The end of ``fit`` of a run resumed in the same folder replaces the earlier export, leaving nothing beside."""
    model = _smida(tiny_lm_dir)
    export_module(model, tmp_path / "export", replace=True)
    old = load_file(tmp_path / "export" / "leader" / "adapter_model.safetensors")
    _perturb(model.players, seed=99)
    export_module(model, tmp_path / "export", replace=True, players=["leader"])
    assert os.listdir(tmp_path) == ["export"] and os.listdir(tmp_path / "export") == ["leader"]
    new = load_file(tmp_path / "export" / "leader" / "adapter_model.safetensors")
    assert any(not torch.equal(new[k], old[k]) for k in old if "lora_B" in k)


def test_a_runs_saved_config_exports_an_adapter_that_loads_from_anywhere(tiny_lm_dir, tmp_path, monkeypatch):
    """The documented path end to end: a tiny ``fit`` of grpo_tiny.yaml (its base named, as the configs do, by a path
    relative to the project), ``export`` with the run's saved config.yaml, the adapter copied to another folder and
    loaded there, from another working folder, with plain peft on the base its adapter_config.json names."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    project = tmp_path / "project"
    shutil.copytree(tiny_lm_dir, project / "artifacts" / "tiny_policy")
    monkeypatch.chdir(project)
    cli = train.main(
        [
            "fit",
            "--config",
            os.path.join(ROOT, "configs", "grpo_tiny.yaml"),
            "--trainer.max_steps=1",
            "--trainer.accelerator=cpu",
            "--trainer.limit_val_batches=0",
            "--trainer.enable_progress_bar=false",
            "--data.init_args.num_prompts=8",
            "--model.init_args.policy_gradient.group_size=2",
            "--model.init_args.sampling.max_new_tokens=6",
            "--seed_everything=3",
        ]
    )
    log_dir = cli.trainer.log_dir
    at_fit_end = json.loads(open(os.path.join(log_dir, "export", "policy", EXPORT_RECORD)).read())
    # adapters far from the base (one GRPO step of a random policy barely moves them), saved by the run's trainer
    _perturb(cli.model.players, seed=3)
    ckpt = os.path.join(log_dir, "checkpoints", "moved.ckpt")
    cli.trainer.save_checkpoint(ckpt)
    saved_config = os.path.join(log_dir, "config.yaml")
    assert yaml.safe_load(open(saved_config))["model"]["init_args"]["lm"]["name_or_path"] == "artifacts/tiny_policy"
    assert train.dispatch(["export", "--config", saved_config, "--ckpt_path", ckpt, "--out", "exported"])

    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(project / "exported" / "policy", elsewhere / "adapter")
    monkeypatch.chdir(elsewhere)
    base = json.loads((elsewhere / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == str(project / "artifacts" / "tiny_policy")
    record = json.loads((elsewhere / "adapter" / EXPORT_RECORD).read_text())
    assert (record["base_model_name_or_path"], record["base_resolved_path"]) == ("artifacts/tiny_policy", base)
    assert record["seed"] == at_fit_end["seed"] == 3  # the run's seed and config, at the end of fit and exported
    assert record["config_sha256"] == at_fit_end["config_sha256"] and len(record["config_sha256"]) == 64
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), "adapter")
    bank = cli.model.players
    roll = _rollout(bank, "policy")
    suite = _suite_logprobs(bank, "policy", roll)
    torch.testing.assert_close(_plain_logprobs(adapter, roll), suite, atol=1e-5, rtol=0)
    assert (_plain_logprobs(AutoModelForCausalLM.from_pretrained(base), roll) - suite).abs().max() > 1e-2


def test_export_reads_every_option_a_fit_config_holds(tmp_path, monkeypatch):
    """Each top-level option of ``train.py fit`` (which a saved config.yaml holds) is read and ignored by export."""
    from alignment_games.modules.checkpoints.export import FIT_ONLY_KEYS

    monkeypatch.chdir(tmp_path)
    config = os.path.join(ROOT, "configs", "smida_tabular.yaml")
    cli = train.main(["fit", "--config", config, "--trainer.fast_dev_run=true", "--trainer.enable_progress_bar=false"])
    fit_keys = {key.split(".", 1)[0] for key in cli._subcommand_parsers["fit"].get_defaults().keys()}
    assert {"trainer", "trusted_checkpoint_sources", "weights_only"} <= fit_keys  # what is read
    assert fit_keys - {"config", "model", "ckpt_path"} <= set(FIT_ONLY_KEYS)


def _snapshot(folder):
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                files[os.path.relpath(os.path.join(root, name), folder)] = f.read()
    return files


def test_a_full_disk_during_an_export_names_the_folder_and_keeps_the_old_export(tiny_lm_dir, tmp_path, monkeypatch):
    import errno

    import safetensors.torch

    model = _smida(tiny_lm_dir)
    out = str(tmp_path / "export")
    export_module(model, out, replace=True)
    before = _snapshot(out)

    def full_disk(*args, **kwargs):  # the adapter's weights file is written when the disk fills
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    _perturb(model.players, seed=99)
    with pytest.raises(OSError) as err:
        export_module(model, out, replace=True)
    assert err.value.errno == errno.ENOSPC and isinstance(err.value.__cause__, OSError)
    assert str(err.value) == (
        f"[Errno {errno.ENOSPC}] cannot write {out}: No space left on device; its previous version is left as it was"
    )
    assert os.listdir(tmp_path) == ["export"] and _snapshot(out) == before  # no staging folder left, old export whole


@pytest.mark.parametrize("sharing", ["lora", "separate", "frozen"])
def test_the_preference_ensemble_exports_and_reloads_to_the_same_probabilities(tiny_lm_dir, tmp_path, sharing):
    """Members (adapters or copies) and heads out through ``train.py export``, back through ``from_export``."""
    from alignment_games.modules.preference import PreferenceEnsemble

    args = {"lm": {"name_or_path": tiny_lm_dir, "lora_r": 2, "lora_alpha": 8}, "backbone_task": "causal_lm"}
    args.update(num_members=2, sharing=sharing, embed_dim=4, max_length=64)
    model = PreferenceEnsemble(**{**args, "lm": ModelConfig(**args["lm"])})
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # trained-like weights: non-zero LoRA B, moved heads and copies
        for name, p in model.named_parameters():
            if p.requires_grad and ("lora_B" in name or name.startswith("head.") or sharing == "separate"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    checkpoint = {"state_dict": model.state_dict(), "global_step": 4}
    model.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, tmp_path / "last.ckpt")
    config = tmp_path / "ensemble.yaml"
    config.write_text(yaml.safe_dump({"model": {"class_path": "PreferenceEnsemble", "init_args": args}}))
    out = tmp_path / "out"
    assert train.dispatch(
        ["export", "--config", str(config), "--ckpt_path", str(tmp_path / "last.ckpt"), "--out", str(out)]
    )
    members = [] if sharing == "frozen" else ["member_0", "member_1"]
    assert sorted(os.listdir(out)) == sorted([*members, "ensemble.json", "heads.safetensors"])
    pairs = (["What is 2 + 3?", "x"], ["5", "an answer"], ["6", "another"])
    reloaded = PreferenceEnsemble.from_export(str(out))
    torch.testing.assert_close(reloaded.score(*pairs), model.eval().score(*pairs), atol=1e-6, rtol=0)
    untrained = PreferenceEnsemble(**{**args, "lm": ModelConfig(**args["lm"])}).eval().score(*pairs)
    assert (untrained - model.score(*pairs)).abs().max() > 1e-3  # the files carry what was trained
