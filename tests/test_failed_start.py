"""A run refused before its first step names the field and leaves no ``version_N/`` folder (issue 17 item 6)."""

import json
import os

import pytest
from helpers import ROOT

import train

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
    with pytest.raises(ValueError, match=r"pairs.jsonl'?: row 1: field 'prompt' is empty"):
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
    with pytest.raises(ValueError, match="row 1: field 'prompt' is empty"):
        train.main(_args("csv", save_dir, *extra))
    assert _folders(save_dir) == ["run", os.path.join("run", "version_0")]
    assert (save_dir / "run" / "version_0" / "metrics.csv").read_text() == "step\n"
