"""One process at a time in a run folder: ``run.lock`` names the owner (stale and foreign locks: docs/trust.md)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from alignment_games.callbacks.functional.files import pid_alive, process_start

LOCK_NAME = "run.lock"
#: names the locks of other hosts (``host:pid``, comma-separated) that the user knows to be stale
BREAK_LOCK_ENV = "ALIGNMENT_GAMES_BREAK_LOCK"


class RunFolderInUse(RuntimeError):
    """Another live process owns the run folder (or its lock cannot be read)."""


@functools.cache
def _boot_id() -> str | None:
    """The id of the host's current boot (Linux's ``boot_id``); None where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None


@dataclass(frozen=True)
class LockOwner:
    """Who holds a lock: a process id on a host, with the host's boot id and the process's start time when known."""

    pid: int
    host: str
    boot: str | None = None
    start: int | None = None

    @classmethod
    def me(cls) -> LockOwner:
        """The owner record of the calling process."""
        pid = os.getpid()
        return cls(pid, socket.gethostname(), _boot_id(), process_start(pid))

    def text(self) -> str:
        """The lock file's content."""
        return json.dumps({"pid": self.pid, "host": self.host, "boot": self.boot, "start": self.start}) + "\n"

    @classmethod
    def parse(cls, text: str) -> LockOwner | None:
        """The owner a lock file's ``text`` names, or ``None`` when it names none (empty, garbled, a bad pid)."""
        try:
            record = json.loads(text)
            pid, host = record.get("pid"), record.get("host")
        except (ValueError, AttributeError):  # not JSON, or not an object
            return None
        if type(pid) is not int or pid <= 0 or not isinstance(host, str) or not host:
            return None
        boot, start = record.get("boot"), record.get("start")  # absent in locks written before they were recorded
        boot = boot if isinstance(boot, str) and boot else None
        start = start if type(start) is int and start >= 0 else None
        return cls(pid, host, boot, start)

    def token(self) -> str:
        """``host:pid``, the value of :data:`BREAK_LOCK_ENV` that names this owner's lock as stale."""
        return f"{self.host}:{self.pid}"


def _alive(owner: LockOwner) -> bool:
    """Whether ``owner`` may still be running (a process on another host is, unless the user named it gone)."""
    me = LockOwner.me()
    if owner.host != me.host:
        return owner.token() not in {t.strip() for t in os.environ.get(BREAK_LOCK_ENV, "").split(",")}
    if owner.boot is not None and me.boot is not None and owner.boot != me.boot:
        return False  # the host booted again since the lock was taken: no process of that boot runs
    if owner.pid == me.pid:  # an earlier process that had this pid (a restarted container): not this one's lock
        return False
    return pid_alive(owner.pid, owner.start)


def _read(path: str) -> str | None:
    """The lock file's text, or ``None`` when there is none."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(4096)
    except FileNotFoundError:
        return None


def _above(folder: str) -> list[str]:
    """The folders above ``folder`` (absolute), nearest first."""
    return [str(p) for p in Path(os.path.abspath(folder)).parents]


def _holder(folder: str) -> tuple[str, LockOwner | None, str] | None:
    """``(lock path, owner or None when it names none, text)`` of a lock in ``folder`` held by another live process."""
    path = os.path.join(folder, LOCK_NAME)
    try:
        text = _read(path)
    except OSError:  # unreadable (a folder of another user's above this one): no lock of this user's runs
        return None
    if text is None:
        return None
    owner = LockOwner.parse(text)
    return (path, owner, text) if owner is None or (owner != LockOwner.me() and _alive(owner)) else None


def live_owner(folder: str | os.PathLike, above: bool = False) -> LockOwner | None:
    """The live process, other than this one, whose lock is in ``folder`` (an unreadable lock: pid 0), else ``None``.

    ``above``: or in a folder above it (a checkpoint folder inside another run's folder).
    """
    folder = os.fspath(folder)
    for candidate in [folder, *(_above(folder) if above else ())]:
        if (held := _holder(candidate)) is not None:
            return held[1] or LockOwner(0, "")
    return None


def _refusal(folder: str, path: str, owner: LockOwner | None, text: str) -> RunFolderInUse:
    why = "two processes in one run folder would interleave their checkpoints and logs"
    if owner is None:
        return RunFolderInUse(
            f"run folder {folder} is locked by {path}, which names no process ({text[:80]!r}): another process may be "
            f"taking it now; if none uses the folder, remove {path} ({why})"
        )
    if owner.host != LockOwner.me().host:
        return RunFolderInUse(
            f"run folder {folder} is in use by pid {owner.pid} on host {owner.host} (lock {path}); whether that "
            f"process lives cannot be checked from {LockOwner.me().host}: once it is known to be gone, run again with "
            f"{BREAK_LOCK_ENV}={owner.token()} to take this lock over, or remove {path} ({why})"
        )
    return RunFolderInUse(
        f"run folder {folder} is in use by pid {owner.pid} on {owner.host} (lock {path}): wait for that run to end or "
        f"stop it ({why})"
    )


def _take_over(path: str, stale: str) -> None:
    """Remove the stale lock whose text is ``stale``, unless another starter replaced it meanwhile."""
    aside = f"{path}.stale-{os.getpid()}"
    try:
        os.rename(path, aside)  # atomic: of two processes taking over, one moves the stale file
    except FileNotFoundError:
        return  # another starter removed it first
    if _read(aside) == stale:
        os.remove(aside)
        return
    # a fresh lock another starter created after the stale one was read: put it back (exclusively: link, not rename)
    with contextlib.suppress(FileExistsError):
        os.link(aside, path)
    os.remove(aside)


def _create_new(path: str) -> int:
    """A file descriptor of a new file at ``path``, never through a link planted there (else ``FileExistsError``)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)


def _publish(path: str, text: str) -> bool:
    """Create the lock file at ``path`` holding ``text`` whole (a private draft hard-linked), unless one exists."""
    draft = f"{path}.draft-{os.getpid()}"
    try:
        fd = _create_new(draft)
    except FileExistsError:
        kind = f"a symbolic link to {os.readlink(draft)!r}" if os.path.islink(draft) else "a file"
        raise RunFolderInUse(
            f"the lock draft {draft} exists ({kind}) and is not this process's: nothing was written through it; "
            f"remove {draft} and run again"
        ) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(draft, path)
        except FileExistsError:
            return False
        except OSError:  # a file system without hard links: exclusive create, then write
            try:
                fd = _create_new(path)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
    finally:
        os.remove(draft)
    return True


@dataclass
class RunFolderLock:
    """A held lock (``path``) on a run ``folder``; :meth:`release` (or leaving the ``with`` block) gives it up."""

    folder: str
    path: str
    created: bool  # whether this process created the folder
    owner: LockOwner  # this process

    @classmethod
    def acquire(cls, folder: str | os.PathLike) -> RunFolderLock:
        """Create ``folder`` if needed and take its lock; a stale lock (docs/trust.md) is taken over.

        Raises:
            RunFolderInUse: another live process holds the lock, or it names no process; naming folder, pid and host.
        """
        folder = os.fspath(folder)
        for parent in _above(folder):  # a folder inside another live run's (a checkpoint folder) is refused like it
            if (held := _holder(parent)) is not None:
                raise _refusal(parent, *held)
        created = not os.path.isdir(folder)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, LOCK_NAME)
        me = LockOwner.me()
        for _ in range(5):  # each pass either wins, is refused, or clears a stale lock for the next pass
            if _publish(path, me.text()):
                return cls(folder, path, created, me)
            text = _read(path)
            if text is None:
                continue  # released between the two calls: try again
            owner = LockOwner.parse(text)
            if owner is None or _alive(owner):
                raise _refusal(folder, path, owner, text) from None
            _take_over(path, text)
        raise RunFolderInUse(f"run folder {folder}: its lock {path} kept changing hands; another process is starting")

    def held(self) -> bool:
        """Whether the lock file still names this process."""
        text = _read(self.path)
        return text is not None and LockOwner.parse(text) == self.owner

    def release(self) -> None:
        """Remove the lock file if it still names this process (a folder removed meanwhile is fine)."""
        if self.held():
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)

    def __enter__(self) -> RunFolderLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
