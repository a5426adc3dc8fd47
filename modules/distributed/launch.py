"""Ranks started by a launcher die with it, so no rank waits alone for a process group that cannot form."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def follow_the_launcher(environ: dict[str, str] | None = None) -> bool:
    """Have this process receive SIGTERM when its parent ends, if it is a rank another rank launched.

    Otherwise a child whose rank 0 died before the process group formed waits 30 minutes for its store. Linux only
    (``prctl``); returns whether the parent's end is now signalled.
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
