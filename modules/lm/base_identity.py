"""Which frozen base a checkpoint was trained on: path, revision and a sha256 of its content (docs/trust.md)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import struct
import warnings
from typing import Any

#: the marker of an identity whose ``sha256`` covers the weights' content (absent in identities written before)
CONTENT = "content"

_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def model_folder(name_or_path: str, revision: str | None = None) -> str | None:
    """The local folder of a model: itself, a ``builtin:`` alias's folder, or the hub cache's snapshot; else None."""
    from alignment_games.modules.lm.models import resolve_name_or_path

    try:
        if os.path.isdir(path := resolve_name_or_path(name_or_path)):
            return path
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


def weight_files(folder: str) -> list[str]:
    """The weight files of a model folder (names relative to it): every shard its index names, else the single file.

    Raises:
        ValueError: naming an index that is not JSON with a ``weight_map``, or whose shard names leave the folder.
    """
    for index in _INDEXES:
        file = os.path.join(folder, index)
        if os.path.isfile(file):
            try:
                with open(file, encoding="utf-8") as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                raise ValueError(f"{file}: not a weights index (JSON with a 'weight_map'): {err}") from err
            for shard in shards:
                if not isinstance(shard, str) or os.path.isabs(shard) or ".." in shard.replace("\\", "/").split("/"):
                    raise ValueError(f"{file}: weight_map names {shard!r}, which is not a file inside the folder")
            return shards
    return [s for s in ("model.safetensors", "pytorch_model.bin") if os.path.isfile(os.path.join(folder, s))][:1]


def _cache_file() -> str | None:
    """The user's cache of weight files' hashes; None without a home to keep it in."""
    home = os.path.expanduser("~")  # no HOME ("~"): never a "~" folder in the working directory
    root = os.environ.get("XDG_CACHE_HOME") or (None if home == "~" else os.path.join(home, ".cache"))
    return None if root is None else os.path.join(root, "alignment-games", "weights-sha256.json")


def _read_cache(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            cache = json.load(f)
    except (OSError, ValueError):  # absent, unreadable or torn: nothing cached
        return {}
    return cache if isinstance(cache, dict) else {}


def _hash_file(path: str) -> str:
    """The sha256 of a file's bytes (read in chunks)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()  # type: ignore[arg-type]


def _hub_cache() -> str | None:
    """huggingface_hub's cache folder (``HF_HUB_CACHE``), resolved; None without the package."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return None
    return os.path.realpath(constants.HF_HUB_CACHE)


def _hub_blob_sha256(path: str) -> str | None:
    """The hub's sha256 of a snapshot file: the name of the ``blobs/`` file it links to in the hub cache; else None."""
    cache = _hub_cache()
    if cache is None or not os.path.islink(path):
        return None
    target, snapshot = os.path.realpath(path), os.path.realpath(os.path.dirname(path))
    repo = os.path.dirname(os.path.dirname(snapshot))
    name = os.path.basename(target)
    in_cache = os.path.dirname(repo) == cache and os.path.basename(os.path.dirname(snapshot)) == "snapshots"
    is_blob = os.path.dirname(target) == os.path.join(repo, "blobs") and _SHA256.fullmatch(name) is not None
    return name if in_cache and is_blob and os.path.isfile(target) else None


def file_sha256(path: str) -> str:
    """A weight file's sha256: the hub blob's name, else the cached hash when the file is unchanged, else computed."""
    recorded = _hub_blob_sha256(path)
    if recorded is not None:
        return recorded
    real = os.path.realpath(path)
    st = os.stat(real)
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "ctime_ns": st.st_ctime_ns}
    cache = _cache_file()
    entry = _read_cache(cache).get(real) if cache else None
    if isinstance(entry, dict) and entry.items() >= stamp.items() and _SHA256.fullmatch(str(entry.get("sha256"))):
        return entry["sha256"]
    digest = _hash_file(real)
    if cache:  # merged with what another process may have added meanwhile; a read-only or full home: not kept
        from alignment_games.modules.training.artifacts import atomic_write_text

        with contextlib.suppress(OSError):
            entries = _read_cache(cache) | {real: {**stamp, "sha256": digest}}
            atomic_write_text(cache, json.dumps(entries, indent=0, sort_keys=True))
    return digest


def _hash_config_and_index(folder: str) -> Any:
    """A sha256 fed with config.json and each weights index of ``folder`` that exists, each after its name."""
    h = hashlib.sha256()
    for name in ("config.json", *_INDEXES):
        file = os.path.join(folder, name)
        if os.path.isfile(file):
            with open(file, "rb") as f:
                h.update(name.encode() + b"\0" + f.read())
    return h


def _header_digest(folder: str) -> str:
    """The earlier identity's hash: config.json, the weights index, a single model.safetensors file's header."""
    h = _hash_config_and_index(folder)
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        h.update(b"model.safetensors\0" + _safetensors_header(single))
    return h.hexdigest()


def _content_digest(folder: str) -> str:
    """sha256 over config.json, the weights index and each weight file's name and sha256."""
    h = _hash_config_and_index(folder)
    for name in weight_files(folder):
        file = os.path.join(folder, name)
        digest = file_sha256(file) if os.path.isfile(file) else "missing"
        h.update(b"weights\0" + name.encode() + b"\0" + digest.encode())
    return h.hexdigest()


def base_identity(name_or_path: str, revision: str | None = None) -> dict[str, Any]:
    """The identity of a model (docs/trust.md); the hashes are None when its folder is not local."""
    folder = model_folder(name_or_path, revision)
    content, header = (None, None) if folder is None else (_content_digest(folder), _header_digest(folder))
    return dict(name_or_path=name_or_path, revision=revision, sha256=content, hashed=CONTENT, header_sha256=header)


def check_base_identity(stored: dict[str, Any], current: dict[str, Any], where: str) -> None:
    """Refuse a checkpoint or exported adapter trained on another base (revision, hash; old ones: header hash, warned).

    Raises:
        ValueError: naming ``where`` and both identities.
    """
    if not isinstance(stored, dict):
        return
    content = stored.get("hashed") == CONTENT
    what = "config/weights sha256" if content else "config/weights-header sha256 (a checkpoint of an earlier version)"
    a, b = stored.get("sha256"), current.get("sha256" if content else "header_sha256")
    if stored.get("revision") != current.get("revision") or (a is not None and b is not None and a != b):
        raise ValueError(
            f"{where}: the checkpoint was trained on the frozen base {stored.get('name_or_path')!r} (revision "
            f"{stored.get('revision')!r}, {what} {a}), but the base given is {current.get('name_or_path')!r} "
            f"(revision {current.get('revision')!r}, sha256 {b}); its adapters only continue on the base they were "
            "trained on"
        )
    if not content and a is not None:
        warnings.warn(
            f"{where}: the checkpoint records its base's config and weights header only (written before base "
            "identities covered the weights' content): the base's weights themselves were not verified",
            stacklevel=2,
        )
