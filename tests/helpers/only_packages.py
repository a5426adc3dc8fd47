"""A Python environment in which only some distributions (and what they require) can be imported."""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

from packaging.requirements import Requirement


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_closure(names: tuple[str, ...], without: tuple[str, ...] = ()) -> list[md.Distribution]:
    """The installed distributions ``names`` need: themselves and their non-optional requirements, recursively;
    ``without`` names distributions left out (with what only they need)."""
    todo, seen = list(names), {_key(n): None for n in without}
    while todo:
        name = todo.pop()
        key = _key(name)
        if key in seen:
            continue
        try:
            seen[key] = dist = md.distribution(name)
        except md.PackageNotFoundError:
            seen[key] = None
            continue
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return [d for d in seen.values() if d is not None]


def only_packages_env(folder: Path, names: tuple[str, ...], without: tuple[str, ...] = ()) -> dict[str, str]:
    """Create a venv in ``folder`` holding links to ``names``' closure only (less ``without``, to be installed in
    other versions); the environment variables to use it.

    The venv has no system or user site-packages, so a third-party import outside the closure fails exactly as on a
    machine where it is not installed (``importlib.util.find_spec`` returns ``None``, no metadata either). Its
    ``bin`` comes first on ``PATH``, so ``python3`` in a script run with these variables is this venv's.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(folder), "platbase": str(folder)}))
    for dist in requirement_closure(names, without):
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        tops.add(dist._path.name)  # the .dist-info folder (version lookups)
        for top in tops:
            source = Path(dist.locate_file(top))
            if top.endswith(".pth") or not source.exists() or (site / top).exists():
                continue
            (site / top).symlink_to(source)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    path = [p for p in env.get("PATH", "").split(os.pathsep) if Path(p).resolve() != Path(sys.prefix, "bin").resolve()]
    env.update(PATH=os.pathsep.join([str(folder / "bin"), *path]), VIRTUAL_ENV=str(folder), PYTHONNOUSERSITE="1")
    return env
