"""The suite installs as a package: a fresh virtual environment, ``pip install .``, and the callbacks import from
another folder (no path edits, no checkout on ``sys.path``)."""

import os
import shutil
import subprocess
import sys
import sysconfig

from helpers import ROOT

IMPORT = (
    "import callbacks, datamodules, modules, train; "
    "from callbacks import EloRating, MCCTracker, PeakCheckpoint, TwoTimescaleWarmup; "
    "from callbacks.functional import elo_update; "
    "from modules import smida, stackelberg_equilibrium, Exp3, extract_final_answer, answers_match; "
    "from modules.lm.model_config import ModelConfig; "
    "print(callbacks.__file__)"
)


def test_pip_install_into_a_fresh_venv_then_import_from_another_folder(tmp_path):
    # a copy of the sources, so that the build leaves nothing in the checkout
    src = tmp_path / "src"
    for name in ("modules", "datamodules", "callbacks"):
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("train.py", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    # the dependencies come from this environment; the package itself is built (setuptools from PyPI) and installed
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    with open(os.path.join(site, "deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run(
        [python, "-m", "pip", "install", "--no-deps", "-q", str(src)],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([python, "-c", IMPORT], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().startswith(site), out.stdout  # the installed copy, not the checkout
    # and without the install, the same import fails: the test cannot pass by finding the checkout
    subprocess.run([python, "-m", "pip", "uninstall", "-y", "-q", "alignment-games"], check=True)
    gone = subprocess.run([python, "-c", IMPORT], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert gone.returncode != 0 and "No module named 'callbacks'" in gone.stderr
