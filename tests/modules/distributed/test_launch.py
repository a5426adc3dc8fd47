"""A launched rank ends when the rank that launched it ends (``alignment_games.modules.distributed.launch``)."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import ROOT

from alignment_games.modules.distributed.launch import follow_the_launcher

# The parent starts the child (as Lightning's launcher starts rank 1), prints its pid and waits; the test kills the
# parent with SIGKILL, as a rank 0 that dies before the process group forms.
PARENT = textwrap.dedent(
    """
    import os, subprocess, sys
    env = {**os.environ, "LOCAL_RANK": sys.argv[2]}
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=env, cwd=sys.argv[3])
    print(child.pid, flush=True)
    child.wait()
    """
)
CHILD = textwrap.dedent(
    """
    import time
    from alignment_games.modules.distributed.launch import follow_the_launcher
    follow_the_launcher()
    print("ready", flush=True)
    time.sleep(120)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has ended
        return f.read().split()[2] != "Z"


def _run(local_rank: str) -> bool:
    """Whether the child outlived its parent by more than 5 s."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD, local_rank, ROOT], stdout=subprocess.PIPE, text=True
    )
    child = int(parent.stdout.readline())
    assert parent.stdout.readline().strip() == "ready"  # the child has asked for the signal
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    survived = _alive(child)
    if survived:
        os.kill(child, 9)
    return survived


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_a_launched_rank_ends_with_its_launcher_and_rank_zero_does_not():
    assert not _run("1")  # rank 1: SIGTERM when rank 0 dies
    assert _run("0")  # rank 0 (or no launcher): unchanged, it outlives its parent


def test_rank_zero_and_unlaunched_processes_are_left_alone():
    assert not follow_the_launcher({})
    assert not follow_the_launcher({"LOCAL_RANK": "0"})
