"""Message sizes in binary units, as nccl-tests' -b/-e write them: `parse_size` reads one
(`--sizes 4KB,1MB`'s items; a bad one is one UsageError line), `format_size` writes one back.
"""

from __future__ import annotations

from phalanx.errors import UsageError

_SIZE_UNITS = {"B": 1, "KB": 1024, "MB": 1024**2, "GB": 1024**3}  # binary, as nccl-tests' -b/-e


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
