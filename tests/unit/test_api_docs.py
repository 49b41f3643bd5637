"""docs/api.md and the README agree and lead with `prepare`: the same complete
script, an API table that starts with init and prepare and names every public name, and snippets
that form one script (tests/distributed/test_api_doc.py runs them)."""

from __future__ import annotations

import re

import phalanx
from tests.unit.api_doc import API_DOC, REPO, continued_script, python_blocks


def _table_rows(text: str, after: str) -> list[str]:
    """The rows of the first `| name | what it does |` table after `after`."""
    section = text[text.index(after):]
    start = section.index("| name | what it does |")
    rows = []
    for line in section[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_the_readme_and_api_md_show_the_same_complete_script_through_prepare():
    readme = python_blocks((REPO / "README.md").read_text())[0][1]
    page = python_blocks(API_DOC.read_text())
    assert page[0] == (False, readme)
    assert "phalanx.prepare(" in readme and "phalanx.DataParallel(" not in readme


def test_both_tables_lead_with_init_then_prepare_and_api_md_names_every_public_name():
    page, readme = API_DOC.read_text(), (REPO / "README.md").read_text()
    page_rows, readme_rows = _table_rows(page, "The API is"), _table_rows(readme, "The API is")
    for rows in (page_rows, readme_rows):
        assert rows[0].startswith("| `phalanx.init()` |") and rows[1].startswith("| `phalanx.prepare(model, world=)` |")
    table = "\n".join(page_rows)
    missing = [name for name in phalanx.__all__ if not re.search(rf"`(phalanx\.)?{name}[`(]", table)]
    assert not missing, f"docs/api.md's table does not name {missing}"
    for also in ("dp.accumulate(", 'precision="bf16-mixed"', "world.is_main", "check_finite_every"):
        assert also in table
    readme_names = set(re.findall(r"`phalanx\.(\w+)", "\n".join(readme_rows)))
    assert readme_names <= set(re.findall(r"`phalanx\.(\w+)", table))


def test_the_snippets_continue_the_complete_script():
    blocks = python_blocks(API_DOC.read_text())
    assert sum(continues for continues, _ in blocks) >= 5
    script = continued_script(blocks)
    compile(script, "api.md", "exec")  # one valid script
    assert script.count("dp.close()") == 1 and script.rstrip().endswith("dp.close()")
    for snippet in ("phalanx.barrier(world=world)", "phalanx.gather(", "dp.accumulate(", "checkpoint.pt"):
        assert snippet in script
