"""The documentation's shape: what ``mkdocs build --strict`` (run by ``make test``) cannot see.

The strict build fails on a broken link or anchor inside ``docs/`` and on a page left out of the
nav. It never reads the README, so these checks do: the README stays an overview (under 250
lines), every link from it into the repository resolves, it reaches the documentation's home page
(which reaches every page), and it lists every lesson in ``notebooks/``. They read files only.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _nav_pages(node) -> list[str]:
    """Every page a mkdocs nav names, depth first."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [p for v in node.values() for p in _nav_pages(v)]
    return [p for v in node for p in _nav_pages(v)]


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists():
    yaml = pytest.importorskip("yaml")
    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(set(nav)) == pages, (
        f"pages missing from mkdocs.yml's nav: {sorted(set(pages) - set(nav))}; "
        f"nav entries with no file under docs/: {sorted(set(nav) - set(pages))}")
    assert len(nav) == len(set(nav)), "a page is in mkdocs.yml's nav twice"


def test_readme_is_an_overview_whose_links_resolve():
    text = README.read_text()
    lines = text.count("\n")
    assert lines < 250, f"README.md has {lines} lines: move reference material to a page under docs/"
    targets = [t.split("#")[0] for t in LINK.findall(text) if "://" not in t and not t.startswith("#")]
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
    assert "docs/index.md" in targets, "README.md must link the documentation's home page, docs/index.md"
    assert "make docs" in text, "README.md must say how to build and read the documentation (make docs)"


def test_readme_and_the_lessons_page_list_every_lesson():
    lessons = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9]*.py"))
    assert lessons, "no lesson scripts found in notebooks/"
    for page in (README, DOCS / "lessons.md"):
        listed = set(re.findall(r"^\| `(\d\d[^`]*)` \|", page.read_text(), flags=re.M))
        assert listed == set(lessons), (
            f"{page.relative_to(ROOT)}'s lessons table: missing {sorted(set(lessons) - listed)}, "
            f"no such notebook {sorted(listed - set(lessons))}")


def test_every_docs_page_is_reachable_by_links_from_the_readme():
    """Read on GitHub, without the site's nav, every page is still a chain of links from the README."""
    seen, todo = set(), [README.resolve()]
    while todo:
        page = todo.pop()
        if page in seen or page.suffix != ".md" or not page.exists():
            continue
        seen.add(page)
        for target in LINK.findall(page.read_text()):
            if "://" not in target and not target.startswith("#"):
                todo.append((page.parent / target.split("#")[0]).resolve())
    pages = {p.resolve() for p in DOCS.rglob("*.md")}
    unreachable = sorted(str(p.relative_to(ROOT)) for p in pages - seen)  # docs/changelog.md is a link to CHANGELOG.md
    assert not unreachable, f"docs pages no chain of links from README.md reaches: {unreachable}"
