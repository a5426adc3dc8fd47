"""File-system helpers shared by the callbacks' atomic writes and the modules' folder swaps (plain ``os``)."""

from __future__ import annotations

import contextlib
import os

__all__ = ["fsync_dir"]


def fsync_dir(folder: str) -> None:
    """Flush ``folder``'s entries (a rename or a new file in it) to disk; ``""`` is the working directory."""
    with contextlib.suppress(OSError):  # some file systems cannot open or sync a directory: passed over
        fd = os.open(folder or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
