"""README.md and docs/*.md stand alone: every relative link opens a file of the repository, every ``#anchor``
a heading of its page (GitHub's slugs), and every repository path the prose names (``docs/…``, ``examples/…``,
``bench/…``, …) exists. A reader following the docs meets no dead end and no file outside the checkout."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("docs", "examples", "bench", "primuspipe", "scripts", "tests")
QUOTES_OTHER_REPOS = {"projection.md"}
"""Pages that name files of their sources' repositories (Primus's ``examples/moe_package/README.md``,
Megatron-Bridge's ``scripts/performance/...``) beside the source's URL: their links are checked, bare paths not."""


def _prose(text: str) -> str:
    """The page without fenced code blocks and inline code, where brackets and parentheses are code."""
    return re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to
    hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    for line in re.sub(r"```.*?```", "", page.read_text(), flags=re.S).splitlines():
        if heading := re.match(r"#{1,6}\s+(.*)", line):
            name = slug(heading.group(1))
            found.add(f"{name}-{seen[name]}" if name in seen else name)
            seen[name] = seen.get(name, 0) + 1
    return found


def links(page: Path) -> list[str]:
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", _prose(page.read_text())) if not re.match(r"[a-z]+:", t)]


def _expand(path: str) -> list[str]:
    """A path's brace alternatives (``run_{1,2}.json``: both); ``*`` is left to glob, ``<n>`` placeholders are
    skipped by the caller."""
    if brace := re.search(r"\{([^{}]*)\}", path):
        head, tail = path[:brace.start()], path[brace.end():]
        return [e for alt in brace.group(1).split(",") for e in _expand(head + alt + tail)]
    return [path]


def test_slug_matches_github():
    assert slug("3. What the validator proves") == "3-what-the-validator-proves"
    assert slug("The dump layout, as read") == "the-dump-layout-as-read"
    assert slug("`primuspipe project` (CLI)") == "primuspipe-project-cli"


def test_every_page_is_found():
    assert len(PAGES) > 10 and all(p.exists() for p in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        file, _, anchor = target.partition("#")
        where = (page.parent / file).resolve() if file else page
        if not where.exists() or ROOT not in where.parents:
            broken.append(f"{target}: no such file in the repository")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{target}: no heading #{anchor} in {where.name}")
    assert not broken, f"{page.name}: {broken}"


@pytest.mark.parametrize("page", [p for p in PAGES if p.name not in QUOTES_OTHER_REPOS], ids=lambda p: p.name)
def test_named_repository_paths_exist(page):
    missing = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for path in re.findall(rf"(?<![\w/.:-])((?:{'|'.join(TOP)})/[\w./*{{}},<>-]*[\w*}}>])", line):
            if "<" not in path and not any(list(base.glob(p)) for p in _expand(path) for base in (ROOT, page.parent)):
                missing.append(f"line {number}: {path}")
        outside = re.findall(r"(?<![\w.])(?:/work/|/home/|~/)\S*", line)
        missing += [f"line {number}: {m} (outside the repository)" for m in outside]
    assert not missing, f"{page.name}: {missing}"
