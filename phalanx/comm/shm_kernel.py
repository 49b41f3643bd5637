"""The shm allreduce's compiled rounds: shm_kernel.c built with the host's C compiler at first
use, cached, and loaded with ctypes; `None` (and the reason, said once in the run's first line)
where it cannot be, and the rounds run in Python as before, to the same bits.

Why compiled: a round in Python makes a dozen calls of 2-5 µs each (ATen's copy and k - 1 adds,
a flag store, a futex wake syscall, a spin on the flags), 20-30 µs a rank at 8 ranks, while the
work of a 4 KB round is a microsecond. One ctypes call does the round with the GIL released.

Built once per host and source: `$CC` (a command line, as make takes it), else `cc`, else `gcc`,
with `-O3 -shared -fPIC` (no -march: a cache on a shared home may serve other CPUs; the sum picks
AVX2, AVX or SSE2 at load) into $XDG_CACHE_HOME/phalanx/kernels (else ~/.cache/phalanx/kernels),
named by the hash of the source and the command, written under a temporary name and renamed, so
ranks that compile at once never load half a file. A cache that cannot be written, or no home to
put one in: compiled into a temporary directory for this process alone. No compiler, or a failed
build: Python rounds.

A cached library runs in every process that loads it, and its name is predictable, so a cache
another user can write is a way into this user's runs (another user's library, planted in a
shared $XDG_CACHE_HOME or one that `su` kept, ran as root: tests/distributed/test_shm_kernel_trust.py).
A cached file is used only when it and its directory are this user's or root's and nobody else
can write them, checked on the descriptors it is read through, and it is loaded from a private
copy, so no rename between the check and the load can swap it; any other cache, or a file there
that lacks a round, is left alone and the kernel built privately, as pip disables a cache it
does not own.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

from phalanx.caches import cache_root

SOURCE = Path(__file__).with_name("shm_kernel.c")
FLAGS = ("-O3", "-shared", "-fPIC", "-std=gnu11")  # -O3: the sums vectorise
COMPILE_TIMEOUT_S = 60.0
DTYPES = {torch.float32: 0, torch.float64: 1}  # the kernel's codes; other dtypes take the Python rounds
SMALL_LATE, SMALL_AGREED, SMALL_DIFFER = 0, 1, 2  # what phx_small_round returns
# torch's adds and copies split a tensor over the calling thread's intra-op team once it exceeds
# ATen's grain (32,768 elements); the kernel works on one thread. So a round this large, on a
# thread with a team (training's, where the exchange runs on it), is faster on torch's ops: on 16
# cores, 2 ranks x 8 threads, an allreduce of 512 KB took 0.065 ms on them against 0.107 ms
# compiled, of 16 MB 1.08 ms against 4.37 (docs/device-runs/2026-12-04-h200-second); on 2 cores
# the sum of two 4 MB rows 82 us on 2 threads against 151, at one thread even (157 against 151),
# at 128 KB rows the kernel ahead (5 us against 7). The communication thread has no team
# (binding.run_single_threaded): its rounds stay compiled.
TEAM_NUMEL = 4 * 32768


def team_is_faster(numel: int) -> bool:
    """Whether torch's ops, on this thread's intra-op team, copy and sum `numel` elements faster than the kernel."""
    return numel >= TEAM_NUMEL and torch.get_num_threads() > 1


class _Group(ctypes.Structure):
    """shm_kernel.c's phx_group, field for field."""

    _fields_ = [("flags", ctypes.c_void_p), ("slots", ctypes.c_void_p * 2), ("slot_stride", ctypes.c_int64),
                ("spin_ns", ctypes.c_int64), ("k", ctypes.c_int32), ("rank", ctypes.c_int32)]


class Loaded(NamedTuple):
    """The library (None where it could not be built) and, if so, why."""

    library: ctypes.CDLL | None
    reason: str | None


@functools.cache
def load() -> Loaded:
    """This process's compiled kernel, built or taken from the cache on first call."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return Loaded(None, f"the compiled rounds are x86-64 only; this is {platform.machine()}")
    try:  # $CC as make and setuptools take it: a command line ("ccache gcc", "gcc -m64"), not one path
        compiler = shlex.split(os.environ.get("CC", ""))
    except ValueError as exc:
        return Loaded(None, f"$CC cannot be split into a command ({exc})")
    if not compiler:
        found = shutil.which("cc") or shutil.which("gcc")
        if found is None:
            return Loaded(None, "no C compiler (cc) on PATH")
        compiler = [found]
    source = SOURCE.read_bytes()
    command_key = "\0".join((*compiler, *FLAGS, platform.machine())).encode()
    digest = hashlib.sha256(source + b"\0" + command_key).hexdigest()[:16]
    name = f"shm_kernel-{digest}.so"
    for private in (False, True):
        try:
            directory = Path(tempfile.mkdtemp(prefix="phalanx-kernel-")) if private else _cache_dir()
        except OSError:
            continue  # no home for a cache (NoCacheHome): build privately
        try:
            built = _built(compiler, name, directory)
            library = ctypes.CDLL(str(built)) if private else _load_copy(_read_owned(built))
            return Loaded(_declare(library), None)
        except _BuildFailed as exc:
            return Loaded(None, str(exc))
        except (OSError, AttributeError):  # AttributeError: a library there that lacks a round
            continue  # an unwritable or foreign cache, or a file there that will not load: build privately
        finally:
            if private:  # loaded (the mapping outlives the file) or failed: nothing is left in /tmp
                shutil.rmtree(directory, ignore_errors=True)
    return Loaded(None, "the compiled rounds could not be built or loaded")


class _BuildFailed(Exception):
    """The compiler ran and refused, or did not finish: retrying elsewhere would not help."""


def _cache_dir() -> Path:
    return cache_root() / "kernels"


def _built(compiler: list[str], name: str, directory: Path) -> Path:
    """The library's path in `directory`, compiled there first if missing."""
    path = directory / name
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    _check_owned(directory)  # before compiling into it: a foreign cache is not built in either
    if path.exists():
        return path
    fd, partial = tempfile.mkstemp(dir=directory, prefix=".building-", suffix=".so")
    os.close(fd)
    try:
        try:
            done = subprocess.run([*compiler, *FLAGS, "-o", partial, str(SOURCE)], capture_output=True, text=True,
                                  timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise _BuildFailed(f"the C compiler ran past {COMPILE_TIMEOUT_S:g} s") from None
        except OSError as exc:
            raise _BuildFailed(f"the C compiler could not run: {exc}") from None
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no message"])[0]
            raise _BuildFailed(f"the C compiler failed: {first}")
        os.replace(partial, path)  # atomic: a rank that finds the name finds the whole file
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return path


class Foreign(OSError):
    """A cache directory or file that a user other than this one and root owns, or can write."""


def _owned_or_raise(fd: int, path: Path) -> os.stat_result:
    found = os.fstat(fd)
    if found.st_uid not in (os.geteuid(), 0) or found.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise Foreign(f"{path} is owned by uid {found.st_uid} with mode {stat.filemode(found.st_mode)}")
    return found


def _check_owned(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _owned_or_raise(fd, directory)
    finally:
        os.close(fd)


def _read_owned(path: Path) -> bytes:
    """The regular file at `path`, read through a descriptor of its directory and one of the file
    (not followed if a link), each checked to be this user's or root's and writable by no one else."""
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _owned_or_raise(dir_fd, path.parent)
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(_owned_or_raise(handle.fileno(), path).st_mode):
            raise Foreign(f"{path} is not a regular file")
        return handle.read()


def _load_copy(image: bytes) -> ctypes.CDLL:
    """`image` loaded from a copy in a fresh private directory, removed once loaded. A new path
    each time: the dynamic loader hands back an already loaded library of the same path."""
    directory = tempfile.mkdtemp(prefix="phalanx-kernel-")
    try:
        copy = os.path.join(directory, "shm_kernel.so")
        with open(copy, "wb") as handle:
            handle.write(image)
        return ctypes.CDLL(copy)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _declare(library: ctypes.CDLL) -> ctypes.CDLL:
    group, i32, i64, ptr = ctypes.POINTER(_Group), ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    library.phx_sum_rows.argtypes = [ptr, ptr, i64, i32, i64, i32]
    library.phx_sum_rows.restype = None
    library.phx_sum_rows_noted.argtypes = [ptr, ptr, i64, i32, i64, i32, ptr]
    library.phx_sum_rows_noted.restype = None
    library.phx_copy_noted.argtypes = [ptr, ptr, i64, i32, ptr]
    library.phx_copy_noted.restype = None
    library.phx_sum_own.argtypes = [ptr, ptr, i64, i32, i32, i64, i32]
    library.phx_sum_own.restype = None
    library.phx_reduce_scatter_round.argtypes = [group, i32, i64, ptr, i64, i64, i64, i64, i32, i64, i64]
    library.phx_reduce_scatter_round.restype = i32
    library.phx_all_gather_round.argtypes = [group, i32, i64, ptr, i64, i64, i64, i64, i64, i64, i64]
    library.phx_all_gather_round.restype = i32
    library.phx_gather_out.argtypes = [group, i32, ptr, i64, i64, i64, i64, i64]
    library.phx_gather_out.restype = None
    library.phx_publish.argtypes = [group, i32, i64]
    library.phx_publish.restype = None
    library.phx_spin.argtypes = [group, i32, i64]
    library.phx_spin.restype = i32
    library.phx_small_round.argtypes = [group, i32, i64, ptr, i64, i32, i64, i64, ptr]
    library.phx_small_round.restype = i32
    library.phx_tags_agree.argtypes = [group, i32, i64, i64]
    library.phx_tags_agree.restype = i32
    return library


class Rounds:
    """The compiled calls bound to one segment (ShmGroup): what a round needs, passed once."""

    def __init__(self, library: ctypes.CDLL, *, flags_addr: int, slots: tuple[int, int], slot_stride: int,
                 spin_s: float, k: int, rank: int) -> None:
        self._group = _Group(flags_addr, (ctypes.c_void_p * 2)(*slots), slot_stride, int(spin_s * 1e9), k, rank)
        self._ref = ctypes.byref(self._group)
        self._slots, self._stride, self._k = slots, slot_stride, k
        self._small_round = library.phx_small_round
        self._tags_agree = library.phx_tags_agree
        self._publish = library.phx_publish
        self._spin = library.phx_spin
        self._sum_rows = library.phx_sum_rows
        self._sum_rows_noted = library.phx_sum_rows_noted
        self._copy_noted = library.phx_copy_noted
        self._sum_own = library.phx_sum_own
        self._reduce_scatter_round = library.phx_reduce_scatter_round
        self._all_gather_round = library.phx_all_gather_round
        self._gather_out = library.phx_gather_out
        self._rank = rank

    def small_round(self, parity: int, g: int, piece: torch.Tensor, code: int, key: int,
                    notes: torch.Tensor | None = None) -> int:
        """Copy in, write the call's tag `code` and `key` (shm_flags.TAGS), publish, spin, sum whole
        into `piece`, compare every rank's tag: SMALL_AGREED or SMALL_DIFFER when done; SMALL_LATE
        when a peer is late (the caller sleeps until every rank arrived, then calls `sum_slots`
        and `tags_agree`). `notes`: two float64s, the own piece's sum and the summed one's added to."""
        return self._small_round(self._ref, parity, g, piece.data_ptr(), piece.numel(), DTYPES[piece.dtype], code,
                                 key, None if notes is None else notes.data_ptr())

    def copy_noted(self, out: torch.Tensor, source: torch.Tensor, note: torch.Tensor) -> None:
        """out = source (contiguous, one float dtype), and the float64 `note` += its sum, in one pass."""
        self._copy_noted(out.data_ptr(), source.data_ptr(), out.numel(), DTYPES[out.dtype], note.data_ptr())

    def tags_agree(self, parity: int, code: int, key: int) -> bool:
        """True when every rank's tag words of half `parity` hold `code` and `key`."""
        return bool(self._tags_agree(self._ref, parity, code, key))

    def publish(self, field: int, value: int) -> None:
        self._publish(self._ref, field, value)

    def spin(self, field: int, value: int) -> bool:
        """True once every rank's `field` >= value; False after the group's spin time."""
        return bool(self._spin(self._ref, field, value))

    def sum_slots(self, out: torch.Tensor, parity: int, offset_bytes: int = 0, note: torch.Tensor | None = None):
        """out = the k input slots of half `parity` (from `offset_bytes` on, out's length), in rank
        order; the float64 `note`, if given, += out's sum."""
        first = self._slots[parity] + offset_bytes
        if note is None:
            self._sum_rows(out.data_ptr(), first, self._stride, self._k, out.numel(), DTYPES[out.dtype])
        else:
            self._sum_rows_noted(out.data_ptr(), first, self._stride, self._k, out.numel(), DTYPES[out.dtype],
                                 note.data_ptr())

    def sum_with_own(self, own: torch.Tensor, parity: int, offset_bytes: int) -> None:
        """own = the k input slots of half `parity` (from `offset_bytes` on, own's length) in rank
        order, this rank's row being `own` itself (a reduce-scatter's own part, never in its slot)."""
        self._sum_own(own.data_ptr(), self._slots[parity] + offset_bytes, self._stride, self._k, self._rank,
                      own.numel(), DTYPES[own.dtype])

    def reduce_scatter_round(self, parity: int, g: int, flat: torch.Tensor, start: int, lo: int, hi: int,
                             stop: int, code: int, key: int) -> int:
        """Copy the window [start, stop) of `flat` but this rank's part [lo, hi) in, write the tag,
        publish, spin, sum the part, compare the tags: SMALL_AGREED or SMALL_DIFFER when done;
        SMALL_LATE when a peer is late (the caller sleeps, then calls `sum_with_own`, `tags_agree`)."""
        return self._reduce_scatter_round(self._ref, parity, g, flat.data_ptr(), start, lo, hi, stop,
                                          DTYPES[flat.dtype], code, key)

    def all_gather_round(self, parity: int, g: int, flat: torch.Tensor, start: int, lo: int, hi: int, stop: int,
                         code: int, key: int) -> int:
        """Copy this rank's part [lo, hi) of `flat` into the result area, write the tag, publish,
        spin, copy the rest of the window [start, stop) out, compare the tags: as
        `reduce_scatter_round` (late: the caller sleeps, then calls `gather_out`, `tags_agree`)."""
        return self._all_gather_round(self._ref, parity, g, flat.data_ptr(), start, lo, hi, stop,
                                      flat.element_size(), code, key)

    def gather_out(self, parity: int, flat: torch.Tensor, start: int, lo: int, hi: int, stop: int) -> None:
        """The window [start, stop) of `flat` but [lo, hi), copied out of half `parity`'s result area."""
        self._gather_out(self._ref, parity, flat.data_ptr(), start, lo, hi, stop, flat.element_size())
