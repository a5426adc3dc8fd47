"""What a config's leading comment block states for the tests: its measured time (``# CPU time: ...``, one line) and
its smoke overrides (``# Smoke: ...``, any number of lines: the options ``tests/test_configs.py`` adds to the config's
``fast_dev_run`` so that it runs small and offline; ``{tiny_lm_dir}`` is the tests' tiny model)."""

from __future__ import annotations

import re
import shlex


def header_values(path: str, key: str) -> list[str]:
    """The values of the ``# <key>: <value>`` lines of the config's leading comment block, in order."""
    pattern, found = re.compile(rf"^# {re.escape(key)}: (.+)$"), []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.startswith("#"):
                break
            if m := pattern.match(line.rstrip("\n")):
                found.append(m.group(1))
    return found


def header_time(path: str) -> str:
    """The ``# CPU time:`` line of a config's leading comment block.

    Raises:
        ValueError: naming the file, when the header has no such line or more than one.
    """
    found = header_values(path, "CPU time")
    if len(found) != 1:
        raise ValueError(f"{path}: the header comment needs one '# CPU time: ...' line, found {len(found)}")
    return found[0]


def smoke_args(path: str, **fill: str) -> list[str]:
    """The command-line options of the config's ``# Smoke:`` lines, ``{name}`` placeholders filled from ``fill``."""
    return [arg.format(**fill) for line in header_values(path, "Smoke") for arg in shlex.split(line)]
