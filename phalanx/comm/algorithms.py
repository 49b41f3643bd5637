"""The registry of allreduce algorithms by name: what `--allreduce` and configs may choose
(reduce-scatter and all-gather take the same names where they have an algorithm: shards.py).

Every entry has the same shape, `fn(flat, *, world, transport=None, ticket=None) -> None`: it
sums the contiguous 1-D tensor `flat` in place across `world` over `transport` and returns when
done; `ticket` is the call's entry on the collective board, which the caller made (calls.py).
`native` is the backend's own (the callers launch it as an async op; its entry here is for a
direct call). `auto` is not an algorithm but a choice made per world (`resolve_algorithm`):
shared memory for CPU workers on one host, where it is many times faster than gloo's loopback
sockets; the hierarchical collectives (shm within each host, gloo between hosts) for CPU workers
on at least 2 hosts of at least 2 workers each; the backend's own collective everywhere else
(NCCL on GPUs, gloo across hosts of one worker).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from phalanx.comm.hierarchical import allreduce_hierarchical
from phalanx.comm.hosts import hierarchy_applies
from phalanx.comm.naive import allreduce_naive
from phalanx.comm.native import allreduce_native
from phalanx.comm.ring import allreduce_ring
from phalanx.comm.shm import shm_applies
from phalanx.comm.shm_ops import allreduce_shm
from phalanx.comm.tree import allreduce_tree
from phalanx.runtime.world import World

ALGORITHMS = ("native", "shm", "hierarchical", "ring", "tree", "naive")
# What a run may name: an algorithm, or auto (the default).
CHOICES = ("auto",) + ALGORITHMS
# Algorithms written over point-to-point messages: they run on AsyncComm's private group.
P2P_ALGORITHMS = ("ring", "tree", "naive")


def over_messages(fn: Callable[..., None]) -> Callable[..., None]:
    """A point-to-point algorithm (ring, tree, naive) in the registry's shape. Its waits are the
    backend's, bounded by the group's timeout, and its caller's wait watches the board: it does
    not read the ticket (shm, which waits by polling its own flags, does). Other keywords (a
    reduce-scatter's counts) pass through."""

    @functools.wraps(fn)
    def run(flat: torch.Tensor, *, world: World, transport=None, ticket=None, **options) -> None:
        fn(flat, world=world, transport=transport, **options)

    return run


_ALLREDUCE_FNS: dict[str, Callable[..., None]] = {
    "native": allreduce_native,
    "shm": allreduce_shm,
    "hierarchical": allreduce_hierarchical,
    "ring": over_messages(allreduce_ring),
    "tree": over_messages(allreduce_tree),
    "naive": over_messages(allreduce_naive),
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
        op(tensor if tensor.dim() == 1 else tensor.view(-1))  # shares storage: the result lands in `tensor`
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
    """The algorithm `choice` means on `world`: auto -> shm where it applies, else hierarchical
    where it applies, else native. ValueError for an algorithm that cannot carry this world's
    tensors."""
    check_choice(choice)
    if choice == "auto":
        if not world.distributed:
            return "native"
        if shm_applies(world) is None:
            return "shm"
        return "hierarchical" if hierarchy_applies(world) is None else "native"
    if choice != "native" and world.backend == "gloo" and world.device.type == "cuda":
        # gloo's collectives copy CUDA tensors through host memory; its send/recv hand the raw
        # device pointer to the socket (ProcessGroupGloo::send), so ring/tree/naive would fail
        # (and shm and hierarchical serve CPU tensors only).
        raise ValueError(f"allreduce {choice!r} sends CUDA tensors point to point, which gloo cannot; "
                         "use allreduce 'native' when CUDA ranks talk over gloo")
    return choice
