"""One run identity, checked on every resume: the settings that may not change and the content of what it reads."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import yaml

from alignment_games.modules.checkpoints.trust import (
    RESUME_SAFE_KEYS,
    RUN_CONFIG_KEY,
    check_resume_config,
    config_differences,
    read_checkpoint_or_explain,
)
from alignment_games.modules.lm.base_identity import base_identity, file_sha256, weight_files

#: where a checkpoint records the sha256 of every model folder and file its run read (``{config key: identity}``)
RUN_INPUTS_KEY = "run_inputs"
#: config fields (the last part of a key) that name what a run writes, not what it reads
OUTPUT_FIELDS = frozenset({"output_dir", "figure_path", "dirpath", "save_dir", "log_dir", "default_root_dir"})


def _leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` of every leaf of nested mappings and lists (list items keyed by their index)."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from _leaves(value, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, tree


def _is_model_folder(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    try:
        return os.path.isfile(os.path.join(path, "config.json")) or bool(weight_files(path))
    except ValueError:  # a weights index that is not one: still a model folder (its loading names the index)
        return True


def input_identity(value: str) -> dict[str, Any] | None:
    """``{"path", "kind", "sha256"}`` of a model folder, ``builtin:`` model or regular file ``value``; else None."""
    if value.startswith("builtin:") or _is_model_folder(value):
        return {"path": value, "kind": "model folder", "sha256": base_identity(value)["sha256"]}
    if os.path.isfile(value):
        return {"path": value, "kind": "file", "sha256": file_sha256(value)}
    return None


def _safe(key: str) -> bool:
    return any(key == s or key.startswith(f"{s}.") for s in RESUME_SAFE_KEYS)


def run_inputs(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The identity (:func:`input_identity`) of every input a resolved ``config`` names, by dotted config key."""
    out = {}
    for key, value in _leaves(config):
        if not isinstance(value, str) or not value or _safe(key) or key.rsplit(".", 1)[-1] in OUTPUT_FIELDS:
            continue
        identity = input_identity(value)
        if identity is not None:
            out[key] = identity
    return out


def check_run_inputs(stored: Any, current: dict[str, dict[str, Any]], source: str) -> None:
    """Refuse a resume that reads, from a path the checkpoint's run read, content other than that run read.

    An input the checkpoint does not record, or given from another path, is not compared here (the config is).

    Raises:
        ValueError: naming ``source`` and, for every changed input, its config key, path and both sha256.
    """
    if not isinstance(stored, dict):
        return
    changed = []
    for key, old in sorted(stored.items()):
        new = current.get(key)
        if not isinstance(old, dict) or new is None or old.get("path") != new["path"]:
            continue
        if old.get("sha256") is not None and new["sha256"] is not None and old["sha256"] != new["sha256"]:
            changed.append(
                f"the {new['kind']} {new['path']!r} ({key}): sha256 {old['sha256']} in the checkpoint, "
                f"{new['sha256']} now"
            )
    if changed:
        raise ValueError(
            f"{source}: what the run reads changed since the checkpoint was written: {'; '.join(changed)}. A resume "
            "continues on the inputs it was trained on: restore them, or start a new run (another logger version)"
        )


def check_resumed_run(
    path: str, config_yaml: str | None, inputs: dict[str, dict[str, Any]], strict: bool, source: str
) -> list[str] | None:
    """Check checkpoint ``path`` against this run's config and inputs; the config keys the resume changes.

    ``strict`` (``--ckpt_path last``): any config difference outside the resume-safe keys is refused. Otherwise (an
    explicit checkpoint: fine-tuning from it is a deliberate choice) the differing keys are returned. On every path an
    input read from the same path with other content is refused. None: the checkpoint records no config.

    Raises:
        ValueError: naming ``source``, the differing keys or changed inputs and both values.
        FileNotFoundError: naming a missing ``path``.
    """
    checkpoint = read_checkpoint_or_explain(path)
    check_run_inputs(checkpoint.get(RUN_INPUTS_KEY), inputs, source)
    if config_yaml is None or not isinstance(checkpoint.get(RUN_CONFIG_KEY), str):
        return None
    if strict:
        check_resume_config(checkpoint, config_yaml, source=source)
        return []
    stored = yaml.safe_load(checkpoint[RUN_CONFIG_KEY]) or {}
    return config_differences(stored, yaml.safe_load(config_yaml) or {})
