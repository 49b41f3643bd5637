"""A user's docs run in a user's clone: README.md and docs/*.md name no path of
this project's development layout (../shared, where the development sample and notes live), which
a fresh clone does not have. Pages that report figures say they were measured on the development
sample, without its path."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
DEVELOPMENT_ONLY = ("../shared", "shared/data/")


def development_paths(page: Path) -> list[str]:
    """`line N: text` for each line of `page` that names a development-only path."""
    return [f"line {number}: {line.strip()}" for number, line in enumerate(page.read_text().splitlines(), 1)
            if any(path in line for path in DEVELOPMENT_ONLY)]


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_no_user_facing_page_names_the_development_layout(page):
    found = development_paths(page)
    assert not found, f"{page.relative_to(REPO)} names a path a fresh clone lacks: " + "; ".join(found)


def test_a_development_path_is_caught(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Quick start\n\n    phalanx train --data-dir ../shared/data/fashion-mnist-sample\n"
                    "phalanx train --data-dir ~/data/fashion-mnist\n")
    assert development_paths(page) == ["line 3: phalanx train --data-dir ../shared/data/fashion-mnist-sample"]
