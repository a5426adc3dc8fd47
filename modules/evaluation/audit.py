"""What an evaluation read and found, for a reader to check: each trained model's sha256 and base, per-problem rows.

Every report a command or a run writes carries :func:`provenance`: the sha256 of each input it read, the identity of
each model among them, the code's git commit and the exact command. The same path or weights given twice is refused:
two "seeds" that are one run would narrow every interval.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
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

#: a peft adapter folder's weight files (what :mod:`alignment_games.modules.checkpoints.export` writes is the first)
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")
#: the checkout this code runs from (when it is one)
SOURCE_ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(SOURCE_ROOT), *args], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):  # no git, or it hangs
        return None
    return done.stdout if done.returncode == 0 else None


def git_commit() -> dict[str, Any]:
    """``{"commit", "dirty"}`` of the code running: HEAD of the checkout it is, and whether tracked files differ.

    Both None outside a checkout of this project (an installed package, a copy, no ``git``): an enclosing repository
    of another project is never named. Read when a report is written (a few milliseconds).
    """
    top = _git("rev-parse", "--show-toplevel")
    if top is None or Path(top.strip()).resolve() != SOURCE_ROOT:
        return {"commit": None, "dirty": None}
    head, status = _git("rev-parse", "HEAD"), _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": None if head is None else head.strip(), "dirty": None if status is None else bool(status.strip())}


def _folder_files(folder: str) -> dict[str, str]:
    """Every regular file under ``folder`` but hidden ones, by ``/``-separated relative name, with its sha256."""
    out = {}
    for root, dirs, files in os.walk(folder):  # a linked subfolder is not entered: no cycle to loop in
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            path = os.path.join(root, name)
            if not name.startswith(".") and os.path.isfile(path):
                out[os.path.relpath(path, folder).replace(os.sep, "/")] = file_sha256(path)
    return dict(sorted(out.items()))


def input_record(path: str) -> dict[str, Any]:
    """``{"path", "sha256", ...}`` of one input: a file's sha256; a folder's and each of its files' (``files``).

    A folder's ``sha256`` is that of its files' ``name\\0sha256\\n`` lines in name order. A model (a folder with a
    ``config.json``, or a ``builtin:`` or cached hub name) adds ``model``: its
    :func:`~alignment_games.modules.lm.base_identity.base_identity`, the identity checkpoints record. A path that does
    not exist (a hub name not cached here) has ``sha256`` None.
    """
    path = os.fspath(path)
    if os.path.isfile(path):
        return {"path": path, "sha256": file_sha256(path)}
    folder = path if os.path.isdir(path) else model_folder(path)
    if folder is None:
        return {"path": path, "sha256": None}
    files = _folder_files(folder)
    record: dict[str, Any] = {"path": path}
    record["sha256"] = hashlib.sha256("".join(f"{n}\0{d}\n" for n, d in files.items()).encode()).hexdigest()
    if folder != path or os.path.isfile(os.path.join(folder, "config.json")):
        record["model"] = base_identity(path)
    record["files"] = files
    return record


def provenance(inputs: Mapping[str, str | os.PathLike | Sequence[str | os.PathLike] | None]) -> dict[str, Any]:
    """What a report was made from: each input's :func:`input_record`, the commit, the command and its folder.

    Args:
        inputs: Each input the report's numbers were computed from (data files, checkpoints, adapters, model folders
            or names, earlier reports), by the option or config key that named it; a list gives ``key[i]`` entries;
            None (an option not given) is left out.

    Example:
        >>> sorted(provenance({})) == ["command", "commit", "cwd", "dirty", "inputs"]
        True
    """
    records = {}
    for key, value in inputs.items():
        if value is None:
            continue
        if isinstance(value, (str, os.PathLike)):
            records[key] = input_record(os.fspath(value))
        else:
            records.update({f"{key}[{i}]": input_record(os.fspath(v)) for i, v in enumerate(value)})
    return {"command": list(sys.argv), "cwd": os.getcwd(), **git_commit(), "inputs": records}


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


#: config fields (the last part of a key) that name what a run writes, never an input
OUTPUT_FIELDS = frozenset({"output_dir", "figure_path", "dirpath", "save_dir", "log_dir", "default_root_dir", "out"})


def _named_inputs(tree: Any, prefix: str) -> Iterator[tuple[str, str]]:
    """``(dotted key, value)`` of nested strings naming a file, a model folder, a ``name_or_path`` or ``builtin:``."""
    if _plain(tree):
        tree = {f.name: getattr(tree, f.name) for f in dataclasses.fields(tree)}
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            if str(key) not in OUTPUT_FIELDS:
                yield from _named_inputs(value, f"{prefix}.{key}")
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _named_inputs(value, f"{prefix}.{i}")
    elif isinstance(tree, str) and tree:
        model = any(os.path.isfile(os.path.join(tree, n)) for n in ("config.json", "adapter_config.json"))
        if prefix.endswith("name_or_path") or tree.startswith("builtin:") or os.path.isfile(tree) or model:
            yield prefix, tree


def _own_settings(module: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(model.<name>, settings)``: each child's and object attribute's strings and dataclasses, each inner hparams."""
    children = dict(module.named_children()) if hasattr(module, "named_children") else {}
    objects = {k: v for k, v in vars(module).items() if not k.startswith("_") and hasattr(v, "__dict__")}
    for name, value in {**objects, **children}.items():
        if isinstance(value, type):
            continue
        own = vars(value).items()
        yield f"model.{name}", {k: v for k, v in own if not k.startswith("_") and (isinstance(v, str) or _plain(v))}
    for name, inner in module.named_modules() if hasattr(module, "named_modules") else ():
        if name and isinstance(getattr(inner, "hparams", None), Mapping):
            yield f"model.{name}.hparams", inner.hparams


def _plain(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def run_provenance(trainer: Any, module: Any) -> dict[str, Any]:
    """:func:`provenance` of what a training run reads, for the reports it writes.

    Its inputs: those ``train.py`` hashed from the resolved config (the ``inputs`` of its
    :class:`~alignment_games.callbacks.run_config.RunConfigRecord`), the files and models that the module's and the
    datamodule's settings name (``model.<key>``, ``data.<key>``), what the module's child modules and object attributes
    name (:func:`_own_settings`: ``model.<attribute>.<key>``, e.g. a judge's model or an ensemble utility's checkpoint),
    and the checkpoint the run resumed from (``ckpt_path``). A path already named is not named again.
    """
    from alignment_games.callbacks.run_config import RunConfigRecord

    inputs: dict[str, Any] = {}
    for callback in getattr(trainer, "callbacks", ()):
        if isinstance(callback, RunConfigRecord):
            recorded = getattr(callback, "inputs", None) or {}
            inputs.update({key: r["path"] for key, r in recorded.items() if isinstance(r, dict) and r.get("path")})
    datamodule = getattr(trainer, "datamodule", None)
    sources = [("model", getattr(module, "hparams", {})), *_own_settings(module)]
    if datamodule is not None:
        sources.append(("data", getattr(datamodule, "hparams", {})))
        sources += [(f"data.{k}", v) for k, v in vars(datamodule).items() if _plain(v)]
    for prefix, tree in sources:
        for key, path in _named_inputs(tree, prefix):
            if path not in inputs.values():
                inputs[key] = path
    resumed = getattr(trainer, "ckpt_path", None)
    if resumed not in inputs.values():
        inputs["ckpt_path"] = resumed
    return provenance(inputs)


def digests_tensor(texts: Sequence[str]) -> torch.Tensor:
    """``[n, 4]`` int64: each text's sha256 as four big-endian signed words, to gather across processes like a number.

    Example:
        >>> digests_from_tensor(digests_tensor(["a"]))[0] == hashlib.sha256(b"a").hexdigest()
        True
    """
    words = [
        [int.from_bytes(d[i : i + 8], "big", signed=True) for i in range(0, 32, 8)]
        for d in (hashlib.sha256(t.encode()).digest() for t in texts)
    ]
    return torch.tensor(words, dtype=torch.int64).view(len(texts), 4)


def digests_from_tensor(words: torch.Tensor) -> list[str]:
    """The hex sha256 of each row of :func:`digests_tensor`."""
    return [b"".join(int(w).to_bytes(8, "big", signed=True) for w in row).hex() for row in words.tolist()]


def write_report(
    report: dict[str, Any], out: str, rows: Sequence[Mapping[str, Any]], inputs: Mapping[str, Any]
) -> None:
    """Write ``rows`` to ``<out less .json>.problems.jsonl``, then ``report`` to ``out``.

    The report gains ``per_problem`` (the rows' file and sha256) and ``provenance`` (:func:`provenance` of
    ``inputs``).
    """
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path = (out[:-5] if out.endswith(".json") else out) + ".problems.jsonl"
    atomic_write_text(path, text)
    sha = hashlib.sha256(text.encode()).hexdigest()
    report["per_problem"] = {"file": os.path.basename(path), "rows": len(rows), "sha256": sha}
    report["provenance"] = provenance(inputs)
    atomic_write_text(out, json.dumps(report, indent=2) + "\n")
