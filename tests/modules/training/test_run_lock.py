"""A run folder is owned by one process at a time: ``run.lock`` refused while its owner lives, taken over after."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys

import pytest

from alignment_games.modules.training.run_lock import (
    BREAK_LOCK_ENV,
    LOCK_NAME,
    LockOwner,
    RunFolderInUse,
    RunFolderLock,
    _take_over,
    live_owner,
)

HOST = socket.gethostname()
with open("/proc/sys/kernel/random/boot_id") as _f:
    _BOOT = _f.read().strip()


def _start(pid: int) -> int:
    """Field 22 of ``/proc/<pid>/stat`` (the process's start time in ticks), read by hand."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def _lock_text(pid: int, host: str = HOST) -> str:
    return json.dumps({"pid": pid, "host": host}) + "\n"


@pytest.fixture
def live_pid():
    """The pid of a process of this host that is alive for the whole test."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid names no process now
    return proc.pid


def test_a_fresh_folder_is_created_and_locked_by_this_process_and_released(tmp_path):
    folder = tmp_path / "runs" / "version_0"
    with RunFolderLock.acquire(folder) as lock:
        assert lock.created and lock.folder == str(folder) and lock.path == str(folder / LOCK_NAME)
        record = json.loads((folder / LOCK_NAME).read_text())
        assert record == {"pid": os.getpid(), "host": HOST, "boot": _BOOT, "start": _start(os.getpid())}
        assert live_owner(folder) is None  # this process's own lock does not stop it
    assert not (folder / LOCK_NAME).exists() and folder.is_dir()
    again = RunFolderLock.acquire(folder)  # an existing folder: taken, but not created by this process
    assert not again.created
    again.release()


def test_the_lock_is_released_when_the_run_fails(tmp_path):
    with pytest.raises(ZeroDivisionError), RunFolderLock.acquire(tmp_path):
        _ = 1 / 0
    assert os.listdir(tmp_path) == []


def test_a_live_owner_is_refused_naming_the_folder_and_its_pid(tmp_path, live_pid):
    (tmp_path / LOCK_NAME).write_text(_lock_text(live_pid))
    with pytest.raises(RunFolderInUse) as err:
        RunFolderLock.acquire(tmp_path)
    assert str(err.value).startswith(f"run folder {tmp_path} is in use by pid {live_pid} on {HOST} (lock ")
    assert (tmp_path / LOCK_NAME).read_text() == _lock_text(live_pid)  # the owner's lock is untouched
    assert sorted(os.listdir(tmp_path)) == [LOCK_NAME]
    assert live_owner(tmp_path).pid == live_pid


def test_a_lock_whose_process_is_gone_is_taken_over(tmp_path):
    dead = _dead_pid()
    (tmp_path / LOCK_NAME).write_text(_lock_text(dead))
    assert live_owner(tmp_path) is None
    lock = RunFolderLock.acquire(tmp_path)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert sorted(os.listdir(tmp_path)) == [LOCK_NAME]  # the stale file moved aside is gone too
    lock.release()
    assert os.listdir(tmp_path) == []


def test_a_lock_left_by_an_earlier_process_with_this_pid_is_taken_over(tmp_path):
    # a restarted container reuses pids: the lock names this pid, but this process never took it
    (tmp_path / LOCK_NAME).write_text(_lock_text(os.getpid()))
    with RunFolderLock.acquire(tmp_path):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_lock_of_another_host_is_refused_with_the_file_to_remove(tmp_path):
    (tmp_path / LOCK_NAME).write_text(_lock_text(_dead_pid(), host="node-17"))
    with pytest.raises(
        RunFolderInUse, match=r"on host node-17 .* cannot be checked from .*: once it is known to be gone, .* or remove"
    ):
        RunFolderLock.acquire(tmp_path)
    assert "node-17" in (tmp_path / LOCK_NAME).read_text()


@pytest.mark.parametrize("text", ["", "12", '{"pid": "12", "host": "x"}', '{"pid": -3, "host": "x"}', "\x00garbage"])
def test_a_lock_naming_no_process_is_refused_naming_the_file(tmp_path, text):
    (tmp_path / LOCK_NAME).write_text(text)
    with pytest.raises(RunFolderInUse, match=f"locked by {tmp_path / LOCK_NAME}, which names no process"):
        RunFolderLock.acquire(tmp_path)
    assert (tmp_path / LOCK_NAME).read_text() == text


def test_release_leaves_a_lock_that_names_another_process(tmp_path, live_pid):
    lock = RunFolderLock.acquire(tmp_path)
    (tmp_path / LOCK_NAME).write_text(_lock_text(live_pid))  # taken from this process (by hand)
    assert not lock.held()
    lock.release()
    assert (tmp_path / LOCK_NAME).read_text() == _lock_text(live_pid)


def test_a_take_over_that_finds_a_fresh_lock_puts_it_back(tmp_path, live_pid):
    # read as stale, but before the rename another starter replaced it with its own live lock
    path = str(tmp_path / LOCK_NAME)
    (tmp_path / LOCK_NAME).write_text(_lock_text(live_pid))
    _take_over(path, _lock_text(_dead_pid()))
    assert sorted(os.listdir(tmp_path)) == [LOCK_NAME]
    assert (tmp_path / LOCK_NAME).read_text() == _lock_text(live_pid)


def _starter(folder: str, go, done, results) -> None:
    """One of several processes starting in the same folder at once; holds what it won until ``done``."""
    go.wait()
    try:
        RunFolderLock.acquire(folder)
        results.put(("won", os.getpid()))
    except RunFolderInUse as err:
        results.put(("refused", str(err)))
    done.wait()


def test_of_several_processes_starting_at_once_exactly_one_wins(tmp_path):
    ctx = multiprocessing.get_context("fork")
    go, done, results = ctx.Event(), ctx.Event(), ctx.Queue()
    folder = str(tmp_path / "version_0")
    procs = [ctx.Process(target=_starter, args=(folder, go, done, results)) for _ in range(4)]
    for p in procs:
        p.start()
    try:
        go.set()
        outcomes = [results.get(timeout=60) for _ in procs]
    finally:
        done.set()
        for p in procs:
            p.join(timeout=60)
    winners = [pid for kind, pid in outcomes if kind == "won"]
    assert len(winners) == 1, outcomes
    assert all(kind == "refused" and f"in use by pid {winners[0]}" in why for kind, why in outcomes if kind != "won")


def _watch(path: str, stop, seen) -> None:
    """Read ``path`` until ``stop``; report every text that exists but names no process."""
    bad = set()
    while not stop.is_set():
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            continue
        if LockOwner.parse(text) is None:
            bad.add(text)
    seen.put(sorted(bad))


def test_a_lock_file_is_never_seen_before_its_owner_is_written(tmp_path):
    # a starter that read an empty lock refused "names no process" where it should have named the winner
    ctx = multiprocessing.get_context("fork")
    stop, seen = ctx.Event(), ctx.Queue()
    watcher = ctx.Process(target=_watch, args=(str(tmp_path / LOCK_NAME), stop, seen))
    watcher.start()
    try:
        for _ in range(300):
            RunFolderLock.acquire(tmp_path).release()
    finally:
        stop.set()
        bad = seen.get(timeout=60)
        watcher.join(timeout=60)
    assert bad == []
    assert os.listdir(tmp_path) == []  # no draft left behind


def test_without_hard_links_the_lock_is_created_exclusively(tmp_path, monkeypatch, live_pid):
    def no_link(src, dst):
        raise PermissionError(1, "Operation not permitted", dst)

    monkeypatch.setattr(os, "link", no_link)
    with RunFolderLock.acquire(tmp_path / "a") as lock:
        assert json.loads(open(lock.path).read())["pid"] == os.getpid()
        assert os.listdir(tmp_path / "a") == [LOCK_NAME]
    (tmp_path / LOCK_NAME).write_text(_lock_text(live_pid))
    with pytest.raises(RunFolderInUse, match=f"in use by pid {live_pid}"):
        RunFolderLock.acquire(tmp_path)


def test_a_symlink_planted_as_the_lock_draft_is_not_written_through(tmp_path):
    folder, target = tmp_path / "run", tmp_path / "precious.txt"
    folder.mkdir()
    target.write_text("keep me")
    draft = folder / f"{LOCK_NAME}.draft-{os.getpid()}"
    os.symlink(target, draft)
    with pytest.raises(RunFolderInUse, match="nothing was written through it") as err:
        RunFolderLock.acquire(folder)
    assert f"the lock draft {draft} exists (a symbolic link to {str(target)!r})" in str(err.value)
    assert target.read_text() == "keep me"  # neither overwritten nor truncated
    assert os.path.islink(draft) and sorted(os.listdir(folder)) == [draft.name]  # the link left, no lock taken


def test_a_lock_whose_pid_now_names_a_later_process_is_taken_over(tmp_path, live_pid):
    """PID reuse: the recorded start time is not the live process's, so the lock's owner is gone."""
    record = {"pid": live_pid, "host": HOST, "boot": _BOOT, "start": _start(live_pid) - 1}
    (tmp_path / LOCK_NAME).write_text(json.dumps(record))
    assert live_owner(tmp_path) is None
    with RunFolderLock.acquire(tmp_path):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    # the same pid with its own start time is the owner alive: refused
    (tmp_path / LOCK_NAME).write_text(json.dumps({**record, "start": _start(live_pid)}))
    with pytest.raises(RunFolderInUse, match=f"in use by pid {live_pid} on {HOST}"):
        RunFolderLock.acquire(tmp_path)


def test_a_lock_of_an_earlier_boot_of_this_host_is_taken_over(tmp_path, live_pid):
    record = {"pid": live_pid, "host": HOST, "boot": "00000000-0000-0000-0000-000000000000", "start": _start(live_pid)}
    (tmp_path / LOCK_NAME).write_text(json.dumps(record))
    with RunFolderLock.acquire(tmp_path):  # no process of an earlier boot runs, whatever its pid
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_a_lock_of_another_host_is_taken_over_only_when_the_user_names_it(tmp_path, monkeypatch):
    text = json.dumps({"pid": 4242, "host": "node-17", "boot": "b", "start": 1})
    (tmp_path / LOCK_NAME).write_text(text)
    with pytest.raises(RunFolderInUse) as err:
        RunFolderLock.acquire(tmp_path)
    assert f"run again with {BREAK_LOCK_ENV}=node-17:4242 to take this lock over" in str(err.value)
    monkeypatch.setenv(BREAK_LOCK_ENV, "node-17:4243, node-9:4242")  # other owners named: still held
    with pytest.raises(RunFolderInUse):
        RunFolderLock.acquire(tmp_path)
    assert (tmp_path / LOCK_NAME).read_text() == text
    monkeypatch.setenv(BREAK_LOCK_ENV, "node-9:1,node-17:4242")
    with RunFolderLock.acquire(tmp_path):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["host"] == HOST


def test_a_folder_inside_one_a_live_process_holds_is_refused_like_it(tmp_path, live_pid):
    (tmp_path / LOCK_NAME).write_text(_lock_text(live_pid))
    inner = tmp_path / "checkpoints"
    assert live_owner(inner) is None and live_owner(inner, above=True).pid == live_pid
    with pytest.raises(RunFolderInUse, match=f"run folder {tmp_path} is in use by pid {live_pid} on {HOST}"):
        RunFolderLock.acquire(inner)
    assert not inner.exists()  # refused before it was made
    (tmp_path / LOCK_NAME).write_text(_lock_text(_dead_pid()))  # its owner gone: the inner folder is free
    with RunFolderLock.acquire(inner) as lock:
        assert lock.created and live_owner(inner, above=True) is None
