"""One process at a time in a run folder: ``<run folder>/run.lock`` names the owner's pid and host.

A lock whose pid is gone on this host is stale and taken over; one naming another host is refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from dataclasses import dataclass

from alignment_games.callbacks.functional.files import pid_alive

__all__ = ["LOCK_NAME", "LockOwner", "RunFolderInUse", "RunFolderLock", "live_owner"]

LOCK_NAME = "run.lock"


class RunFolderInUse(RuntimeError):
    """Another live process owns the run folder (or its lock cannot be read)."""


@dataclass(frozen=True)
class LockOwner:
    """Who holds a lock: a process id on a host."""

    pid: int
    host: str

    @classmethod
    def me(cls) -> LockOwner:
        """The owner record of the calling process."""
        return cls(os.getpid(), socket.gethostname())

    def text(self) -> str:
        """The lock file's content."""
        return json.dumps({"pid": self.pid, "host": self.host}) + "\n"

    @classmethod
    def parse(cls, text: str) -> LockOwner | None:
        """The owner a lock file's ``text`` names, or ``None`` when it names none (empty, garbled, a bad pid)."""
        try:
            record = json.loads(text)
        except ValueError:
            return None
        if not isinstance(record, dict):
            return None
        pid, host = record.get("pid"), record.get("host")
        if type(pid) is not int or pid <= 0 or not isinstance(host, str) or not host:
            return None
        return cls(pid, host)


def _alive(owner: LockOwner) -> bool:
    """Whether ``owner`` may still be running (a process on another host is assumed to be)."""
    me = LockOwner.me()
    if owner.host != me.host:
        return True
    if owner.pid == me.pid:  # an earlier process that had this pid (a restarted container): not this one's lock
        return False
    return pid_alive(owner.pid)


def _read(path: str) -> str | None:
    """The lock file's text, or ``None`` when there is none."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(4096)
    except FileNotFoundError:
        return None


def live_owner(folder: str | os.PathLike) -> LockOwner | None:
    """The live process, other than this one, whose lock is in ``folder`` (an unreadable lock: pid 0), else ``None``."""
    text = _read(os.path.join(os.fspath(folder), LOCK_NAME))
    if text is None:
        return None
    owner = LockOwner.parse(text)
    if owner is None:
        return LockOwner(0, "")
    return owner if owner != LockOwner.me() and _alive(owner) else None


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
            f"process lives cannot be checked from {LockOwner.me().host}: if it is gone, remove {path} ({why})"
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


def _publish(path: str, text: str) -> bool:
    """Create the lock file at ``path`` holding ``text`` whole (a private draft hard-linked), unless one exists."""
    draft = f"{path}.draft-{os.getpid()}"
    with open(draft, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(draft, path)
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links: exclusive create, then write
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
    finally:
        os.remove(draft)
    return True


@dataclass
class RunFolderLock:
    """A held lock on a run folder; :meth:`release` (or leaving the ``with`` block) gives it up.

    Attributes:
        folder: the run folder.
        path: the lock file.
        created: whether this process created the folder.
        owner: this process.
    """

    folder: str
    path: str
    created: bool
    owner: LockOwner

    @classmethod
    def acquire(cls, folder: str | os.PathLike) -> RunFolderLock:
        """Create ``folder`` if needed and take its lock; a stale lock (its pid gone, on this host) is taken over.

        Raises:
            RunFolderInUse: another live process holds the lock, or it names no process; naming folder, pid and host.
        """
        folder = os.fspath(folder)
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
