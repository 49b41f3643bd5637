"""Shared-memory segments in /dev/shm and futex waits: the plumbing under the shm allreduce and the board.

A segment is a file in /dev/shm created with O_EXCL and mode 0600 (its owner alone can open it;
an existing name is never reused), its pages reserved up front (a write into an unreserved page
of a full tmpfs is a SIGBUS, not an error), then mapped. Names start with `phalanx-shm-<pid>-`,
the creator's pid, so a launcher can remove what a worker it spawned left behind. The ranks of
one host open one together with `share_segment` (the host's first rank creates, names it to the
others, they attach, every rank learns who failed, the creator unlinks): the shm allreduce's
segment (one per host for the hierarchical one) and, under torchrun, the collective board's.
A name lives on disk only for those seconds of start-up; a creator killed inside them with its
launcher (SIGKILL: no clean-up runs) leaves it, so each creator first removes the names of
creators that are gone and older than `STALE_AFTER_S` (`remove_stale_segments`). A
futex is Linux's sleep-until-this-word-changes: `futex_wait` returns at once if the word no
longer holds the value the caller saw, so a store followed by `futex_wake` is never missed.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import secrets
import time
from typing import Any, Callable, ContextManager, NamedTuple, Sequence

import torch.distributed as dist

from phalanx.runtime.procs import process_alive
from phalanx.runtime.world import World

SHM_DIR = "/dev/shm"
NAME_PREFIX = "phalanx-shm-"
# A name older than this whose creator is gone is a leftover: no start-up waits this long, and
# the age spares a live start-up in another pid namespace that shares /dev/shm (its pids look gone).
STALE_AFTER_S = 600.0
_SYS_FUTEX_X86_64, _FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1


def shm_supported() -> str | None:
    """None when this host can run the shm allreduce, else why not (one phrase)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the shm allreduce needs x86-64's memory ordering (and futex numbering); this is {platform.machine()}"
    if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK):
        return f"{SHM_DIR} is missing or not writable"
    return None


def shm_applies(world: World, *, host: Sequence[int] | None = None) -> str | None:
    """None when the shm collectives can serve `world` (CPU, every rank on this host), else why
    not. `host`: the ranks that share this rank's host, when the segment serves only them."""
    if world.device.type != "cpu":
        return f"the shm allreduce serves CPU workers; this world runs on {world.device.type}"
    if host is None and world.local_world_size != world.world_size:
        sizes = world.node_sizes
        unequal = ": unequal, so not the hierarchical allreduce either" if sizes and len(set(sizes)) > 1 else ""
        return (f"the shm allreduce serves the workers of one host; {world.world_size} ranks span hosts "
                f"({per_host_text(world)}{unequal})")
    return shm_supported()


def per_host_text(world: World) -> str:
    """"2 per host", or for nodes of unequal sizes every node's, by node rank: "2, 1 per host"
    (the same words on every rank, which the pre-flight check compares)."""
    sizes = world.node_sizes
    if sizes is None or len(set(sizes)) == 1:
        return f"{sizes[0] if sizes else world.local_world_size} per host"
    return f"{', '.join(map(str, sizes))} per host"


def free_bytes() -> int | None:
    """What /dev/shm can still hold (Docker's default size is 64 MB), or None if unknown."""
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def create_segment(path: str, size: int) -> tuple[mmap.mmap | None, str | None]:
    """A new file of `size` bytes at `path`, readable by its owner only, mapped: (map, None), or
    (None, why not). O_EXCL: an existing name is never reused, so two runs never share one."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        return None, f"cannot create {path} ({exc.strerror})"
    try:
        # Reserve the pages now: on a full tmpfs a write into an ftruncated file is a SIGBUS.
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size), None
    except OSError as exc:
        unlink_quietly(path)
        return None, f"cannot reserve {size / 2**20:.1f} MiB in {SHM_DIR} ({exc.strerror})"
    finally:
        os.close(fd)


def attach_segment(path: str) -> tuple[mmap.mmap | None, str | None]:
    """Map the segment another rank created: (map, None), or (None, why not)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        return None, f"cannot open {path} ({exc.strerror}; are all ranks on one host?)"
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size), None
    except OSError as exc:
        return None, f"cannot map {path} ({exc.strerror})"
    finally:
        os.close(fd)


class Shared(NamedTuple):
    """What `share_segment` opened: this rank's mapping (None when a rank failed), rank 0's
    `facts`, and the first (rank, why) that could not create or map it, or None."""

    mapping: mmap.mmap | None
    facts: tuple
    failed: tuple[int, str] | None


def share_segment(world: World, *, label: str, create: Callable[[str], tuple[mmap.mmap | None, str | None]],
                  facts: tuple[Any, ...] = (), around: Callable[[], ContextManager] = contextlib.nullcontext,
                  host: Sequence[int] | None = None) -> Shared:
    """Open one segment on the ranks of each host: a collective of the whole `world`, so call it
    at the same point on every rank. `host`: the ranks that share this rank's host, in order
    (default: every rank; hosts simulated on one machine still never share a segment, because
    each host's name goes to its own ranks only). The host's first rank creates the segment at a
    fresh name (`label` marks what it is for) with `create(path)` (`create_segment` with the size
    it chose) and offers the name with its `facts` (its rule, e.g. sizes that depend on its free
    space); the host's other ranks attach; every rank of the world learns who could not (so all
    fail, or fall back, alike); the creator unlinks the name once its host's ranks have mapped it,
    so nothing is left on disk however a process ends.
    `around()`: a context for each blocking collective (the board entry, where one exists)."""
    host = tuple(range(world.world_size)) if host is None else tuple(host)
    creator = host[0]
    mapping, error, offer = None, None, None
    if world.rank == creator:
        remove_stale_segments()
        path = os.path.join(SHM_DIR, f"{NAME_PREFIX}{os.getpid()}-{label}{secrets.token_hex(6)}")
        mapping, error = create(path)
        offer = (path, tuple(facts), error)
    offers: list = [None] * world.world_size
    with around():
        dist.all_gather_object(offers, offer)  # each host's creator names its segment
    path, facts, error = offers[creator]
    if error is None and world.rank != creator:
        mapping, error = attach_segment(path)
    errors: list = [None] * world.world_size
    with around():
        dist.all_gather_object(errors, error)  # every rank mapped it, or learns who could not
    if world.rank == creator:
        unlink_quietly(path)  # mapped everywhere (or failed): no file left
    failed = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
    if failed is not None and mapping is not None:
        mapping.close()
        mapping = None
    return Shared(mapping, facts, failed)


def remove_segments_of(pids) -> list[str]:
    """Unlink every segment a process in `pids` created (a launcher's clean-up); return the names."""
    prefixes = tuple(f"{NAME_PREFIX}{pid}-" for pid in pids)
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(prefixes)] if prefixes else []
    except OSError:
        return []
    for name in names:
        unlink_quietly(os.path.join(SHM_DIR, name))
    return names


def remove_torch_leftovers(since: float) -> list[str]:
    """Unlink each of torch's own `torch_<pid>_...` files in /dev/shm made since `since` (a
    time.time()) by a process no longer running; return the names. A DataLoader worker whose
    batch does not fit in /dev/shm (ENOSPC) leaves its half-made file behind (three of 14 MB on
    an 8 MiB tmpfs in the trial), filling it for the next run; the launcher calls this after a
    failed worker set, whose DataLoader workers have exited by then and are not named anywhere."""
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith("torch_")]
    except OSError:
        return []
    removed = []
    for name in names:
        pid = name.split("_")[1]
        try:
            recent = os.stat(os.path.join(SHM_DIR, name)).st_mtime >= since
        except OSError:  # gone already
            continue
        if pid.isdigit() and recent and not process_alive(int(pid)):
            unlink_quietly(os.path.join(SHM_DIR, name))
            removed.append(name)
    return removed


def remove_stale_segments(now: float | None = None) -> list[str]:
    """Unlink each segment whose creator (the pid in its name) no longer runs here and which is
    older than STALE_AFTER_S; return the names (see the module docstring)."""
    names = stale_leftovers(SHM_DIR, NAME_PREFIX, now=now)
    for name in names:
        unlink_quietly(os.path.join(SHM_DIR, name))
    return names


def stale_leftovers(directory: str, prefix: str, *, now: float | None = None) -> list[str]:
    """The names in `directory` that start with `prefix` then a pid of a process no longer running
    here, older than STALE_AFTER_S: what a process killed outright left behind."""
    now = time.time() if now is None else now
    try:
        names = [n for n in os.listdir(directory) if n.startswith(prefix)]
    except OSError:
        return []
    stale = []
    for name in names:
        pid = name[len(prefix):].split("-", 1)[0]
        try:
            old = now - os.stat(os.path.join(directory, name)).st_mtime >= STALE_AFTER_S
        except OSError:  # gone already
            continue
        # Not alive in this pid namespace (another user's process counts as alive: not ours to judge).
        if pid.isdigit() and old and not process_alive(int(pid)):
            stale.append(name)
    return stale


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Futex:
    """FUTEX_WAIT / FUTEX_WAKE on 32-bit words of a shared mapping (not FUTEX_PRIVATE: the
    waiters are other processes). ctypes releases the GIL for the call, so a waiting comm thread
    leaves the main thread free."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        self._syscall = libc.syscall

    def wait(self, address: int, seen: int, timeout_s: float) -> None:
        """Sleep while the word at `address` holds `seen` (low 32 bits), at most `timeout_s`."""
        timeout = _Timespec(int(timeout_s), int(timeout_s % 1 * 1e9))
        self._syscall(_SYS_FUTEX_X86_64, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_uint32(seen & 0xFFFFFFFF),
                      ctypes.byref(timeout), None, 0)

    def wake(self, address: int) -> None:
        """Wake every process sleeping on the word at `address`."""
        self._syscall(_SYS_FUTEX_X86_64, ctypes.c_void_p(address), _FUTEX_WAKE, ctypes.c_int(1 << 30), None, None, 0)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
