"""Every relative link in README.md and docs/*.md resolves: the file exists, and an #anchor names
a heading of the page it points to (GitHub's slug rule: lower case, punctuation but hyphens and
underscores dropped, spaces to hyphens). Links to the web are not fetched (CI has no network)."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# [text](target) and ![alt](target), an optional "title" after the target.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCED = re.compile(r"```.*?```", re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The #anchors a page's headings make (headings inside fenced code are not headings)."""
    text = FENCED.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"(?m)^#{1,6}\s+(.*)$", text)}


def links(page: Path) -> list[str]:
    """Link targets outside code (`a[i](x)` in code is not a link)."""
    text = INLINE_CODE.sub("", FENCED.sub("", page.read_text()))
    return [m.group(1) for m in LINK.finditer(text)]


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = page if not path_part else (page.parent / path_part).resolve()
        if not dest.exists():
            broken.append(f"{target}: {dest} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    return broken


def test_the_docs_folder_holds_the_linked_pages():
    assert len(PAGES) > 5 and all(links(p) for p in PAGES[:1])


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_relative_links_resolve(page):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_slug_follows_githubs_rule():
    assert slug("Bad input") == "bad-input"
    assert slug("Three ways to split the work: `--split data|layers|channels`") == \
        "three-ways-to-split-the-work---split-datalayerschannels"


def test_a_broken_link_or_anchor_is_caught(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n```\n# not a heading\n```\n")
    page = tmp_path / "p.md"
    page.write_text("# Title\n[a](missing.md) [b](#title) [c](other.md#other) [d](other.md#not-a-heading) "
                    "`[e](code.md)` ![f](other.md) [g](https://example.org/x)\n")
    assert links(page) == ["missing.md", "#title", "other.md#other", "other.md#not-a-heading", "other.md",
                           "https://example.org/x"]
    broken = broken_links(page)
    assert len(broken) == 2 and broken[0].startswith("missing.md") and "#not-a-heading" in broken[1]
