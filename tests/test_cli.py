"""The command line does not mislead: no optimizer options that would break the families, every family listed and
resolvable by its short name, every shipped config parses, missing artifacts and untrained utilities refused with the
command that fixes them, and ``--help`` without the heavy optional packages."""

import glob
import importlib
import inspect
import os
import pkgutil
import subprocess
import sys

import lightning as L
import pytest
import yaml
from helpers import ROOT

from alignment_games import train

CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
UNTRAINED = "--model.init_args.utility.init_args.allow_untrained=true"


def _families(package: str, base: type) -> set[str]:
    """The public ``base`` subclasses defined in ``package``'s top-level modules, found by walking the package."""
    found = set()
    for info in pkgutil.iter_modules([os.path.join(ROOT, package)]):
        module = importlib.import_module(f"alignment_games.{package}.{info.name}")
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, base) and obj.__module__ == module.__name__:
                if not name.startswith("_") and not inspect.isabstract(obj):
                    found.add(f"{obj.__module__}.{name}")
    return found


def _run(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.main(args)
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def test_fit_help_lists_every_model_and_data_family(capsys):
    models = _families("modules", L.LightningModule)
    data = _families("datamodules", L.LightningDataModule)
    # the classes the shipped configs name are among them (an independent list of what must be reachable)
    named = {yaml.safe_load(open(c))[k]["class_path"] for c in CONFIGS for k in ("model", "data")}
    assert named <= models | data
    assert {
        "alignment_games.modules.grpo.GRPO",
        "alignment_games.modules.tabular_smida.TabularSMIDA",
        "alignment_games.datamodules.steps.StepDataModule",
    } <= named
    code, out, _ = _run(["fit", "--help"], capsys)
    assert code == 0
    listed = "".join(out.split())  # argparse wraps the list of known subclasses, long names mid-word
    # the bases the families share (modules/base.py) and Lightning's own are no choice a user runs
    internal = {c for c in models if c.startswith("alignment_games.modules.base.")}
    assert "alignment_games.modules.base.LanguageModelGame" in internal
    for family in sorted((models | data) - internal):
        assert family in listed, f"{family} is not listed by fit --help"
    for name in [*internal, "lightning.LightningModule,", "lightning.LightningDataModule,"]:
        assert name not in listed, f"{name} is listed by fit --help"
    assert "--optimizer" not in out and "--lr_scheduler" not in out


@pytest.mark.parametrize(
    ("model", "data", "model_path", "data_path"),
    [
        (
            "GRPO",
            "PromptDataModule",
            "alignment_games.modules.grpo.GRPO",
            "alignment_games.datamodules.prompts.PromptDataModule",
        ),
        (
            "TabularSMIDA",
            "StepDataModule",
            "alignment_games.modules.tabular_smida.TabularSMIDA",
            "alignment_games.datamodules.steps.StepDataModule",
        ),
        (
            "CausalLMSFT",
            "ArithmeticSFTDataModule",
            "alignment_games.modules.sft.CausalLMSFT",
            "alignment_games.datamodules.sft.ArithmeticSFTDataModule",
        ),
    ],
)
def test_short_class_names_resolve_for_model_and_data(model, data, model_path, data_path, capsys):
    extra = ["--model.lm.name_or_path=artifacts/tiny_policy"] if model == "GRPO" else []
    code, out, err = _run(["fit", f"--model={model}", *extra, f"--data={data}", "--print_config"], capsys)
    assert code == 0, err
    config = yaml.safe_load(out)
    assert config["model"]["class_path"] == model_path
    assert config["data"]["class_path"] == data_path


@pytest.mark.parametrize("option", ["--optimizer=Adam", "--optimizer.lr=0.1", "--lr_scheduler=StepLR"])
def test_optimizer_options_are_refused_naming_the_family_rates(option, capsys):
    config = os.path.join(ROOT, "configs", "smida_tabular.yaml")
    code, _, err = _run(["fit", "--config", config, option], capsys)
    assert code == 2
    name = option.split("=")[0].split(".")[0]
    assert f"{name} is not an option" in err
    assert "leader_lr/follower_lr" in err and "eta_leader/eta_follower" in err


def test_an_optimizer_in_a_config_file_is_refused(tmp_path, capsys):
    extra = tmp_path / "optimizer.yaml"
    extra.write_text("optimizer:\n  class_path: torch.optim.Adam\n")
    code, _, err = _run(
        ["fit", "--config", os.path.join(ROOT, "configs", "smida_tabular.yaml"), "--config", str(extra)], capsys
    )
    assert code == 2 and "optimizer" in err


@pytest.mark.parametrize("config", CONFIGS, ids=os.path.basename)
def test_every_config_prints_its_config(config, capsys):
    code, out, err = _run(["fit", "--config", config, "--print_config"], capsys)
    assert code == 0, err
    printed = yaml.safe_load(out)
    given = yaml.safe_load(open(config))
    assert printed["model"]["class_path"] == given["model"]["class_path"]
    assert printed["data"]["class_path"] == given["data"]["class_path"]
    assert "optimizer" not in printed and "lr_scheduler" not in printed


def test_configs_state_each_value_once():
    """What the code derives is not repeated: the pool's schedule length, the warm-up's targets and taus."""
    for config in CONFIGS:
        given = yaml.safe_load(open(config))
        init = given["model"].get("init_args") or {}
        if given["model"]["class_path"] == "alignment_games.modules.pool.StackelbergPool":
            assert "num_iterations" not in init, config  # trainer.max_epochs x iterations_per_epoch
            assert "players" not in (init.get("elo") or {}), config  # the pool's own players
        for callback in given.get("trainer", {}).get("callbacks") or []:
            if callback["class_path"].endswith("TwoTimescaleWarmup"):
                stated = set(callback.get("init_args") or {})
                assert not stated & {"leader_lr", "follower_lr", "tau_leader", "tau_follower"}, config


def test_deep_smida_without_a_trained_utility_refuses_to_start(tmp_path, monkeypatch, tiny_lm_dir):
    monkeypatch.chdir(tmp_path)
    config = os.path.join(ROOT, "configs", "deep_smida.yaml")
    lm = f"--model.init_args.lm.name_or_path={tiny_lm_dir}"
    with pytest.raises(ValueError, match="allow_untrained=true") as err:
        train.main(["fit", "--config", config, lm, "--trainer.fast_dev_run=true"])
    message = str(err.value)
    assert message.startswith("EnsembleUtility: no checkpoint")  # the family's refusal, not jsonargparse's summary
    assert "configs/preference_ensemble.yaml" in message and "utility.init_args.checkpoint=" in message
    # asked for by name, it is built (parse and instantiate only)
    small = {"backbone": tiny_lm_dir, "backbone_task": "causal_lm", "num_members": 2}
    utility = [f"--model.init_args.utility.init_args.{k}={v}" for k, v in small.items()]
    cli = train.main(["--config", config, lm, UNTRAINED, *utility], run=False)  # no subcommand without run
    assert cli.model.utility.ensemble.hparams.num_members == 2


def test_the_utility_refusal_comes_before_the_players_load():
    from alignment_games.modules.deep_smida import DeepSMIDA
    from alignment_games.modules.preference import EnsembleUtility

    with pytest.raises(ValueError, match="allow_untrained"):
        EnsembleUtility()
    # a missing policy folder is not reached: the utility is refused first, before anything is loaded
    with pytest.raises(ValueError, match="no checkpoint"):
        DeepSMIDA(lm="artifacts/no_such_policy")


@pytest.mark.parametrize(
    ("config", "maker"),
    [
        ("grpo_tiny.yaml", "configs/sft_tiny.yaml"),
        ("debate_ab.yaml", "configs/debate_sft_tiny.yaml"),
        ("deep_smida_small_fo.yaml", "configs/sft_small.yaml"),
    ],
)
def test_a_missing_artifact_names_the_config_that_makes_it(config, maker, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no artifacts/ here
    extra = [UNTRAINED] if config.startswith("deep_smida") else []  # past the utility's own refusal
    with pytest.raises(OSError, match="does not exist") as err:
        train.main(["fit", "--config", os.path.join(ROOT, "configs", config), *extra, "--trainer.fast_dev_run=true"])
    message = str(err.value)
    assert message.startswith("lm.name_or_path: the model folder 'artifacts/")
    assert f"`python train.py fit --config {maker}`" in message
    assert "hub" not in message


def test_provenance_of_local_paths(tmp_path, monkeypatch):
    from alignment_games.modules.checkpoints.trust import read_checkpoint
    from alignment_games.modules.training.provenance import looks_local, producing_config

    monkeypatch.chdir(tmp_path)
    assert producing_config("artifacts/tiny_policy") == "configs/sft_tiny.yaml"
    assert producing_config("./artifacts/small_policy/") == "configs/sft_small.yaml"
    assert producing_config(tmp_path / "artifacts" / "tiny_debate_policy") == "configs/debate_sft_tiny.yaml"
    ckpt = "runs/preference_ensemble/version_0/checkpoints/last.ckpt"
    assert producing_config(ckpt) == "configs/preference_ensemble.yaml"
    assert producing_config("artifacts/tiny_policy_v2") is None  # a prefix of a name is not the folder
    assert producing_config("Qwen/Qwen2.5-1.5B-Instruct") is None
    with pytest.raises(FileNotFoundError, match="configs/preference_ensemble.yaml"):
        read_checkpoint(ckpt)
    # hub names stay hub names; the suite's output folders and deeper paths are local
    assert not looks_local("Qwen/Qwen2.5-1.5B-Instruct") and not looks_local("gpt2")
    assert looks_local("artifacts/tiny_policy") and looks_local("runs/x") and looks_local("a/b/c")
    # a config of one's own: read from the folder given, by its output_dir
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "warm.yaml").write_text("model:\n  init_args:\n    output_dir: artifacts/mine\n")
    assert producing_config("artifacts/mine", configs_dir=tmp_path / "mine") == "configs/warm.yaml"


def test_help_works_without_the_heavy_optional_packages():
    """``python train.py --help`` and ``fit --help`` in one fresh interpreter, which then lists what the suite imported.

    A heavy package counts when the suite's own code asks for it, directly or through a module it imports; one that a
    third-party package imports for itself does not (transformers below 5.20 imports scikit-learn whenever installed).
    """
    probe = (
        "import os, runpy, sys, traceback\n"
        "heavy = ('peft', 'datasets', 'sklearn', 'sentence_transformers', 'bitsandbytes', 'deepspeed')\n"
        "ours, seen = os.path.realpath('.') + os.sep, []\n"
        "class Watch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name in heavy and name not in sys.modules:\n"
        "            frames = [f.filename for f in traceback.extract_stack()[:-1] if 'importlib' not in f.filename]\n"
        "            importer = os.path.realpath(frames[-1])\n"
        "            if importer.startswith(ours) and 'site-packages' not in importer:\n"
        "                seen.append(name)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Watch())\n"
        "for argv in (['train.py', '--help'], ['train.py', 'fit', '--help']):\n"
        "    sys.argv = argv\n"
        "    try:\n"
        "        runpy.run_path('train.py', run_name='__main__')\n"
        "    except SystemExit as e:\n"
        "        assert e.code in (0, None), e.code\n"
        "print('HEAVY', sorted(set(seen)))\n"
    )
    env = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "{fit,validate,test,predict" in proc.stdout  # the subcommands, from the top-level help
    assert "alignment_games.modules.deep_smida.DeepSMIDA" in " ".join(proc.stdout.split())
    assert proc.stdout.strip().splitlines()[-1] == "HEAVY []"


def test_help_lists_export(capsys):
    """``train.py --help`` names the ``export`` subcommand (run by :func:`train.dispatch`, not by LightningCLI)."""
    code, out, _ = _run(["--help"], capsys)
    assert code == 0
    text = " ".join(out.split())
    assert "and export: python train.py export --config <run's config.yaml> --ckpt_path <ckpt> --out <dir>" in text
    assert "python train.py export --help; docs/export.md" in text


SMIDA = os.path.join(ROOT, "configs", "smida_tabular.yaml")
DEBATE = os.path.join(ROOT, "configs", "debate_ab.yaml")
LR_MONITOR = "lightning.pytorch.callbacks.LearningRateMonitor"


@pytest.mark.parametrize("replace", [[f"--trainer.callbacks={LR_MONITOR}"], ["--trainer.callbacks", LR_MONITOR]])
def test_replacing_the_configs_callbacks_is_refused_naming_the_append_form(replace, capsys):
    code, _, err = _run(["fit", "--config", DEBATE, *replace], capsys)
    assert code == 2
    err = " ".join(err.split())
    dropped = (
        "['alignment_games.callbacks.MCCTracker', 'alignment_games.callbacks.PeakCheckpoint', "
        "'lightning.pytorch.callbacks.ModelCheckpoint']"
    )
    assert f"--trainer.callbacks: the value given replaces the config's callbacks and drops {dropped}" in err
    assert "--trainer.callbacks+=CLASS" in err and "clear them first with --trainer.callbacks=[]" in err


def _callback_classes(cli):
    return [type(c).__name__ for c in cli.trainer.callbacks]


@pytest.mark.parametrize(
    "given",
    [
        [f"--trainer.callbacks+={LR_MONITOR}"],  # appended to the config's
        [f"--trainer.callbacks=[lightning.pytorch.callbacks.ModelCheckpoint, {LR_MONITOR}]"],  # keeps the config's
    ],
)
def test_adding_a_callback_keeps_the_configs(given, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = train.main(["fit", "--config", SMIDA, *given, "--trainer.fast_dev_run=true"])
    classes = _callback_classes(cli)
    assert "LearningRateMonitor" in classes and "ModelCheckpoint" in classes


def test_a_deliberate_clear_then_append_replaces_the_configs_callbacks(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    given = ["--trainer.callbacks=[]", f"--trainer.callbacks+={LR_MONITOR}", "--trainer.enable_checkpointing=false"]
    cli = train.main(["fit", "--config", SMIDA, *given, "--trainer.fast_dev_run=true"])
    classes = _callback_classes(cli)
    assert "LearningRateMonitor" in classes and "ModelCheckpoint" not in classes


def test_the_progress_bar_counts_the_runs_steps(tmp_path, monkeypatch):
    """Lightning's rich bar read ``Epoch 0/-2`` for a run bounded by ``max_steps`` (``max_epochs`` is then -1)."""
    from lightning.pytorch.callbacks import RichProgressBar

    from alignment_games.callbacks.progress import train_description

    monkeypatch.chdir(tmp_path)
    cli = train.main(["fit", "--config", SMIDA, "--trainer.max_steps=3", "--trainer.logger=false"])
    assert cli.trainer.max_epochs == -1 and cli.trainer.global_step == 3
    bar = cli.trainer.progress_bar_callback
    if isinstance(bar, RichProgressBar):  # the label drawn last
        shown = next(t.description for t in bar.progress.tasks if t.id == bar.train_progress_bar_id)
    else:
        shown = bar.train_progress_bar.desc
    assert shown.strip().rstrip(":") == "Epoch 0, step 3/3"
    # the label from the limits that are set: Lightning's zero-based last epoch, the steps of max_steps
    assert train_description(L.Trainer(max_epochs=4, logger=False)) == "Epoch 0/3"
    assert train_description(L.Trainer(max_steps=200, logger=False)) == "Epoch 0, step 0/200"
    assert train_description(L.Trainer(max_epochs=2, max_steps=9, logger=False)) == "Epoch 0/1, step 0/9"


def test_a_config_without_a_progress_bar_flag_gets_none(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = train.main(["fit", "--config", SMIDA, "--trainer.fast_dev_run=true", "--trainer.enable_progress_bar=false"])
    assert cli.trainer.progress_bar_callback is None


def test_a_run_without_a_logger_writes_under_runs(tmp_path, monkeypatch):
    """Without a logger Lightning writes in ``default_root_dir``, the working folder by default (the repository)."""
    monkeypatch.chdir(tmp_path)
    train.main(["fit", "--config", SMIDA, "--trainer.max_steps=2", "--trainer.logger=false"])
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == [
        os.path.join("runs", "no_logger", "checkpoints", "last.ckpt"),
        os.path.join("runs", "no_logger", "checkpoints", "last.ckpt.sha256"),
        os.path.join("runs", "no_logger", "config.yaml"),
        os.path.join("runs", "no_logger", "smida_result.pt"),
    ]


@pytest.mark.parametrize(
    ("config", "old", "new"),
    [
        ("grpo_tiny.yaml", "beta", "policy_gradient.kl_coef"),
        ("grpo_tiny.yaml", "num_generations", "policy_gradient.group_size"),
        ("debate_ab.yaml", "kl_beta", "policy_gradient.kl_coef"),
        ("pool_grpo.yaml", "followers.grpo_rollouts", "followers.policy_gradient.group_size"),
    ],
)
def test_an_option_folded_into_policy_gradient_is_refused_naming_its_new_name(config, old, new, tmp_path, capsys):
    family = yaml.safe_load(open(os.path.join(ROOT, "configs", config)))["model"]["class_path"].rsplit(".", 1)[-1]
    with pytest.raises(SystemExit):
        train.main(["fit", "--config", os.path.join(ROOT, "configs", config), f"--model.init_args.{old}=2"], run=False)
    assert (
        f"model.init_args.{old} (the command line) is now model.init_args.{new} for {family}" in capsys.readouterr().err
    )
    # the same old name written in a config file (an old config) is named with the file
    old_config = tmp_path / "old.yaml"
    head, _, leaf = old.rpartition(".")
    init = {head: {leaf: 2}} if head else {leaf: 2}
    old_config.write_text(yaml.safe_dump({"model": {"class_path": family, "init_args": init}}))
    with pytest.raises(SystemExit):
        train.main(["fit", "--config", str(old_config)], run=False)
    assert f"model.init_args.{old} ({old_config}) is now model.init_args.{new}" in capsys.readouterr().err


def test_a_name_retired_for_one_family_is_still_another_familys_option():
    assert (
        train.renamed_options(["fit", "--config", os.path.join(ROOT, "configs", "nlhf.yaml"), "--model.beta=0.2"]) == []
    )
