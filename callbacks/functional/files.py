"""File-system helpers shared by the callbacks' atomic writes and the modules' folder swaps and locks (plain ``os``)."""

from __future__ import annotations

import contextlib
import os

__all__ = ["fsync_dir", "pid_alive", "process_start", "write_error"]


def fsync_dir(folder: str) -> None:
    """Flush ``folder``'s entries (a rename or a new file in it) to disk; ``""`` is the working directory."""
    with contextlib.suppress(OSError):  # some file systems cannot open or sync a directory: passed over
        fd = os.open(folder or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat``, field 22); None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # the command name (field 2) may hold spaces and parentheses: the fields after it follow the last ")"
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def pid_alive(pid: int, start: int | None = None) -> bool:
    """Whether process ``pid`` exists on this host (signal 0 only asks; one run by another user counts as alive).

    With ``start`` (a :func:`process_start` recorded earlier), a process that now has ``pid`` but started at another
    time is a later one that reused the pid: not alive.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if start is None:
        return True
    now = process_start(pid)
    return now is None or now == start


def write_error(err: OSError, path: str | os.PathLike) -> OSError:
    """``err`` as an ``OSError`` of the same errno whose message names ``path`` (a full disk names no file)."""
    detail = err.strerror or str(err) or type(err).__name__
    if err.filename is not None and os.fspath(err.filename) != os.fspath(path):
        detail += f" ({os.fspath(err.filename)})"
    message = f"cannot write {os.fspath(path)}: {detail}; its previous version is left as it was"
    return OSError(err.errno, message) if err.errno is not None else OSError(message)
