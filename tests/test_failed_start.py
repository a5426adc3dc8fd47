"""A run refused before its first step names the field and leaves no ``version_N/`` folder, only
its own (never another run's); a run folder is owned by one process at a time (``run.lock``)."""

import glob
import json
import os
import socket
import subprocess
import sys

import pytest
from helpers import ROOT

from alignment_games import train
from alignment_games.modules.training.run_lock import LOCK_NAME, RunFolderInUse

CONFIG = os.path.join(ROOT, "configs", "preference_ensemble.yaml")
LOGGERS = {
    "tensorboard": "lightning.pytorch.loggers.TensorBoardLogger",
    "csv": "lightning.pytorch.loggers.CSVLogger",
}


def _bad_file(tmp_path):
    """Two labelled rows, the second with a whitespace-only prompt (what the README says is refused)."""
    path = tmp_path / "pairs.jsonl"
    rows = [
        {"prompt": "What is 2 + 2?", "response_a": "4", "response_b": "5", "label": 1.0},
        {"prompt": "  \n", "response_a": "4", "response_b": "5", "label": 1.0},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _args(logger, save_dir, *extra):
    return [
        "fit",
        "--config",
        CONFIG,
        "--trainer.accelerator=cpu",
        f"--trainer.logger={LOGGERS[logger]}",
        f"--trainer.logger.init_args.save_dir={save_dir}",
        "--trainer.logger.init_args.name=run",
        *extra,
    ]


def _folders(root):
    return sorted(os.path.relpath(os.path.join(r, d), root) for r, ds, _ in os.walk(root) for d in ds)


@pytest.mark.parametrize("logger", sorted(LOGGERS))
def test_a_row_refused_in_setup_leaves_no_version_folder(tmp_path, logger):
    save_dir = tmp_path / "logs"
    extra = [f"--data.init_args.path={_bad_file(tmp_path)}", "--data.init_args.oracle=null"]
    with pytest.raises(ValueError, match=r"pairs.jsonl'?: row 2: field 'prompt' is empty"):
        train.main(_args(logger, save_dir, *extra))
    assert not save_dir.exists() or _folders(save_dir) in ([], ["run"])


def test_a_bad_value_in_init_names_the_field_and_writes_nothing(tmp_path):
    save_dir = tmp_path / "logs"
    with pytest.raises(ValueError, match="lr must be positive"):
        train.main(_args("tensorboard", save_dir, "--model.init_args.lr=-1"))
    assert not save_dir.exists()


def test_folders_of_earlier_runs_are_kept(tmp_path):
    save_dir = tmp_path / "logs"
    (save_dir / "run" / "version_0").mkdir(parents=True)
    (save_dir / "run" / "version_0" / "metrics.csv").write_text("step\n")
    extra = [f"--data.init_args.path={_bad_file(tmp_path)}", "--data.init_args.oracle=null"]
    with pytest.raises(ValueError, match="row 2: field 'prompt' is empty"):
        train.main(_args("csv", save_dir, *extra))
    assert _folders(save_dir) == ["run", os.path.join("run", "version_0")]
    assert (save_dir / "run" / "version_0" / "metrics.csv").read_text() == "step\n"


def test_a_failed_start_keeps_the_folder_of_a_run_started_meanwhile_under_the_same_name(tmp_path, monkeypatch):
    # run A fails in setup; between its start and its failure, run B (same logger name) makes its version folder
    save_dir = tmp_path / "logs"
    other = save_dir / "run" / "version_1"
    start = train.AlignmentCLI.before_fit

    def other_run_starts(cli):
        start(cli)
        other.mkdir(parents=True)
        (other / "events.out.tfevents.1.host.2").write_bytes(b"B's events")

    monkeypatch.setattr(train.AlignmentCLI, "before_fit", other_run_starts)
    extra = [f"--data.init_args.path={_bad_file(tmp_path)}", "--data.init_args.oracle=null"]
    with pytest.raises(ValueError, match="row 2: field 'prompt' is empty"):
        train.main(_args("tensorboard", save_dir, *extra))
    # A's own version_0 is gone, B's folder and file are whole
    assert _folders(save_dir) == ["run", os.path.join("run", "version_1")]
    assert os.listdir(other) == ["events.out.tfevents.1.host.2"]
    assert (other / "events.out.tfevents.1.host.2").read_bytes() == b"B's events"


def _files(folder):
    return {
        os.path.relpath(os.path.join(r, f), folder): os.stat(os.path.join(r, f)).st_mtime_ns
        for r, _, fs in os.walk(folder)
        for f in fs
    }


def test_a_second_process_in_a_live_run_folder_is_refused_and_a_stale_lock_taken_over(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tabular = ["fit", "--config", os.path.join(ROOT, "configs", "smida_tabular.yaml")]
    held = []
    after_fit = train.AlignmentCLI.after_fit

    def record_lock(cli):  # what the run folder's lock says at the end of fit (before it is released)
        held.append(json.loads(open(os.path.join(cli.trainer.log_dir, LOCK_NAME)).read()))
        after_fit(cli)

    monkeypatch.setattr(train.AlignmentCLI, "after_fit", record_lock)
    train.main([*tabular, "--trainer.max_steps=2"])
    (run,) = glob.glob(str(tmp_path / "runs" / "smida_tabular" / "version_*"))
    me = {"pid": os.getpid(), "host": socket.gethostname()}
    assert [{k: h[k] for k in me} for h in held] == [me]
    assert not os.path.exists(os.path.join(run, LOCK_NAME))  # released at the end
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        # the run is owned by a live process, in the middle of a sharded save of last.ckpt
        with open(os.path.join(run, LOCK_NAME), "w") as f:
            f.write(json.dumps({"pid": owner.pid, "host": socket.gethostname()}))
        os.makedirs(os.path.join(run, "checkpoints", ".last.ckpt.partial"))
        with open(os.path.join(run, "checkpoints", ".last.ckpt.partial", "__0_0.distcp"), "w") as f:
            f.write("shard")
        files = _files(run)
        with pytest.raises(RunFolderInUse) as err:
            train.main([*tabular, "--trainer.max_steps=4", "--ckpt_path=last"])
        assert str(err.value).startswith(f"run folder {os.path.relpath(run)} is in use by pid {owner.pid} on ")
        assert _files(run) == files  # nothing written, recovered or removed in the owner's folder
    finally:
        owner.kill()
        owner.wait()
    # the owner is gone: its lock is stale, taken over, and the run resumes in the same folder
    cli = train.main([*tabular, "--trainer.max_steps=4", "--ckpt_path=last"])
    assert cli.trainer.global_step == 4 and len(held) == 2
    assert {k: held[1][k] for k in me} == me
    assert glob.glob(str(tmp_path / "runs" / "smida_tabular" / "version_*")) == [run]
    assert not os.path.exists(os.path.join(run, LOCK_NAME))
    assert not os.path.exists(os.path.join(run, "checkpoints", ".last.ckpt.partial"))  # recovered once unowned
