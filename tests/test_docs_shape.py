"""The user docs keep their shape: a README a reader can take in (at most 250 lines, none over 300 characters), a
results top page of current figures (at most 300 lines, the runs on the family pages), no tracker numbers where a
user cannot look them up, and docstrings that name classes by the path they are imported from."""

import re
from pathlib import Path

import pytest
from helpers import ROOT

ROOT_PATH = Path(ROOT)
README_LINES, README_WIDTH, RESULTS_LINES = 250, 300, 300
#: "issue" and a number: a tracker reference (the pattern is split so that this file does not match it)
TRACKER = re.compile(r"\bissue" + r"s? #?\d+", flags=re.I)
#: a Sphinx role or a quoted dotted path that starts at a package of the suite without its import name
BARE_ROLE = re.compile(r"`~?(?:modules|datamodules|callbacks|commands)\.(?!py`)[A-Za-z_][\w.]*`")
TEXT = {".py", ".md", ".yaml", ".json", ".jsonl", ".txt", ".csv"}
SOURCE_DIRS = ("modules", "datamodules", "callbacks", "commands", "tests")


def user_files() -> list[Path]:
    """The README, the docs pages, the configs and the tests: every file a user reads."""
    files = [ROOT_PATH / "README.md", *sorted((ROOT_PATH / "docs").glob("*.md"))]
    files += sorted((ROOT_PATH / "configs").rglob("*.yaml"))
    files += sorted(p for p in (ROOT_PATH / "tests").rglob("*") if p.suffix in TEXT)
    return files


def tracker_numbers(text: str) -> list[str]:
    """Each tracker reference in ``text``."""
    return TRACKER.findall(text)


def bare_roles(text: str) -> list[str]:
    """Each docstring path of ``text`` that names a suite module without ``alignment_games.``."""
    return BARE_ROLE.findall(text)


def test_the_readme_is_short_and_its_lines_fit():
    lines = (ROOT_PATH / "README.md").read_text(encoding="utf-8").split("\n")
    assert len(lines) <= README_LINES + 1  # the file's final newline leaves an empty last item
    assert [i + 1 for i, line in enumerate(lines) if len(line) > README_WIDTH] == []


def test_the_results_top_page_is_short_and_links_every_family_page():
    top = ROOT_PATH / "benchmarks" / "RESULTS.md"
    text = top.read_text(encoding="utf-8")
    assert len(text.rstrip("\n").split("\n")) <= RESULTS_LINES
    pages = sorted((ROOT_PATH / "benchmarks" / "results").glob("*.md"))
    assert pages, "no family pages under benchmarks/results/"
    assert [p.name for p in pages if f"(results/{p.name}" not in text] == []


@pytest.mark.parametrize("path", user_files(), ids=lambda p: str(p.relative_to(ROOT_PATH)))
def test_no_tracker_numbers_in_user_files(path):
    assert tracker_numbers(path.read_text(encoding="utf-8")) == []


def test_docstrings_name_classes_by_their_import_path():
    found = []
    for top in SOURCE_DIRS:
        for path in sorted((ROOT_PATH / top).rglob("*.py")):
            found += [f"{path.relative_to(ROOT_PATH)}: {m}" for m in bare_roles(path.read_text(encoding="utf-8"))]
    found += [f"train.py: {m}" for m in bare_roles((ROOT_PATH / "train.py").read_text(encoding="utf-8"))]
    assert found == []


def test_the_checks_find_what_they_are_for():
    number, hashed = "iss" + "ue 32", "Iss" + "ue #7"
    assert tracker_numbers(f"the SmolLM2 configs ({number}) and {hashed}") == [number, hashed]
    assert tracker_numbers("an issue a user can read; issued 3 times") == []
    role, path = "`~" + "modules.grpo.GRPO`", "`" + "datamodules.prompts.PromptDataModule`"
    assert bare_roles(f":class:{role} and {path}") == [role, path]
    assert bare_roles(":class:`~alignment_games.modules.grpo.GRPO`, `modules/grpo.py`, `callbacks.py`") == []


def unparsed_docstrings() -> list[str]:
    """Each class or function docstring of the suite that the CLI's parser (Google style) cannot read, with its error.

    ``--model.help`` and ``--print_config`` take each argument's help from these; one that does not parse loses all.
    """
    import ast

    docstring_parser = pytest.importorskip("docstring_parser")
    style, bad = docstring_parser.DocstringStyle.GOOGLE, []
    paths = [p for top in SOURCE_DIRS[:-1] for p in sorted((ROOT_PATH / top).rglob("*.py"))] + [ROOT_PATH / "train.py"]
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            kinds = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
            if isinstance(node, kinds) and (doc := ast.get_docstring(node)):
                try:
                    docstring_parser.parse(doc, style=style)
                except docstring_parser.ParseError as e:
                    bad.append(f"{path.relative_to(ROOT_PATH)}:{node.lineno} {node.name}: {e}")
    return bad


def test_every_docstring_parses_as_the_cli_reads_it():
    assert unparsed_docstrings() == []
    docstring_parser = pytest.importorskip("docstring_parser")
    merged = "Args:\n    seed: The seed. **game:\n    the base's arguments.\n"  # a reflow that joined two arguments
    with pytest.raises(docstring_parser.ParseError):
        docstring_parser.parse(merged, style=docstring_parser.DocstringStyle.GOOGLE)
