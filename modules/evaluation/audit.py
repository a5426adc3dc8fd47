"""What an evaluation read and found, for a reader to check: each trained model's sha256 and base, per-problem rows.

The same path or weights given twice is refused: two "seeds" that are one run would narrow every interval.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from alignment_games.modules.lm.base_identity import (
    base_identity,
    check_base_identity,
    file_sha256,
    model_folder,
    weight_files,
)
from alignment_games.modules.training.artifacts import atomic_write_text

__all__ = ["describe_models", "problem_rows", "recorded_base", "tensors_sha256", "weights_sha256", "write_report"]

#: a peft adapter folder's weight files (what :mod:`modules.checkpoints.export` writes is the first)
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")


def weights_sha256(folder: str) -> str:
    """The sha256 of a model folder's one weight file; for a sharded model, of every file's ``name\\0sha256\\n`` line.

    Raises:
        ValueError: naming a folder with no adapter or model weight file.
    """
    names = [n for n in ADAPTER_FILES if os.path.isfile(os.path.join(folder, n))] or weight_files(folder)
    if not names:
        raise ValueError(f"{folder!r} holds no weight file ({', '.join(ADAPTER_FILES)}, model.safetensors, ...)")
    digests = [(n, file_sha256(os.path.join(folder, n))) for n in names]
    if len(digests) == 1:
        return digests[0][1]
    return hashlib.sha256("".join(f"{n}\0{d}\n" for n, d in digests).encode()).hexdigest()


def tensors_sha256(tensors: Sequence[torch.Tensor]) -> str:
    """The sha256 of tensors in order, each as ``dtype shape`` then its bytes.

    It names the weights an in-training evaluation used (a sharded parameter hashes this process's shard).
    """
    digest = hashlib.sha256()
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor (FSDP2): this process's shard
        t = t.detach().cpu().contiguous()
        digest.update(f"{t.dtype} {tuple(t.shape)}\n".encode())
        digest.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def recorded_base(folder: str) -> dict[str, Any] | None:
    """The base identity a trained folder or checkpoint was trained on; None when it names no base.

    Read from ``export.json``, else the base ``adapter_config.json`` names (identity taken now), else a checkpoint's
    first policy bank's ``base_identity``.
    """
    if os.path.isfile(folder):
        from alignment_games.modules.checkpoints.trust import read_checkpoint

        banks = read_checkpoint(folder, mmap=True).get("base_identity")
        return next(iter(banks.values()), None) if isinstance(banks, dict) else None
    for name, key in (("export.json", "base_identity"), ("adapter_config.json", "base_model_name_or_path")):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                record = json.load(f)
            if isinstance(record.get(key), dict):
                return record[key]
            if key == "base_model_name_or_path" and isinstance(record.get(key), str):
                return base_identity(record[key], record.get("revision"))
    return None


def describe_models(paths: Sequence[str], base: dict[str, Any] | None, option: str) -> list[dict[str, Any]]:
    """``{"path", "sha256", "base_identity"}`` of each trained folder or checkpoint, ``option`` naming them in errors.

    Raises:
        FileNotFoundError: naming a path that is not a local folder.
        ValueError: naming both paths of the same path or weights given twice, or a model of another base.
    """
    out: list[dict[str, Any]] = []
    seen: dict[str, str] = {}
    for path in paths:
        folder = path if os.path.isfile(path) else model_folder(path)
        if folder is None:
            raise FileNotFoundError(f"{option}: {path!r} is not a local model folder (its weights cannot be hashed)")
        sha = file_sha256(folder) if os.path.isfile(folder) else weights_sha256(folder)
        for key, what in ((os.path.realpath(folder), "the same path"), (sha, f"the same weights (sha256 {sha})")):
            if key in seen:
                raise ValueError(f"{option}: {seen[key]!r} and {path!r} are {what}; give each trained model once")
            seen[key] = path
        stored = recorded_base(folder)
        if base is not None and stored is not None:
            check_base_identity(stored, base, f"{option} {path!r}")
        out.append({"path": path, "sha256": sha, "base_identity": stored})
    return out


def problem_rows(
    prompts: Sequence[str], references: Sequence[str], results: Mapping[str, Sequence[Any]], field: str = "correct"
) -> list[dict[str, Any]]:
    """One row per problem: its index, the sha256 of its text, the reference and under ``field`` each result's value.

    Example:
        >>> problem_rows(["1 + 1?"], ["2"], {"base": [False]})[0]["correct"]
        {'base': False}
    """
    return [
        {
            "problem": i,
            "sha256": hashlib.sha256(p.encode()).hexdigest(),
            "reference": r,
            field: {name: values[i] for name, values in results.items()},
        }
        for i, (p, r) in enumerate(zip(prompts, references, strict=True))
    ]


def write_report(report: dict[str, Any], out: str, rows: Sequence[Mapping[str, Any]]) -> None:
    """Write ``rows`` to ``<out less .json>.problems.jsonl``, then ``report`` (with their sha256) to ``out``."""
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path = (out[:-5] if out.endswith(".json") else out) + ".problems.jsonl"
    atomic_write_text(path, text)
    sha = hashlib.sha256(text.encode()).hexdigest()
    report["per_problem"] = {"file": os.path.basename(path), "rows": len(rows), "sha256": sha}
    atomic_write_text(out, json.dumps(report, indent=2) + "\n")
