"""The python blocks of docs/api.md, as its tests read them: a block fenced ```python is a script
that runs as it stands; one fenced ```python continues goes on from the page's first script
(before that script's closing `dp.close()`). `continued_script` makes the one script they form."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
API_DOC = REPO / "docs" / "api.md"
_BLOCK = re.compile(r"^```python( continues)?\n(.*?)^```", re.S | re.M)
_CLOSE = "dp.close()\n"


def python_blocks(text: str) -> list[tuple[bool, str]]:
    """(continues?, code) for every python block of `text`, in order."""
    return [(bool(m.group(1)), m.group(2)) for m in _BLOCK.finditer(text)]


def continued_script(blocks: list[tuple[bool, str]]) -> str:
    """The first script with every continuing block inserted, in order, before its final `dp.close()`."""
    first = blocks[0][1]
    assert not blocks[0][0] and first.endswith(_CLOSE), "the page's first python block must be a whole script"
    return first[:-len(_CLOSE)] + "".join(code for continues, code in blocks if continues) + _CLOSE
