"""A file's sha256 kept beside it (``<file>.sha256``), a folder's in its ``SHA256SUMS``, checked before use.

Both are ``sha256sum`` format. They catch bytes changed after the save (a bad disk, a copy cut short, an edit); they
prove nothing about who wrote the file: whoever can rewrite the file can rewrite its sidecar too.
"""

import contextlib
import hashlib
import os
import re
import warnings

from alignment_games.callbacks.functional.files import fsync_dir

__all__ = [
    "MANIFEST",
    "SIDECAR_SUFFIX",
    "read_sidecar",
    "sha256_file",
    "sidecar_of",
    "verify_manifest",
    "verify_sidecar",
    "write_manifest",
    "write_sidecar",
]

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
    """Write ``digests`` (the file's, then any it replaces: a kill between two renames leaves either accepted)."""
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
    """Check ``path`` (or the file it links to) against its sidecar; ``False`` (and a warning) without one.

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
    if (actual := sha256_file(real)) not in digests:
        raise ValueError(
            f"{what} {os.fspath(path)!r} is corrupt: its sha256 is {actual}, but {sidecar_of(real)} records "
            f"{digests[0]} (bytes changed after it was written); resume from another checkpoint, or delete the "
            "sidecar to load it unverified"
        )
    _verified[real] = stamps
    return True


#: the file in a sharded checkpoint folder listing the sha256 of every other file in it (``sha256sum -c`` reads it)
MANIFEST = "SHA256SUMS"


def _folder_files(folder: str) -> list[str]:
    """Every regular file under ``folder``, as ``/``-separated paths relative to it, the manifest left out, sorted."""
    found = (os.path.relpath(os.path.join(root, n), folder) for root, _, names in os.walk(folder) for n in names)
    return sorted(rel.replace(os.sep, "/") for rel in found if rel != MANIFEST)


def write_manifest(folder: str | os.PathLike) -> None:
    """Write ``folder``'s :data:`MANIFEST`: the sha256 of every file under it (a sharded checkpoint before its swap)."""
    folder = os.fspath(folder)
    with open(os.path.join(folder, MANIFEST), "w", encoding="utf-8") as f:
        f.writelines([f"{sha256_file(os.path.join(folder, rel))}  {rel}\n" for rel in _folder_files(folder)])
        f.flush()
        os.fsync(f.fileno())


def verify_manifest(folder: str | os.PathLike, what: str = "checkpoint") -> bool:
    """Check every file of the folder ``folder`` against its :data:`MANIFEST`; ``False`` (and a warning) without one.

    Raises:
        ValueError: naming the folder and the file that is missing, changed, or not written by the save.
    """
    folder = os.fspath(folder)
    manifest = os.path.join(folder, MANIFEST)
    try:
        with open(manifest, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        warnings.warn(
            f"{what} {folder!r} has no {MANIFEST} (written before manifests): loaded without checking its files' bytes",
            stacklevel=2,
        )
        return False
    found = [_LINE.match(line) for line in lines]
    if any(m is None or ".." in m.group("name").split("/") or m.group("name").startswith("/") for m in found):
        raise ValueError(f"{manifest}: not sha256sum lines of files inside the folder; delete it to load unverified")
    recorded = {m.group("name"): m.group("digest") for m in found if m is not None}
    if extra := sorted(set(_folder_files(folder)) - set(recorded)):
        raise ValueError(f"{what} {folder!r}: {extra[0]} was not written by the save ({MANIFEST} does not list it)")
    for rel, digest in sorted(recorded.items()):
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            raise ValueError(f"{what} {folder!r}: {rel} is missing ({MANIFEST} lists it)")
        if (actual := sha256_file(path)) != digest:
            raise ValueError(
                f"{what} {folder!r} is corrupt: {rel} has sha256 {actual}, but {MANIFEST} records {digest} (bytes "
                "changed after it was written); resume from another checkpoint"
            )
    return True
