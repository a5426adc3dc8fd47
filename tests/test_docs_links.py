"""Every relative link in ``README.md``, ``docs/*.md`` and the results pages (``benchmarks/RESULTS.md``, its family
pages and its log) points to a file that exists, and every ``#anchor`` to a heading of its page (GitHub's slugs).
Links inside code blocks and inline code are not links."""

import re
from pathlib import Path

import pytest
from helpers import ROOT

ROOT_PATH = Path(ROOT)
PAGES = [ROOT_PATH / "README.md", *sorted((ROOT_PATH / "docs").glob("*.md"))]
RESULT_PAGES = [
    ROOT_PATH / "benchmarks" / "RESULTS.md",
    *sorted((ROOT_PATH / "benchmarks" / "results").glob("*.md")),
    *sorted((ROOT_PATH / "benchmarks" / "log").glob("*.md")),
]

FENCE = re.compile(r"^(```|~~~).*?^\1", flags=re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"(?<!\!)\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMAGE = re.compile(r"\!\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", flags=re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", flags=re.I)  # http:, https:, mailto:, ...


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of ``page``'s headings (repeated headings get ``-1``, ``-2``, … as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = slug(heading)
        count = seen.get(base, 0)
        found.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return found


def broken_links(page: Path) -> list[str]:
    """Each relative link of ``page`` whose file does not exist, or whose anchor is not a heading there."""
    text = _prose(page.read_text(encoding="utf-8"))
    broken = []
    for target in LINK.findall(text) + IMAGE.findall(text):
        if EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            broken.append(f"{target} (no file {resolved})")
        elif anchor and resolved.suffix == ".md" and resolved.is_file() and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading #{anchor} in {resolved.name})")
    return broken


@pytest.mark.parametrize("page", PAGES + RESULT_PAGES, ids=lambda p: str(p.relative_to(ROOT_PATH)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_the_readme_links_the_docs_pages_and_the_results():
    text = _prose((ROOT_PATH / "README.md").read_text(encoding="utf-8"))
    targets = {t.partition("#")[0] for t in LINK.findall(text)}
    assert "benchmarks/RESULTS.md" in targets
    for page in PAGES[1:]:  # every page under docs/ is reachable from the README
        assert f"docs/{page.name}" in targets, page.name


def test_the_checker_finds_broken_links_and_ignores_code(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "there.md").write_text("# A page\n\n## Second `part`, here\n")
    page = tmp_path / "README.md"
    page.write_text(
        "# Title\n\n## Two words\n\n"
        "[ok](docs/there.md) [ok anchor](docs/there.md#second-part-here) [self](#two-words) [web](https://x.org/a.md)\n"
        "[gone](docs/missing.md) [bad anchor](docs/there.md#nowhere) [bad self](#three-words) ![img](fig.png)\n"
        "`[in code](docs/nope.md)`\n\n```bash\n[also code](docs/nope2.md)\n```\n"
    )
    assert broken_links(page) == [
        f"docs/missing.md (no file {(tmp_path / 'docs' / 'missing.md').resolve()})",
        "docs/there.md#nowhere (no heading #nowhere in there.md)",
        "#three-words (no heading #three-words in README.md)",
        f"fig.png (no file {(tmp_path / 'fig.png').resolve()})",
    ]


def test_slugs_follow_github():
    assert slug("Checkpoints: what they hold, what they refuse, resuming") == (
        "checkpoints-what-they-hold-what-they-refuse-resuming"
    )
    assert slug("Loading a language model: `lm`") == "loading-a-language-model-lm"
    assert slug("CPU quick start, one family at a time") == "cpu-quick-start-one-family-at-a-time"
