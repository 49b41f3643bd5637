"""Where CPU workers run and how they are set up: threads (by default a share of the cores per
local worker; with `--bind-cores`, each of a host's k workers on its own disjoint set of cores),
the one count of the cores this process may use (`available_cores`: its affinity mask, capped by its
cgroup's CPU quota), a warning when threads or
workers oversubscribe them, the thread discipline (the training thread's team is a worker's
only one: `set_intra_op_threads`, `run_single_threaded`), and the allocator setting that keeps
freed activations mapped (`keep_freed_memory_mapped`).

Unbound, the kernel may move a worker's threads between cores and stack two workers' threads
on one core while another idles; in lockstep training every step then waits for the unluckiest
worker. `--bind-cores` splits the cores this process may use (its affinity mask, so a container's
or `taskset`'s limit is respected) into k equal contiguous shares of whole physical cores
(topology.py: SMT siblings stay together, so two workers never share a core's execution units)
and pins local rank r to share r; only when there are more workers than physical cores are
siblings dealt out one by one. Cores left over when k does not divide the count stay unused, so
every worker gets the same share (the slowest worker sets a lockstep run's pace).

It is opt-in: two runs that both bind on one host would pin to the same cores. DeepSpeed's
`--bind_cores_to_rank` and Intel's launcher make the same split (numactl per rank); here it is
`os.sched_setaffinity` in the worker itself, before its thread pool starts.

How many threads a worker runs on its share is `PLACEMENT`, the one default to change once a
many-core host has measured it (docs/how-it-works.md, "Threads and cores" says which runs decide).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from phalanx.errors import UsageError
from phalanx.runtime.topology import allowed_cpus, cpu_quota, physical_cores, quota_cores

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
_PR_SET_NAME = 15  # prctl option (linux/prctl.h)


@dataclass(frozen=True, kw_only=True)
class Placement:
    """How a CPU worker uses its share of the host's cores, when --threads-per-device is not given.

    `threads_on_siblings`: one intra-op thread per logical CPU of its physical cores (False: one
    per physical core, leaving SMT siblings idle). `core_for_comm`: with two or more workers, one
    core of each share is left to the worker's communication thread (its team is one smaller)."""

    threads_on_siblings: bool = True
    core_for_comm: bool = False

    def threads(self, cores: list[int], local_workers: int) -> int:
        """The threads for a worker whose share of the host is `cores` (logical CPUs)."""
        count = len(cores) if self.threads_on_siblings else len(physical_cores(cores))
        if self.core_for_comm and local_workers > 1:
            count -= 1
        return max(1, count)


# The default: a thread on every logical CPU of a worker's share, none kept for communication -
# what the 2-core machine measures best (no SMT there; one core each at k=2). Not yet measured
# on a many-core host; the runs that decide it are in docs/how-it-works.md.
PLACEMENT = Placement()


def allowed_cores() -> list[int]:
    """The CPUs this process may run on, siblings of one physical core next to each other."""
    return allowed_cpus()


def cores_for(local_rank: int, local_world_size: int, cores: list[int] | None = None) -> list[int]:
    """Local rank `local_rank`'s share of `cores` (default: allowed_cores()) among
    `local_world_size`: whole physical cores when each worker can have one, else logical CPUs."""
    cores = allowed_cores() if cores is None else cores
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"local_rank {local_rank} must be in [0, {local_world_size})")
    check_bindable(local_world_size, len(cores))
    groups = physical_cores(cores)
    if local_world_size > len(groups):  # more workers than physical cores: siblings dealt out
        groups = [[cpu] for group in groups for cpu in group]
    per = len(groups) // local_world_size
    return [cpu for group in groups[local_rank * per:(local_rank + 1) * per] for cpu in group]


def check_bindable(local_world_size: int, num_cores: int) -> None:
    """Refuse, in one line, a binding that would leave a worker without a core of its own."""
    if local_world_size > num_cores:
        raise UsageError(f"--bind-cores needs a core per worker: {local_world_size} workers on this host, "
                         f"{num_cores} cores available; use at most {num_cores} devices or drop --bind-cores")


_bound = False  # bind_to_cores narrowed this process to its own share of the host


def bind_to_cores(local_rank: int, local_world_size: int) -> list[int]:
    """Pin this process to its slice; return the slice (its length is the thread count to use)."""
    global _bound
    mine = cores_for(local_rank, local_world_size)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, mine)
        _bound = True
    return mine


def describe(cores: list[int]) -> str:
    """"0-3", "0,8,1,9": a slice as a short readable list."""
    if cores == list(range(cores[0], cores[0] + len(cores))):
        return str(cores[0]) if len(cores) == 1 else f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def available_cores() -> int:
    """The cores this process may use: its affinity mask's CPUs (the CPU count off Linux), fewer
    where its cgroup's CPU quota grants less time (0.5 CPU: 1 core). Every count of usable cores
    in phalanx - threads, --devices auto, the oversubscription warnings - is this one."""
    quota = quota_cores(cpu_quota())
    cpus = _affinity_count()
    return cpus if quota is None else min(cpus, quota)


def _affinity_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def quota_note() -> str:
    """" (a cgroup CPU quota of 0.5 CPU leaves 1 of 2 cores)" where the quota lowers the usable
    cores below the affinity mask's, else "": for the run's first line, which names the limit."""
    quota, cpus = cpu_quota(), _affinity_count()
    cores = quota_cores(quota)
    if quota is None or cores is None or cores >= cpus:
        return ""
    return f" (a cgroup CPU quota of {quota:g} CPU leaves {cores} of {cpus} cores)"


def workers_sharing_cores(local_workers: int) -> int:
    """How many of this host's `local_workers` run on the cores this process may use: itself alone
    once --bind-cores gave it its own share, else all of them."""
    return 1 if _bound else max(1, local_workers)


def leaves_core_for_comm(*, cores: int, workers: int, threads: int) -> bool:
    """Whether `workers` processes of `threads` intra-op threads each on `cores` cores leave one
    core per worker that no training thread uses (for its communication thread)."""
    return cores - workers * threads >= workers


def worker_threads(local_workers: int, *, bind_cores: bool, threads: int | None) -> int:
    """The intra-op threads of each CPU worker: `threads` when given, else `PLACEMENT` on the
    cores it may use: its share with `bind_cores`, else an even share of the host's, and never
    more than an even share of `available_cores` (a cgroup quota counts)."""
    if threads is not None:
        return threads
    cpus = cores_for(0, local_workers) if bind_cores else allowed_cores()
    share = cpus[:max(1, available_cores() // max(1, local_workers))]  # its size counts, not which CPUs
    return PLACEMENT.threads(share, local_workers)


def place_worker(local_rank: int, local_world_size: int, *, bind_cores: bool, threads: int | None,
                 cpu: bool = True) -> None:
    """Set up this worker's cores (its own slice with `bind_cores`) and, for a CPU device, its
    threads (`worker_threads`), exported as OMP_NUM_THREADS and MKL_NUM_THREADS as well."""
    count = worker_threads(local_world_size, bind_cores=bind_cores, threads=threads)  # before binding narrows
    if bind_cores:  # the affinity mask that worker_threads reads
        bind_to_cores(local_rank, local_world_size)
    if cpu:
        set_intra_op_threads(count)
        global _omp_before
        if _omp_before is None:  # the environment's own value, for the first line (`omp_replaced_note`)
            _omp_before = (os.environ.get("OMP_NUM_THREADS"),)
        # What torchrun exports too: libraries read these (Accelerate sets 1 thread where they are unset).
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(count)
        keep_freed_memory_mapped()


_omp_before: tuple[str | None] | None = None  # OMP_NUM_THREADS as place_worker found it in this process


def omp_replaced_note(threads: int) -> str:
    """" (OMP_NUM_THREADS=4 from the environment is replaced: --threads-per-device 4 keeps it)" where
    the environment (the user's shell, or torchrun's default of 1) asked for another count than the
    `threads` phalanx gives each worker, else "". The flag is the one way to set the count: an
    environment variable would also carry torchrun's 1 into every worker. Read as the environment
    was before `place_worker` exported phalanx's count in this process."""
    given = os.environ.get("OMP_NUM_THREADS") if _omp_before is None else _omp_before[0]
    if given is None or given.strip() == str(threads):
        return ""
    keep = f"--threads-per-device {given.strip()}" if given.strip().isdigit() and int(given) > 0 else \
        "--threads-per-device N"
    return f" (OMP_NUM_THREADS={given} from the environment is replaced: {keep} keeps it)"


def threads_note(threads: int, *, flag_given: bool) -> str:
    """What the first line adds to a CPU worker's `threads`: the cgroup quota that lowered them
    (`quota_note`), and, unless --threads-per-device chose the count (`flag_given`), an
    OMP_NUM_THREADS it replaced (`omp_replaced_note`)."""
    return quota_note() + ("" if flag_given else omp_replaced_note(threads))


def set_intra_op_threads(count: int) -> None:
    """Give the calling (training) thread an intra-op team of `count` threads, and torch's second
    pool none.

    torch.set_num_threads also sizes torch's pthreadpool (XNNPACK's and QNNPACK's kernels, not
    ATen's OpenMP ones nor oneDNN's), which this torch creates at the size of the first call and
    never resizes: made at one thread, it holds no idle workers beside the team (over a training
    run they took no CPU time at all). The count is then fixed for this thread: torch applies its
    process-wide count to a thread lazily, at its first parallel op, and a communication thread
    later sets that count to one (`run_single_threaded`)."""
    torch.set_num_threads(1)
    torch.set_num_threads(count)
    torch.get_num_threads()  # the lazy per-thread set-up, now, with `count`


def run_single_threaded(name: str | None = None) -> None:
    """The first call of a thread phalanx starts to run tensor work beside training (the
    communication thread): its ATen ops use no intra-op team.

    With OpenMP every thread that runs an op above the parallel grain (32,768 elements) gets a
    team of its own of torch.get_num_threads() threads: a communication thread summing 400 KB
    buckets beside backward doubled a worker's busy threads, and on 16 cores with 2 workers x 8
    threads that is 32 spinning threads (PyTorch's "CPU threading" notes; pytorch/pytorch#131290).
    torch.set_num_threads(1) here sets this thread's team, and torch's default for threads that
    have not run a parallel op yet; a training thread set up by `set_intra_op_threads` (or one
    that already ran one) keeps its own. `name`: the OS thread's name (Linux, 15 bytes), which
    /proc, top and py-spy show, and which the threads it starts inherit."""
    torch.set_num_threads(1)
    if name is not None:
        try:
            ctypes.CDLL("libc.so.6").prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
        except (OSError, AttributeError):
            pass  # not Linux/glibc: the name is cosmetic


def oversubscription(threads_per_worker: int, local_workers: int, cores: int | None = None) -> str | None:
    """A one-line warning when `threads_per_worker` x `local_workers` exceeds the cores because of
    the threads, else None (more workers than cores: `too_many_workers`).

    Threads beyond the cores take turns on them, and in lockstep every step then waits for the
    unluckiest one: `--threads-per-device 64` on 2 cores measured 57x slower."""
    note, cores = (quota_note(), available_cores()) if cores is None else ("", cores)
    total = threads_per_worker * local_workers
    fits = max(1, cores // local_workers)
    if total <= cores or threads_per_worker <= fits:  # more workers than cores: not the threads' doing
        return None
    return (f"--threads-per-device {threads_per_worker} x {local_workers} local worker(s) = {total} threads on "
            f"{cores} cores{note}: they take turns and training can be many times slower; use --threads-per-device "
            f"{fits}, or leave it unset (cores / workers)")


def too_many_workers(local_workers: int, cores: int | None = None) -> str | None:
    """A one-line warning when more CPU workers share this host than it has cores, else None.

    Each worker then runs part of the time, and a lockstep step waits for the one that ran least:
    on 2 cores one synthetic epoch takes 56 s wall on cpu:16 against 6 s on cpu:2."""
    note, cores = (quota_note(), available_cores()) if cores is None else ("", cores)
    if local_workers <= cores:
        return None
    return (f"{local_workers} CPU workers on this host, 1 thread each, on {cores} core{'s' * (cores > 1)}{note}: they "
            f"take turns and training can be many times slower; use at most {cores} CPU device{'s' * (cores > 1)} here")


# glibc: no large block is ever mmap'ed, and up to 2 GiB - 1 (mallopt takes an int: its largest
# value) of freed memory at the heap's top is kept instead of trimmed.
ALLOCATOR_SETTINGS = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, (1 << 31) - 1))


def users_allocator_setting() -> str | None:
    """The environment variable through which the user set glibc's allocator (a MALLOC_* one, or
    GLIBC_TUNABLES naming glibc.malloc.*), which phalanx's own setting then leaves alone; None."""
    named = sorted(name for name in os.environ if name.startswith("MALLOC_"))
    if named:
        return named[0]
    return "GLIBC_TUNABLES" if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "") else None


def give_back_freed_memory() -> bool:
    """Return the heap's free memory to the system now (glibc's `malloc_trim(0)`; False elsewhere).

    The allocator setting keeps freed blocks for the next step's reuse; a one-off release - a
    sharded replica's set-up, after which each rank keeps 1/k of the model - would otherwise
    stay resident for good."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def keep_freed_memory_mapped() -> bool:
    """phalanx's one allocator setting for CPU workers: glibc keeps large freed blocks on the heap
    instead of returning them with munmap/trim, so the next step's activations do not page-fault
    in again (those faults cost 6-13% of a batch-256 step, up to 1.5x at 1024; a one-device
    `phalanx train` epoch takes 0.7-0.8 s without the setting, 0.5 s with it).

    Made with `mallopt` inside the process, not with MALLOC_* variables at spawn: glibc reads those
    once at process start, so they reach only processes phalanx starts itself, while mallopt also
    serves one device in the launcher's own process, torchrun's workers, and the bench contenders
    that ask for it - one mechanism and one threshold everywhere. A user's own MALLOC_* or
    GLIBC_TUNABLES setting wins (nothing is changed). Returns whether the setting is in force;
    False where the C library is not glibc.

    The heap then holds the large blocks, so a small allocation that outlives its step can split a
    hole one of them left, and the next step's block goes above it: a tensor kept per step until a
    periodic check grew a worker's peak RSS from 0.7 to 1.4-2.1 GB in 100 steps (guards/finite.py
    keeps its notes in one table made once for that reason)."""
    if users_allocator_setting() is not None:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return all(bool(libc.mallopt(param, value)) for param, value in ALLOCATOR_SETTINGS)
    except (OSError, AttributeError):
        return False
