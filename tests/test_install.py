"""The suite installs as one package under its own namespace, ``alignment_games``: in a fresh virtual environment,
imported from a project that has its own ``callbacks`` and ``modules``; and the callbacks install alone, without the
language-model stack."""

import email
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile

import pytest
from helpers import ROOT
from helpers.only_packages import only_packages_env

IMPORT = (
    "import callbacks, modules; "
    "from alignment_games import train; "
    "from alignment_games.callbacks import EloRating, MCCTracker, PeakCheckpoint, TwoTimescaleWarmup; "
    "from alignment_games.callbacks.functional import elo_update; "
    "from alignment_games.modules import smida, stackelberg_equilibrium, Exp3, extract_final_answer, answers_match; "
    "from alignment_games.modules.lm.model_config import ModelConfig; "
    "import alignment_games.callbacks as suite; "
    "print(callbacks.MINE, modules.MINE, suite.__file__)"
)
#: the README's import line ("Using the callbacks in another project")
README_IMPORT = "from alignment_games.callbacks import EloRating, MCCTracker, PeakCheckpoint, TwoTimescaleWarmup"
#: what the callbacks need; the light install must work with nothing else
LIGHT = ("lightning", "torch", "torchmetrics", "numpy", "scipy")

#: the top-level package folders the wheel installs under alignment_games
TOPS = ("modules", "datamodules", "callbacks", "commands")


def _project(tmp_path):
    """A user's project folder with its own ``callbacks.py`` and ``modules.py``."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "callbacks.py").write_text("MINE = 'own callbacks'\n")
    (project / "modules.py").write_text("MINE = 'own modules'\n")
    return project


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The suite's wheel, built from a copy of the sources (the build leaves nothing in the checkout)."""
    src = tmp_path_factory.mktemp("src")
    for name in TOPS:
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("train.py", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    out = src / "dist"
    # setuptools comes from PyPI (build isolation); the package's own dependencies are not fetched
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    (path,) = glob.glob(str(out / "*.whl"))
    return path


def test_every_package_folder_is_in_the_wheel(wheel):
    declared = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["tool"]["setuptools"]["packages"]
    folders = sorted(
        "alignment_games." + os.path.relpath(d, ROOT).replace(os.sep, ".")
        for top in TOPS
        for d, _, files in os.walk(os.path.join(ROOT, top))
        if "__init__.py" in files
    )
    assert sorted(declared) == ["alignment_games", *folders]  # a new package folder must be added to pyproject.toml
    names = zipfile.ZipFile(wheel).namelist()
    for package in folders:
        assert package.replace(".", "/") + "/__init__.py" in names
    assert "alignment_games/train.py" in names
    assert not [n for n in names if n.split("/")[0] in (*TOPS, "train.py", "tests")]


@pytest.mark.e2e  # a fresh venv and pip install, 10-20 s on 2 cores (`pytest -m e2e`, .ci/run)
def test_pip_install_into_a_fresh_venv_then_import_beside_a_projects_own_callbacks(tmp_path, wheel):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    # the dependencies come from this environment; the package itself is installed from its wheel
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    with open(os.path.join(site, "deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([python, "-m", "pip", "install", "--no-deps", "-q", wheel], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-2000:]
    project = _project(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([python, "-c", IMPORT], cwd=project, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    suite = out.stdout.split()[-1]
    assert out.stdout.startswith("own callbacks own modules ") and suite.startswith(site), out.stdout
    # and without the install, the suite's import fails: the test cannot pass by finding the checkout
    subprocess.run([python, "-m", "pip", "uninstall", "-y", "-q", "alignment-games"], check=True)
    gone = subprocess.run([python, "-c", IMPORT], cwd=project, env=env, capture_output=True, text=True)
    assert gone.returncode != 0 and "No module named 'alignment_games'" in gone.stderr


@pytest.mark.e2e  # a fresh venv and pip install, 10-20 s on 2 cores (`pytest -m e2e`, .ci/run)
def test_the_callbacks_install_alone_without_the_language_model_stack(tmp_path, wheel):
    requires = email.message_from_string(zipfile.ZipFile(wheel).read(_metadata(wheel)).decode()).get_all(
        "Requires-Dist"
    )
    base = sorted(re.split(r"[<>=!~ ;\[]", r)[0].lower() for r in requires if "extra ==" not in r)
    assert base == sorted(LIGHT)  # what `pip install <this folder>` brings
    env = only_packages_env(tmp_path / "light", LIGHT)
    site = subprocess.run(
        ["python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", site, wheel],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    project = _project(tmp_path)
    script = (
        "import importlib.util, callbacks; "
        "absent = [m for m in ('transformers', 'peft', 'datasets') if importlib.util.find_spec(m)]; "
        f"{README_IMPORT}; "
        "from alignment_games.callbacks import beta_lower_bound; "
        "print(absent, callbacks.MINE, round(beta_lower_bound(8, 10, 0.05), 4))"
    )
    out = subprocess.run(["python", "-c", script], cwd=project, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    from scipy import stats

    expected = round(float(stats.beta.ppf(0.05, 9, 3)), 4)  # Beta(1 + 8, 1 + 2), its 5% quantile
    assert out.stdout.split() == ["[]", "own", "callbacks", str(expected)]
    # the trainer without the games extra: one line naming it, not Lightning's jsonargparse message
    cli = subprocess.run(["python", "-m", "alignment_games.train", "--help"], cwd=project, env=env, capture_output=True)
    assert (cli.returncode, cli.stdout) == (2, b"")
    assert cli.stderr.decode().startswith("error: the trainer needs the games extra (jsonargparse, transformers, peft")
    assert 'pip install "alignment-games[games]"' in cli.stderr.decode() and cli.stderr.count(b"\n") == 1


def _metadata(wheel: str) -> str:
    return next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/METADATA"))
