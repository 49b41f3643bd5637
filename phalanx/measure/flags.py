"""Flag values the measuring commands share: comma-separated lists and binary sizes.

`parse_list` is the one reading of a list flag (`--devices 1,2,4`, `--sizes 4KB,1MB`, `--lr
0.1,scaled`) for bench, predict, sweep and verify: a bad item or an empty list is one UsageError
line naming the flag. `parse_size` / `format_size` read and write message sizes in binary units,
as nccl-tests' -b/-e do. The parsers themselves (the `add_*_parser` functions) stay with their
commands; these only turn a flag's text into values.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from phalanx.errors import UsageError

T = TypeVar("T")
_SIZE_UNITS = {"B": 1, "KB": 1024, "MB": 1024**2, "GB": 1024**3}  # binary, as nccl-tests' -b/-e
_PLAIN = (int, float, str)  # their ValueError speaks Python ("invalid literal for int()"), not to a user


def parse_list(text: str, item: Callable[[str], T], *, flag: str) -> tuple[T, ...]:
    """A comma-separated flag value as a tuple (blank items skipped). A bad item is one line: for
    int / float, naming the flag and the type; for a parser of its own, that parser's ValueError
    (which names the flag and the fix); an empty list asks for at least one value."""
    try:
        values = tuple(item(part.strip()) for part in str(text).split(",") if part.strip())
    except ValueError as exc:
        if item in _PLAIN:
            raise UsageError(f"{flag} {text!r} is not a comma-separated list of {item.__name__}") from None
        raise UsageError(str(exc)) from None
    if not values:
        raise UsageError(f"{flag} is empty; give at least one value")
    return values


def parse_size(text: str) -> int:
    """'64KB' -> 65536 bytes (binary units B, KB, MB, GB; a bare number is bytes)."""
    clean = text.strip().upper().replace("IB", "B")
    for unit in sorted(_SIZE_UNITS, key=len, reverse=True):
        if clean.endswith(unit) and clean[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(clean[: -len(unit)]) * _SIZE_UNITS[unit])
    if clean.isdigit():
        return int(clean)
    raise UsageError(f"size {text!r} is not understood; write e.g. 4KB, 1MB or 65536")


def format_size(size_bytes: int) -> str:
    """65536 -> '64KB': the largest binary unit that divides the size (parse_size's inverse)."""
    for unit in ("GB", "MB", "KB"):
        if size_bytes >= _SIZE_UNITS[unit] and size_bytes % _SIZE_UNITS[unit] == 0:
            return f"{size_bytes // _SIZE_UNITS[unit]}{unit}"
    return f"{size_bytes}B"
