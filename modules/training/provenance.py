"""Which shipped config makes a local artifact, so that a missing one is reported with the command that makes it."""

import glob
import os
from pathlib import Path
from typing import Any

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
# The suite's output folders: a path under one of them is a local artifact, never a model hub name.
LOCAL_ROOTS = ("artifacts", "runs")


def _norm(path: str | os.PathLike) -> str:
    """``path`` relative to the working directory when it lies under it, normalised, with ``/`` separators."""
    text = os.path.normpath(os.path.expanduser(os.fspath(path)))
    if os.path.isabs(text):
        rel = os.path.relpath(text, os.getcwd())
        text = text if rel.startswith("..") else rel
    return text.replace(os.sep, "/")


def looks_local(name_or_path: str | os.PathLike) -> bool:
    """Whether a path is local: absolute, ``.``/``~``-relative, existing, under :data:`LOCAL_ROOTS`, or of 3+ parts."""
    text = os.fspath(name_or_path)
    if text.startswith((os.path.sep, ".", "~")) or os.path.exists(text):
        return True
    parts = text.replace(os.sep, "/").split("/")
    return parts[0] in LOCAL_ROOTS or len(parts) > 2


def _get(config: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(config, dict):
            return None
        config = config.get(key)
    return config


def producing_config(path: str | os.PathLike, configs_dir: str | os.PathLike = CONFIGS_DIR) -> str | None:
    """The config (``configs/<file>.yaml``) whose ``output_dir`` or logger ``<save_dir>/<name>`` holds ``path``."""
    import yaml

    target = _norm(path)
    for file in sorted(glob.glob(os.path.join(glob.escape(os.fspath(configs_dir)), "*.yaml"))):
        try:
            with open(file, encoding="utf-8") as f:
                config = yaml.safe_load(f)
        except (OSError, yaml.YAMLError):
            continue
        roots = [_get(config, "model", "init_args", "output_dir")]
        logger = _get(config, "trainer", "logger", "init_args")
        if isinstance(logger, dict) and logger.get("save_dir") and logger.get("name"):
            roots.append(os.path.join(str(logger["save_dir"]), str(logger["name"])))
        if any(isinstance(root, str) and root and (target + "/").startswith(_norm(root) + "/") for root in roots):
            return f"configs/{os.path.basename(file)}"
    return None


def made_by(path: str | os.PathLike) -> str:
    """``"; it is made by `python train.py fit --config <config>`: run that first"``, or ``""`` when no config does."""
    config = producing_config(path)
    return "" if config is None else f"; it is made by `python train.py fit --config {config}`: run that first"


def missing_artifact(field: str, path: str | os.PathLike, what: str = "model folder") -> str:
    """The message for a missing local ``path`` given as ``field``: what is missing and, if known, what makes it."""
    return f"{field}: the {what} {os.fspath(path)!r} does not exist{made_by(path)}"
