"""Check a report's provenance block against hashes computed here, independently of the code that wrote it."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from typing import Any

from alignment_games.modules.lm.base_identity import model_folder
from helpers import ROOT


def sha256_of(path: str) -> str:
    """hashlib's sha256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, check=False)


def check_commit(commit: str | None) -> None:
    """``commit`` is HEAD by ``git`` itself, or (another commit landed since the report) one of HEAD's ancestors."""
    head = _git("rev-parse", "HEAD")
    if head.returncode != 0:
        assert commit is None, "no checkout: no commit"
        return
    assert commit is not None and len(commit) == 40, commit
    assert commit == head.stdout.strip() or _git("merge-base", "--is-ancestor", commit, "HEAD").returncode == 0


def check_provenance(report: dict[str, Any], inputs: dict[str, str]) -> dict[str, Any]:
    """Assert ``report["provenance"]`` names every input by key with the sha256 of each file read, the commit and argv.

    ``inputs``: ``{key: path}`` of what the writer read; a folder's every non-hidden file is compared under ``files``.
    Returns the provenance block.
    """
    block = report["provenance"]
    assert block["command"] == sys.argv, "the exact command line"
    assert block["cwd"] == os.getcwd()
    check_commit(block["commit"])
    assert isinstance(block["dirty"], bool) or block["commit"] is None
    recorded = block["inputs"]
    for key, path in inputs.items():
        assert key in recorded, f"the report omits input {key!r} ({path}); it names {sorted(recorded)}"
        entry = recorded[key]
        assert entry["path"] == path
        if os.path.isfile(path):
            assert entry["sha256"] == sha256_of(path), key
            continue
        folder = path if os.path.isdir(path) else model_folder(path)  # a builtin: name's folder
        every = [os.path.join(root, n) for root, _, names in os.walk(folder) for n in names]
        relative = {os.path.relpath(f, folder).replace(os.sep, "/"): f for f in every}
        files = {r: sha256_of(f) for r, f in relative.items() if not any(p.startswith(".") for p in r.split("/"))}
        assert files and entry["files"] == files, key
        lines = "".join(f"{n}\0{files[n]}\n" for n in sorted(files))
        assert entry["sha256"] == hashlib.sha256(lines.encode()).hexdigest(), key
    return block
