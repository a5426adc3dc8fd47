"""The README's quick tries ("CPU quick start"): each names configs and options that exist, and (e2e) runs."""

import glob
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml
from helpers import ROOT

from alignment_games import train

HEADER = "| family | quick try |"


def quick_tries() -> list[tuple[str, list[str]]]:
    """(family, arguments after ``python train.py``) of each row of the README's quick-try table."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        lines = f.read().split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith(HEADER))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        family, command = line.split("|")[1:3]
        (text,) = re.findall(r"`([^`]+)`", command)
        words = shlex.split(text)
        assert words[:2] == ["python", "train.py"], f"README quick try of {family.strip()}: {text}"
        rows.append((family.strip(), words[2:]))
    return rows


TRIES = quick_tries()


def _family(config: str) -> str:
    with open(os.path.join(ROOT, config), encoding="utf-8") as f:
        return yaml.safe_load(f)["model"]["class_path"]


def test_every_family_of_the_configs_has_a_quick_try():
    tried = {_family(words[words.index("--config") + 1]) for _, words in TRIES}
    assert tried == {_family(os.path.relpath(c, ROOT)) for c in glob.glob(os.path.join(ROOT, "configs", "*.yaml"))}
    assert len(tried) == 9


@pytest.mark.parametrize(("family", "args"), TRIES, ids=[f for f, _ in TRIES])
def test_a_quick_try_parses(family, args, monkeypatch, tmp_path, capsys):
    """Its config and every override exist (``--print_config`` parses and builds nothing)."""
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as done:
        train.main([*args, "--print_config"])
    assert done.value.code in (0, None), capsys.readouterr().err[-2000:]
    assert "fast_dev_run: true" in capsys.readouterr().out  # a smoke run: writes nothing, tests one batch


@pytest.mark.e2e  # each a real run of up to 3 minutes on 2 cores (README, "CPU quick start")
@pytest.mark.parametrize(("family", "args"), TRIES, ids=[f for f, _ in TRIES])
def test_a_quick_try_runs(family, args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
