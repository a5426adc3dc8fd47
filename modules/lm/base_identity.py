"""Which frozen base a checkpoint was trained on: its path, revision and a hash of its config and weights index.

A checkpoint keeps the trainable tensors only (adapters over a frozen base, reloaded from its path). Continued on
another base, or on the same path after its files changed, the adapters would silently train against other weights.
The identity is ``{"name_or_path", "revision", "sha256"}``; the hash covers ``config.json`` and the weights index
(``model.safetensors.index.json``, or a single ``model.safetensors`` file's header: tensor names, dtypes, shapes,
offsets), so it is cheap for any size of model. A hub name is looked up in the local cache only (never downloaded).
"""

from __future__ import annotations

import hashlib
import os
import struct
from typing import Any

__all__ = ["base_identity", "check_base_identity", "model_folder"]


def model_folder(name_or_path: str, revision: str | None = None) -> str | None:
    """The local folder of a model: itself, a ``builtin:`` alias's folder, or the hub cache's snapshot; else None."""
    from modules.lm.models import resolve_name_or_path

    try:
        path = resolve_name_or_path(name_or_path)
    except Exception:
        return None
    if os.path.isdir(path):
        return path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, revision=revision, local_files_only=True)
    except Exception:
        return None


def _safetensors_header(path: str) -> bytes:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            return b""
        (size,) = struct.unpack("<Q", raw)
        return f.read(min(size, 100_000_000))


def base_identity(name_or_path: str, revision: str | None = None) -> dict[str, Any]:
    """``{"name_or_path", "revision", "sha256"}`` of a model (``sha256`` None when its folder is not local)."""
    folder = model_folder(name_or_path, revision)
    digest = None
    if folder is not None:
        h = hashlib.sha256()
        for name in ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"):
            file = os.path.join(folder, name)
            if os.path.isfile(file):
                h.update(name.encode() + b"\0" + open(file, "rb").read())
        single = os.path.join(folder, "model.safetensors")
        if os.path.isfile(single):
            h.update(b"model.safetensors\0" + _safetensors_header(single))
        digest = h.hexdigest()
    return {"name_or_path": name_or_path, "revision": revision, "sha256": digest}


def check_base_identity(stored: dict[str, Any], current: dict[str, Any], where: str) -> None:
    """Refuse a checkpoint trained on another frozen base than the config's.

    Compared: the revision, and the hash when both sides have one (a path may move; its content must not).

    Raises:
        ValueError: naming ``where`` and both identities.
    """
    if not isinstance(stored, dict):
        return
    changed = stored.get("revision") != current.get("revision")
    a, b = stored.get("sha256"), current.get("sha256")
    changed = changed or (a is not None and b is not None and a != b)
    if changed:
        raise ValueError(
            f"{where}: the checkpoint was trained on the frozen base {stored.get('name_or_path')!r} (revision "
            f"{stored.get('revision')!r}, config/weights-index sha256 {a}), but the config's base is "
            f"{current.get('name_or_path')!r} (revision {current.get('revision')!r}, sha256 {b}); its adapters "
            "only continue on the base they were trained on"
        )
