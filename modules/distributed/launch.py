"""Ranks started by a launcher die with it, so no rank waits alone for a process group that cannot form."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["follow_the_launcher"]

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def follow_the_launcher(environ: dict[str, str] | None = None) -> bool:
    """Have this process receive SIGTERM when its parent ends, if it is a rank another rank launched.

    Lightning's DDP launcher starts ranks 1.. as children of rank 0 with ``LOCAL_RANK`` set. If rank 0 ends before the
    process group forms (a SIGTERM while it loads the model), a child would wait for rank 0's store until its
    30-minute timeout; with this it gets SIGTERM at once and ends as a signalled rank does. Linux only (``prctl``);
    elsewhere, and for rank 0 or a process no launcher started, nothing changes.

    Returns:
        Whether the parent's end is now signalled to this process.
    """
    environ = os.environ if environ is None else environ
    if not sys.platform.startswith("linux") or int(environ.get("LOCAL_RANK", "0") or 0) <= 0:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() == 1:  # the launcher ended before the request took effect: this process was adopted by init
        os.kill(os.getpid(), signal.SIGTERM)
    return True
