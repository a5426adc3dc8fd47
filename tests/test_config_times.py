"""One place for each config's measured time: the ``# CPU time:`` line of its header comment. The config tables of
``README.md`` ("CPU quick start") and ``docs/layout.md`` ("The configs") repeat it, and must repeat it exactly."""

import glob
import os
import re

import pytest
from helpers import ROOT
from helpers.config_header import header_time

CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
NAMED = re.compile(r"`(?:configs/)?(\w+)\.yaml`")
AFTER = re.compile(r"\(after [^)]*\)")
TABLES = {"README.md": "| family | config |", os.path.join("docs", "layout.md"): "| config | what it runs |"}


def expected_cell(names: list[str], times: dict[str, str]) -> str:
    """A table's time cell for the configs a row names: their common time, else each config's in turn."""
    if not names:
        return "—"
    if len({times[n] for n in names}) == 1:
        return times[names[0]]
    return "; ".join(f"`{n}.yaml` {times[n]}" for n in names)


def table_rows(page: str) -> list[tuple[int, list[str]]]:
    """(line number, cells) of each body row of the page's config table."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        lines = f.read().split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith(TABLES[page]))
    rows = []
    for i in range(start + 2, len(lines)):
        if not lines[i].startswith("|"):
            break
        # a cell's own "|" is written "\|"
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", lines[i])[1:-1]]
        rows.append((i + 1, cells))
    return rows


def test_every_config_header_states_its_time():
    assert CONFIGS  # the glob found the folder
    assert all(header_time(c) for c in CONFIGS)


def test_a_header_without_its_time_is_refused_by_name(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("# A config.\nseed_everything: 0\n# CPU time: below the header, so not read\n")
    with pytest.raises(ValueError, match=r"x\.yaml: the header comment needs one '# CPU time: \.\.\.' line, found 0"):
        header_time(str(path))


@pytest.mark.parametrize("page", list(TABLES))
def test_the_config_table_gives_each_configs_header_time(page):
    times = {os.path.basename(c)[: -len(".yaml")]: header_time(c) for c in CONFIGS}
    rows = table_rows(page)
    wrong = []
    for line, cells in rows:
        config, time = cells[1 if page == "README.md" else 0], cells[-1]
        names = NAMED.findall(AFTER.sub("", config))  # "(after `configs/x.yaml`)": a job to run first
        unknown = [n for n in names if n not in times]
        assert not unknown, f"{page}:{line}: no configs/{unknown[0]}.yaml"
        if time != expected_cell(names, times):
            wrong.append(f"{page}:{line}: {time!r} != {expected_cell(names, times)!r}")
    assert wrong == []
    if page == "README.md":  # the README's table lists every config
        listed = {n for _, cells in rows for n in NAMED.findall(AFTER.sub("", cells[1]))}
        assert listed == set(times)
