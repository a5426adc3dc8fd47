"""A file's sha256 kept beside it (``<file>.sha256``, ``sha256sum`` format) and checked before the file is believed.

The sidecar catches bytes changed after the save (a bad disk, a copy cut short, an edit); it proves nothing about
who wrote the file: whoever can rewrite the file can rewrite its sidecar too.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import warnings

from alignment_games.callbacks.functional.files import fsync_dir

__all__ = ["SIDECAR_SUFFIX", "read_sidecar", "sha256_file", "sidecar_of", "verify_sidecar", "write_sidecar"]

SIDECAR_SUFFIX = ".sha256"
_LINE = re.compile(r"^(?P<digest>[0-9a-f]{64}) [ *](?P<name>.+)$")
# files verified in this process, by real path: (size, mtime, inode, ctime) of the file and of its sidecar
_verified: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}


def sidecar_of(path: str | os.PathLike) -> str:
    """Where the sha256 of ``path`` is kept: ``<path>.sha256``."""
    return os.fspath(path) + SIDECAR_SUFFIX


def sha256_file(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes (read in chunks, never whole)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()  # type: ignore[arg-type]


def write_sidecar(path: str | os.PathLike, digests: list[str]) -> None:
    """Write ``digests`` (the first is the file's; a second is the one it replaces) to ``path``'s sidecar, atomically.

    The sidecar of a file about to be renamed over holds both digests for the moment between the two renames, so a
    kill there leaves either file accepted.
    """
    target = sidecar_of(path)
    name = os.path.basename(os.fspath(path))
    tmp = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="ascii") as f:
            f.writelines(f"{digest}  {name}\n" for digest in digests)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(target))


def read_sidecar(path: str | os.PathLike) -> list[str] | None:
    """The digests ``path``'s sidecar accepts; ``None`` when there is no sidecar.

    Raises:
        ValueError: naming a sidecar that is not ``sha256sum`` lines for ``path``.
    """
    target = sidecar_of(path)
    try:
        with open(target, encoding="ascii") as f:
            lines = f.read(4096).splitlines()
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise ValueError(f"{target}: unreadable sha256 sidecar ({err}); delete it to load {path} unverified") from err
    found = [_LINE.match(line) for line in lines]
    name = os.path.basename(os.fspath(path))
    if not lines or any(m is None or m.group("name") != name for m in found):
        raise ValueError(f"{target}: not sha256sum lines for {name!r}; delete it to load {path} unverified")
    return [m.group("digest") for m in found if m is not None]


def _stamp(path: str) -> tuple[int, ...]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns


def verify_sidecar(path: str | os.PathLike, what: str = "checkpoint") -> bool:
    """Check ``path`` (a link: the file it points to) against its sidecar; ``False`` (and a warning) without one.

    A file verified once in this process is not hashed again while it and its sidecar are unchanged.

    Raises:
        ValueError: naming the file, its sha256 and the one its sidecar records, when they differ.
    """
    real = os.path.realpath(path)
    digests = read_sidecar(real)
    if digests is None:
        warnings.warn(
            f"{what} {os.fspath(path)!r} has no {SIDECAR_SUFFIX} sidecar (written before sidecars, or by another "
            "writer): loaded without checking its bytes",
            stacklevel=2,
        )
        return False
    stamps = _stamp(real), _stamp(sidecar_of(real))
    if _verified.get(real) == stamps:
        return True
    actual = sha256_file(real)
    if actual not in digests:
        raise ValueError(
            f"{what} {os.fspath(path)!r} is corrupt: its sha256 is {actual}, but {sidecar_of(real)} records "
            f"{digests[0]} (bytes changed after it was written); resume from another checkpoint, or delete the "
            "sidecar to load it unverified"
        )
    _verified[real] = stamps
    return True
