"""One string-hash seed for every worker a local run spawns, so a set's order is the same on every rank.

Python salts `hash(str)` per interpreter (PYTHONHASHSEED unset means a random salt at start-up), so
two spawned workers iterate the same `set` of strings in different orders: measured under `phalanx
run --devices cpu:2`, `list({"a", "b", "c", "d", "e"})` came out c b a e d on rank 0 and c a b e d
on rank 1. A script that builds its vocabulary or its class list as `list(set(words))` then maps
tokens to other ids on each rank, and the summed gradients mix the mappings with no error: the
replicas stay equal, their training is wrong. torchrun's workers have the same hazard.

The launcher therefore gives the workers it spawns one salt, drawn once per launcher process (so a
restart within the run keeps it: a vocabulary rebuilt after a restart matches the checkpoint), still
random from one run to the next as Python's own is. A PYTHONHASHSEED the user set is kept as it is.
A forked worker already inherits its parent's salt. Nodes started by torchrun each draw their own:
many-hosts.md names `export PYTHONHASHSEED=0` on every node.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from typing import Iterator

VARIABLE = "PYTHONHASHSEED"
# 1..2**32-1: the range Python accepts, less 0 (which switches the salting off altogether).
_SEED = str(1 + secrets.randbelow(2**32 - 1))


@contextlib.contextmanager
def shared_hash_seed(start_method: str) -> Iterator[None]:
    """Within the block, interpreters started by spawn get this launcher's salt (unless the user set
    one); the launcher's own environment is as before afterwards."""
    if start_method != "spawn" or VARIABLE in os.environ:
        yield
        return
    os.environ[VARIABLE] = _SEED
    try:
        yield
    finally:
        os.environ.pop(VARIABLE, None)
