"""File-system helpers shared by the callbacks' atomic writes and the modules' folder swaps and locks (plain ``os``)."""

import contextlib
import errno
import io
import os
import traceback
from typing import Any

__all__ = [
    "NO_ROOM",
    "disk_full_error",
    "fsync_dir",
    "no_room_left",
    "os_error_behind",
    "path_being_written",
    "pid_alive",
    "process_start",
    "write_error",
]

#: errnos of a write that found no room: a full disk, an exhausted quota
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
#: free bytes under which a failed write is taken for a full disk (a write of one large tensor fails with some left)
ROOM = 64 * 2**20
#: names under which writers keep the path of the file they write (Lightning's, jsonargparse's, torch's, ours)
_PATH_NAMES = ("path", "filepath", "file_path", "filename", "config_yaml", "config_path", "checkpoint_path", "fname")


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
    return start is None or (now := process_start(pid)) is None or now == start


def write_error(err: OSError, path: str | os.PathLike) -> OSError:
    """``err`` as an ``OSError`` of the same errno whose message names ``path`` (a full disk names no file)."""
    detail = err.strerror or str(err) or type(err).__name__
    if err.filename is not None and os.fspath(err.filename) != os.fspath(path):
        detail += f" ({os.fspath(err.filename)})"
    message = f"cannot write {os.fspath(path)}: {detail}; its previous version is left as it was"
    return OSError(err.errno, message) if err.errno is not None else OSError(message)


def os_error_behind(err: BaseException) -> OSError | None:
    """The first ``OSError`` in ``err``, its causes and contexts; ``None`` without one.

    A DCP ``CheckpointException`` keeps each rank's exception in ``failures`` (rank -> (exception, traceback)).
    """
    seen, queue = set(), [err]
    while queue:
        cause = queue.pop(0)
        if cause is None or id(cause) in seen:
            continue
        seen.add(id(cause))
        if isinstance(cause, OSError):
            return cause
        failures = getattr(cause, "failures", None)
        if isinstance(failures, dict):
            queue += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        queue += [cause.__cause__, cause.__context__]
    return None


def _file_path(value: Any) -> str | None:
    """The path of an open file object being written (``name`` of a built-in file, ``path`` of fsspec's)."""
    if not isinstance(value, io.IOBase):
        return None
    path = getattr(value, "path", None) or getattr(value, "name", None)
    mode = str(getattr(value, "mode", ""))
    return os.fspath(path) if isinstance(path, (str, os.PathLike)) and any(c in mode for c in "wax+") else None


def path_being_written(err: BaseException) -> str | None:
    """The file a write that raised ``err`` was writing, read from its traceback; ``None`` when none is there.

    Innermost frame first: an open file object being written (its ``name``, or fsspec's ``path``), else a local named
    like a path (``filepath``, ``config_yaml`` …).
    """
    for frame, _ in reversed(list(traceback.walk_tb(err.__traceback__))):
        local = frame.f_locals
        found = next((p for p in map(_file_path, local.values()) if p), None)
        if found:
            return found
        named = next((local[k] for k in _PATH_NAMES if isinstance(local.get(k), (str, os.PathLike))), None)
        if named is not None and os.fspath(named):
            return os.fspath(named)
    return None


def disk_full_error(err: BaseException, path: str | os.PathLike | None = None) -> OSError | None:
    """A full disk (or quota) behind ``err`` that names no file, made again naming ``path`` (same errno).

    ``path`` defaults to :func:`path_being_written`. ``None`` for another error, one that names its file already, or
    when no path is known. Unlike :func:`write_error` it promises nothing of the previous content (written in place).
    """
    cause = os_error_behind(err)
    if cause is None or cause.errno not in NO_ROOM or cause.filename is not None:
        return None
    if str(cause.strerror or "").startswith("cannot write "):  # named already (write_error)
        return None
    where = path if path is not None else (path_being_written(cause) or path_being_written(err))
    return None if where is None else OSError(cause.errno, f"cannot write {os.fspath(where)}: {cause.strerror}")


def no_room_left(folder: str | os.PathLike) -> int | None:
    """The free bytes of ``folder``'s file system when under :data:`ROOM`; ``None`` when there is room or no answer.

    A write there that just failed likely failed for room: torch's C++ writer (``torch.save`` to a path, as
    DeepSpeed saves) reports a full disk as a ``RuntimeError`` without an errno.
    """
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return free if (free := st.f_bavail * st.f_frsize) < ROOM else None
