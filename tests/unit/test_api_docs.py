"""docs/api.md and the README agree and lead with `prepare`: the same complete
script, an API table that starts with init and prepare and names every public name, and snippets
that form one script (tests/distributed/test_api_doc.py runs them)."""

from __future__ import annotations

import inspect
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


PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _calls(text: str):
    """(name, keywords) of every `phalanx.NAME(...)` and `prepare(...)` call in `text`'s code, the
    keywords at the call's own depth (`f(x, a=g(b=1))` passes a= only). A `>>>` line is a session
    showing what phalanx refuses (horovod-deepspeed.md's `prepare(..., config=...)`): left out."""
    code = "\n".join(re.findall(r"```[^\n]*\n(.*?)```", text, re.S) +
                     re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)))
    code = re.sub(r"(?m)^>>> .*$", "", code)
    for match in re.finditer(r"(?<![\w.])(?:phalanx\.(\w+)|(prepare))\(", code):
        depth, keywords, start = 1, [], match.end()
        for i in range(match.end(), len(code)):
            depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(code[i], 0)
            if depth == 0 or (depth == 1 and code[i] == ","):
                keyword = re.match(r"\s*(\w+)=(?!=)", code[start:i])
                keywords += [keyword.group(1)] if keyword else []
                start = i + 1
            if depth == 0:
                break
        yield match.group(1) or match.group(2), keywords


def test_every_keyword_the_docs_pass_to_a_phalanx_name_is_in_its_signature():
    # help() and an editor show inspect.signature: a keyword only **kwargs takes is invisible there
    # (ShardedLoader's global_batch_size was, before it wrapped data/loader.py's __init__).
    wrong = []
    for page in PAGES:
        for name, keywords in _calls(page.read_text()):
            if name not in phalanx.__all__ and name != "prepare":
                continue  # phalanx.verify.verify, a module's function: not the front door's
            parameters = inspect.signature(getattr(phalanx, name)).parameters
            wrong += [f"{page.name}: phalanx.{name}({keyword}=)" for keyword in keywords if keyword not in parameters]
    assert not wrong, "keywords the docs pass that the signature does not name: " + ", ".join(sorted(set(wrong)))


def test_the_call_reader_finds_keywords_at_the_calls_own_depth():
    text = "`phalanx.reduce(t, op=\"sum\", world=world)` and\n```python\n>>> prepare(m, config=1)\nphalanx.shard_loss(F.cross_entropy(x, y, " \
           "reduction=\"sum\"), g)\ndp = prepare(m, world=w, shard={\"a\": 1})\n```\n"
    assert list(_calls(text)) == [("shard_loss", []), ("prepare", ["world", "shard"]), ("reduce", ["op", "world"])]
