"""One writer for a run's artifacts (reports, records, figures, checkpoint folders): never a torn one."""

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from alignment_games.callbacks.functional.digests import verify_manifest, write_manifest
from alignment_games.callbacks.functional.files import (
    NO_ROOM,
    fsync_dir,
    no_room_left,
    os_error_behind,
    path_being_written,
    write_error,
)

#: called with "written" and "old_aside" (between the two renames); tests set it to kill the process there
SWAP_HOOK: Callable[[str], None] | None = None


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and ``os.replace`` (never a part).

    Raises:
        OSError: naming ``path`` (:func:`write_error`) when it cannot be written; ``path`` is left as it was.
    """
    path = os.fspath(path)
    folder = os.path.dirname(path) or "."
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    except OSError as err:
        raise write_error(err, path) from err
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        if isinstance(err, OSError):
            raise write_error(err, path) from err
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """:func:`atomic_write_bytes` of UTF-8 text."""
    atomic_write_bytes(path, text.encode("utf-8"))


def _beside(path: str, tag: str) -> str:
    parent, name = os.path.split(os.fspath(path).rstrip(os.sep))
    return os.path.join(parent, f".{name}.{tag}")


def folder_beside(path: str | os.PathLike) -> str:
    """The folder a new version of ``path`` is written into before :func:`swap_folder_in`: ``.<name>.partial``."""
    return _beside(os.fspath(path), "partial")


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _outside(previous: str, folder: str) -> bool:
    """Whether ``previous`` is a link, or resolves outside ``folder`` (a leftover someone else placed there)."""
    if os.path.islink(previous):
        return True
    parent = os.path.realpath(folder or ".")
    return os.path.commonpath([os.path.realpath(previous), parent]) != parent


def recover_folder(path: str | os.PathLike) -> bool:
    """Finish or undo a swap a kill interrupted (rank 0, no save running); return whether the old version was put back.

    A ``.<name>.previous`` that is a symbolic link or resolves outside the folder is never put back.

    Raises:
        ValueError: naming the ``.previous`` link and where it points.
    """
    path = os.fspath(path).rstrip(os.sep)
    previous = _beside(path, "previous")
    restored = False
    if os.path.lexists(previous):
        if os.path.lexists(path):  # the swap finished; only the removal of the old one was cut short
            _remove(previous)  # a link is unlinked, never followed
        elif _outside(previous, os.path.dirname(path)):
            raise ValueError(
                f"{previous!r} is a symbolic link (to {os.path.realpath(previous)!r}) or lies outside "
                f"{os.path.dirname(path) or '.'!r}: not restored as {os.path.basename(path)!r} (a save only renames "
                "a real folder aside); it is left untouched: remove it, or give --ckpt_path a checkpoint you trust"
            )
        else:  # killed between the two renames: the old version is the whole one
            os.rename(previous, path)
            fsync_dir(os.path.dirname(path))
            restored = True
    _remove(folder_beside(path))  # a save killed before its swap
    return restored


def recover_folder_on_rank_zero(strategy: Any, path: str | os.PathLike, barrier: str) -> None:
    """On rank 0, :func:`recover_folder` and :func:`verify_manifest` before a load; then all ranks meet at ``barrier``.

    Raises:
        ValueError: ``recover_folder``'s refusal, or a file whose bytes changed, on every rank (none waits for rank 0).
    """
    refused = None
    if strategy.global_rank == 0:
        try:
            recover_folder(path)
            if os.path.isdir(path):
                verify_manifest(path)
        except ValueError as err:
            refused = str(err)
    if refused := strategy.broadcast(refused):
        raise ValueError(refused)
    strategy.barrier(barrier)


def prepare_folder_beside(path: str | os.PathLike) -> str:
    """Recover ``path`` (:func:`recover_folder`) and create an empty :func:`folder_beside` it; returns that folder."""
    recover_folder(path)
    os.makedirs(tmp := folder_beside(path))
    return tmp


def swap_folder_in(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Replace ``path`` (a folder, a file or nothing) by the complete folder ``tmp``.

    Two renames; a kill between them leaves ``.<name>.previous`` for :func:`recover_folder`.
    """
    tmp, path = os.fspath(tmp), os.fspath(path).rstrip(os.sep)
    parent = os.path.dirname(path)
    fsync_dir(tmp)
    if SWAP_HOOK is not None:
        SWAP_HOOK("written")
    previous = _beside(path, "previous")
    if had_old := os.path.lexists(path):
        os.rename(path, previous)
        fsync_dir(parent)
    if SWAP_HOOK is not None:
        SWAP_HOOK("old_aside")
    os.rename(tmp, path)
    fsync_dir(parent)
    if had_old:
        _remove(previous)


@contextlib.contextmanager
def saved_beside(strategy: Any, filepath: Any, name: str) -> Iterator[str]:
    """Every rank writes a checkpoint into the folder beside ``filepath`` yielded here; rank 0 then swaps it in.

    Raises:
        OSError: naming ``filepath`` (and the shard file, when known) for a full disk while the shards are written
            (DCP's ``CheckpointException`` and DeepSpeed's ``torch.save`` name no path); the previous checkpoint is
            left as it was.
    """
    path = Path(strategy.broadcast(str(filepath)))
    tmp = folder_beside(path)
    if strategy.global_rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        prepare_folder_beside(path)
    strategy.barrier(f"{name}_save_prepared")
    try:
        yield tmp
    except BaseException as err:
        cause = os_error_behind(err)
        free = no_room_left(tmp) if cause is None and isinstance(err, RuntimeError) else None
        if free is not None:  # torch's C++ writer (DeepSpeed's files) names neither the errno nor the file
            cause = OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({free} bytes free after: {err})")
        if cause is not None and cause.errno in NO_ROOM:
            shard = cause.filename or path_being_written(cause)
            detail = f"{cause.strerror} (writing {shard})" if shard else cause.strerror
            raise write_error(OSError(cause.errno, detail), path) from err
        raise
    strategy.barrier(f"{name}_save_written")
    if strategy.global_rank == 0:
        write_manifest(tmp)  # every rank's files are there: their sha256, checked when the folder is loaded
        swap_folder_in(tmp, path)
    strategy.barrier(f"{name}_save_swapped")


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike) -> Iterator[str]:
    """Write a folder whole or not at all: yields an empty folder beside ``path``, swapped in when the block ends.

    On an exception the new folder is removed and ``path`` left as it was (an ``OSError`` names ``path``).
    """
    tmp = prepare_folder_beside(path)
    try:
        yield tmp
    except BaseException as err:
        _remove(tmp)
        if isinstance(err, OSError):  # a full disk while the block wrote: name the folder being written
            raise write_error(err, path) from err
        raise
    try:
        swap_folder_in(tmp, path)
    except OSError as err:
        raise write_error(err, path) from err
