"""The registry of allreduce algorithms by name: what `--allreduce` and configs may choose.

Every entry has the same shape, `allreduce_<name>(flat, *, world, ...) -> None`: it sums the
contiguous 1-D tensor `flat` in place across `world` and returns when done. `auto` is not an
algorithm but a choice made per world (`resolve_algorithm`): shared memory for CPU workers on
one host, where it is many times faster than gloo's loopback sockets, the backend's own
collective everywhere else (NCCL on GPUs, gloo across hosts).
"""

from __future__ import annotations

from typing import Callable

import torch

from phalanx.comm.naive import allreduce_naive
from phalanx.comm.native import allreduce_native
from phalanx.comm.ring import allreduce_ring
from phalanx.comm.shm import allreduce_shm, shm_applies
from phalanx.comm.tree import allreduce_tree
from phalanx.runtime.world import World

ALGORITHMS = ("native", "shm", "ring", "tree", "naive")
# What a run may name: an algorithm, or auto (the default).
CHOICES = ("auto",) + ALGORITHMS
# Algorithms written over point-to-point messages: they run on AsyncComm's private group.
P2P_ALGORITHMS = ("ring", "tree", "naive")

_ALLREDUCE_FNS: dict[str, Callable[..., None]] = {
    "native": allreduce_native,
    "shm": allreduce_shm,
    "ring": allreduce_ring,
    "tree": allreduce_tree,
    "naive": allreduce_naive,
}


def allreduce_fn(algorithm: str) -> Callable[..., None]:
    """The allreduce function named `algorithm`; ValueError listing the valid names otherwise."""
    try:
        return _ALLREDUCE_FNS[algorithm]
    except (KeyError, TypeError):
        raise ValueError(f"unknown allreduce algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}") from None


def apply_flat(tensor: torch.Tensor, op: Callable[[torch.Tensor], None]) -> None:
    """Run the in-place `op` on a contiguous 1-D view of `tensor` (a copy, written back, if needed)."""
    if tensor.is_contiguous():
        op(tensor.view(-1))  # shares storage: the result lands in `tensor` directly
        return
    flat = tensor.contiguous().view(-1)
    op(flat)
    tensor.copy_(flat.view(tensor.shape))


def check_choice(choice: str, *, flag: str | None = None) -> str:
    """`choice` if it is auto or an algorithm; ValueError listing the valid names otherwise.

    The one check of an allreduce name (configs, DataParallel, prepare): a config passes the
    `flag` its users type, and the message then names it as the config's other checks do."""
    if choice not in CHOICES:
        named = f"{flag} {choice!r} is unknown" if flag else f"unknown allreduce {choice!r}"
        raise ValueError(f"{named}; choose one of {', '.join(CHOICES)}")
    return choice


def resolve_algorithm(choice: str, world: World) -> str:
    """The algorithm `choice` means on `world`: auto -> shm where it applies, else native."""
    check_choice(choice)
    if choice != "auto":
        return choice
    return "shm" if world.distributed and shm_applies(world) is None else "native"
