"""A user's own training script on k workers: `phalanx run script.py` and `init()` inside it.

`phalanx run --devices cpu:3 train.py --lr 0.1` starts the script on k workers through the same launcher as `phalanx
train` (supervision, one-line failures naming the rank), as torchrun would: each worker gets torchrun's environment
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ..., TORCHELASTIC_ERROR_FILE; OMP_NUM_THREADS with its threads), its
threads and allocator set up, and runs the script (or with `-m`, a module) as `__main__`, as python would
(main_module.py); the flags of torchrun, accelerate launch and fabric run are named with phalanx run's way
(launcher_flags.py). A script that changes its thread count is named once on rank 0; torch errors that name no fix
(SyncBatchNorm or NCCL on CPU workers, a group opened after phalanx.init()) are one line naming it (script_errors.py).
No process group is opened for it: `init()` joins phalanx's world, and a script written for torchrun joins with its
own `dist.init_process_group(...)` (env://, through the launcher's store) - so a script runs unchanged under `phalanx
run` and under torchrun, and one that calls `init()` under plain python too (a world of one; torch's own
init_process_group needs a launcher's RANK). Without a launcher's variables, a group the script opened itself (torch's
DDP tutorial: children of torch.multiprocessing.spawn) is adopted; a child with neither trains alone, said in one
line, as is a process that a joined worker started with its variables (child_world.py). Such a spawn under `phalanx
run` is refused (nested_launch.py: its children would hang). A group opened without `timeout=` waits at most
`--timeout` (not 30 minutes); one left open is destroyed.

The world a script gets lives in one process-level slot (`_current`): a script started by path has no other way to
receive it (Accelerate's `PartialState` and Fabric keep the same kind of state); `_context` holds what `phalanx run`
decided for this worker (device, --timeout). phalanx's own code does not read them; it keeps passing `World` by
keyword.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import multiprocessing
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from phalanx.runtime.devices import parse_devices
from phalanx.runtime.call_habits import phalanx_call
from phalanx.errors import UsageError, warn_at_caller
from phalanx.options import add_options, at_least, build, check_options, option
from phalanx.runtime.launch import (LaunchSpec, join_launcher_world, report_progress, setup_worker, spawn_workers,
                                   threads_per_worker, torchrun_device, warn_if_oversubscribed)
from phalanx.runtime.launch_config import DEFAULT_TIMEOUT_S, LaunchConfig
from phalanx.runtime.apart import watch_ranks_apart
from phalanx.runtime.world import (World, adopt_world, bound_default_group_timeout, launcher_env, leave_default_group,
                                  open_group_env, stop_world)
from phalanx.runtime.slurm import alone_in_slurm_step
from phalanx.runtime.binding import threads_note
from phalanx.runtime.child_world import ALONE_IN_A_CHILD, inherited_message, joined_worker, run_key, stamp_joined
from phalanx.runtime.board import mark_exit, open_board
from phalanx.runtime.launcher_flags import add_launcher_flags
from phalanx.runtime.local_rank_arg import passing_local_rank
from phalanx.runtime.main_module import Target, inherit_launcher_stdin, run_as_main
from phalanx.runtime.nested_launch import refusing_nested_launch
from phalanx.runtime.own_rendezvous import joining_launcher_store, launcher_store_env
from phalanx.runtime.unguarded_main import refusing_unguarded_starts
from phalanx.runtime.sampler_passes import watching_sampler_passes
from phalanx.runtime.restarts import with_restarts
from phalanx.runtime.shown_ranks import FLAG as FILTER_FLAG, check_shown, mute_unless_shown
from phalanx.runtime.worker_logs import WorkerLogs, logged, write_to_files
from phalanx.runtime.script_errors import quiet_fd_sharing_resets, translated
from phalanx.telemetry.log import survive_lost_output


@dataclass(kw_only=True)
class _RunContext:
    device: torch.device
    timeout_s: float
    threads: int  # what phalanx gave the worker (its first line says so)
    rank: int
    threads_said: bool = False  # the script's own thread count, once it differs, is said once


_current: World | None = None  # this process's world, once init() made it
_context: _RunContext | None = None  # set while `phalanx run` runs the script in this worker


@phalanx_call  # Fabric(...)'s and init_process_group's keywords: one line (call_habits.py)
def init(*, timeout_s: float = DEFAULT_TIMEOUT_S, device: str | None = None) -> World:
    """This worker's World; call once at the top of a script (later calls return the same one). Under `phalanx
    run` or torchrun this joins the job's process group (gloo on CPU, NCCL on `cuda:LOCAL_RANK`), or adopts the
    one the script opened, and leaves it at interpreter exit; `timeout_s` bounds every collective (under `phalanx
    run`, its `--timeout` does); otherwise the world has one rank and no group. `device`: "cpu" or "cuda" (default:
    cuda when present; under `phalanx run`, its `--devices`). Fabric(...)'s keywords: one line (foreign_names.py)."""
    global _current
    if _current is not None:
        return _current
    if device not in (None, "cpu", "cuda"):
        raise UsageError(f"init(device={device!r}) is not understood; use 'cpu' or 'cuda'")
    use_cuda = torch.cuda.is_available() if device is None else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise UsageError("init(device='cuda') but torch sees no CUDA device; use device='cpu'")
    env = launcher_env()
    if env is not None:  # under phalanx run: its store, whatever MASTER_ADDR/MASTER_PORT the script set
        env = launcher_store_env(env)
    worker_pid = None if env is None else joined_worker(run_key(env))
    if worker_pid is not None:  # a worker's child, not a worker (child_world.py)
        warn_at_caller(inherited_message(env.rank, worker_pid))
        env = None
    elif env is None and dist.is_initialized():  # a group the script opened with no launcher: mp.spawn's children
        env = open_group_env()
    if env is None:
        try:
            alone_in_slurm_step()
        except UsageError as exc:  # every task would go on alone: stop here, one line, as the CLI says it
            print(f"phalanx: error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(exc.exit_code) from None
        if multiprocessing.parent_process() is not None and worker_pid is None:
            warn_at_caller(ALONE_IN_A_CHILD)
        world = World(rank=0, world_size=1, local_rank=0, local_world_size=1, backend="none", timeout_s=timeout_s,
                      device=torch.device("cuda:0" if use_cuda else "cpu"))
    else:
        torch_device = torch.device(f"cuda:{env.local_rank}" if use_cuda else "cpu")
        if _context is not None:  # phalanx run: its device and timeout; the worker is set up already
            torch_device, timeout_s = _context.device, _context.timeout_s
            _say_if_threads_changed(_context)
        if dist.is_initialized():  # the script opened the group itself
            world = adopt_world(local_rank=env.local_rank, local_world_size=env.local_world_size,
                                device=torch_device, timeout_s=timeout_s, node_rank=env.node_rank)
        else:
            world = join_launcher_world(env, device=torch_device, timeout_s=timeout_s, set_up=_context is None)
        atexit.register(stop_world, world)
        stamp_joined(run_key(env))
        world = open_board(world)  # the collective board: a failure names the rank and collective
        if _context is not None and world.board is not None:  # so the launcher's line names the step too
            world.board.on_step = report_progress
    _current = world
    return world


def _script_body(rank: int, payload, teardown: contextlib.ExitStack) -> None:
    """One spawned worker of `phalanx run`."""
    target, args, spec, shown, logs = payload
    inherit_launcher_stdin()
    _run_script(target, args, spec=spec, device=spec.plan.torch_device(rank), teardown=teardown, shown=shown, logs=logs)


def _run_script(target: Target, args: tuple[str, ...], *, spec: LaunchSpec, device: torch.device,
                teardown: contextlib.ExitStack, shown: tuple[int, ...] | None = None, logs=None) -> None:
    env = launcher_env()
    mute_unless_shown(env.local_rank, shown)  # --local-ranks-filter (shown_ranks.py)
    write_to_files(logs, env.local_rank)  # --log-dir, --redirects, --tee (worker_logs.py)
    # A DataLoader's spawn or forkserver workers from an unguarded top level; torch.distributed.launch's argument.
    with refusing_unguarded_starts(), passing_local_rank(local_rank=env.local_rank, rank=env.rank):
        run_in_worker(lambda: run_as_main(target, args, rank=env.rank), spec=spec, device=device,
                      teardown=teardown, guard=refusing_nested_launch(device_type=device.type, target=target))


def run_in_worker(call: Callable[[], Any], *, spec: LaunchSpec, device: torch.device, teardown: contextlib.ExitStack,
                  guard: contextlib.AbstractContextManager | None = None) -> Any:
    """`call()` (a script run as __main__, or phalanx.launch's function) in this worker, set up as
    `phalanx run` sets up each of its workers; `init()` inside it takes this worker's device and
    timeout. `guard` is held while it runs; its errors torch names no fix for become one line."""
    global _context, _current
    env = launcher_env()
    setup_worker(device, local_rank=env.local_rank, local_world_size=env.local_world_size,
                 threads=spec.threads_per_device, bind_cores=spec.bind_cores)
    bound_default_group_timeout(spec.timeout_s)
    _script_children()
    _current = None  # a forked worker's copy of its launcher's world is not its own
    _context = _RunContext(device=device, timeout_s=spec.timeout_s, threads=torch.get_num_threads(), rank=env.rank)
    teardown.callback(leave_default_group)  # after the report: one the script (or init()) left open
    if guard is not None:
        teardown.enter_context(guard)
    teardown.callback((apart := watch_ranks_apart(rank=env.rank, workers=env.world_size)).close)  # said once
    teardown.enter_context(watching_sampler_passes(rank=env.rank))  # a DistributedSampler without set_epoch
    # A MASTER_PORT or tcp:// rendezvous of the script's own: the launcher's store (own_rendezvous.py).
    teardown.enter_context(joining_launcher_store(rank=env.rank, world_size=env.world_size))
    try:
        result = call()
    except BaseException as exc:
        # Peers read first: told that this rank failed, a peer stops waiting where the line names it.
        one_line = translated(exc, device_type=device.type, timeout_s=spec.timeout_s, rank=env.rank,
                              world=_current)
        mark_exit(_current, ok=False)
        if one_line is not None:
            raise one_line from None
        raise
    else:  # peers still waiting in a collective learn at once that this rank's work ended
        apart.finish()
        mark_exit(_current, ok=True)
        return result
    finally:
        _say_if_threads_changed(_context)
        _context = _current = None


def _say_if_threads_changed(context: _RunContext) -> None:
    """Once, on rank 0 of a CPU run: the script (or a library) set its own thread count, not the first line's."""
    now = torch.get_num_threads()
    if context.threads_said or context.rank != 0 or context.device.type != "cpu" or now == context.threads:
        return
    context.threads_said = True
    _say(f"phalanx run: the script set torch's threads to {now}: rank 0 runs on {now} thread{'s' * (now > 1)}, "
         f"not the {context.threads} phalanx gave each worker (torch.set_num_threads, in the script or a library "
         "it calls)")


def _script_children() -> None:
    """The script's own child processes start as under torchrun, where a rank is a fresh `python
    script.py`: by the platform's default method (fork on Linux), not by a spawned worker's
    `spawn`, under which a DataLoader worker re-runs a script with no `__main__` guard, init()
    included. None (unset), so a library that sets its own method only when none is set still may.
    A loader worker says nothing of its rank stopping mid-request (quiet_fd_sharing_resets)."""
    multiprocessing.set_start_method(None, force=True)
    quiet_fd_sharing_resets()


RUN_DESCRIPTION = """\
Run your own training script on k workers, as torchrun would: each worker runs the script as
__main__ (sys.argv = [script, *args]) under phalanx's launcher, which supervises the workers and
ends a failure in one line naming the rank.

example: phalanx run --devices cpu:2 train.py --lr 0.1

Each worker's environment holds torchrun's variables: RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (the launcher's store). No process group is open
when the script starts: phalanx.init() joins the world (gloo on CPU, NCCL on cuda:LOCAL_RANK),
and a script written for torchrun joins with its own dist.init_process_group(...), so one script
runs unchanged under phalanx run and torchrun (one that calls phalanx.init() under plain python
too, as a world of one). A group opened without timeout= waits at most --timeout.
"""
RUN_EPILOG = "The API a script uses (init, prepare, ShardedLoader, shard_loss, ...): docs/api.md."


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """phalanx run's own options, beside the launch's (LaunchConfig)"""

    quiet: bool = option(False, help="no first line on stderr (workers, threads, rendezvous)")
    max_restarts: int = option(0, metavar="N", check=at_least(0, problem="must be 0 (no restarts) or more"),
                               help="after a worker fails, start every worker again, up to N times, as torchrun "
                                    "--max-restarts does (TORCHELASTIC_RESTART_COUNT says which attempt; the script "
                                    "resumes from its last phalanx.checkpoint with phalanx.resume)")
    local_ranks_filter: tuple[int, ...] | None = option(None, flag=FILTER_FLAG, items=int, metavar="R,...",
                                                 default_text="every rank", check=at_least(0),
                                                 help="show only these local ranks' stdout and stderr, as torchrun's "
                                                      "flag does (the others' go to /dev/null; a failure is named "
                                                      "whatever the filter)")

    def __post_init__(self) -> None:
        check_options(self)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """`phalanx run`'s parser: the launch options (declared once, in LaunchConfig), the script, its args."""
    parser.description, parser.epilog = RUN_DESCRIPTION, RUN_EPILOG
    # No prefixes of phalanx's flags (every CommandParser's rule): argparse matches them anywhere, and the
    # script's own `--n 5` after its name was "ambiguous option: --n could match --nnodes, --nproc-per-node".
    add_options(parser, LaunchConfig)
    add_options(parser, RunOptions)
    add_options(parser, WorkerLogs)
    # The script and what follows it are positional, which options.py's flags are not: the two
    # hand-written arguments of a generated parser.
    parser.add_argument("-m", "--module", action="store_true",
                        help="script is a module's name, run as python -m runs it (torchrun's -m)")
    parser.add_argument("script", help="the Python file to run on every worker (with -m: the module)")
    rest = parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    rest.required = False  # argparse calls a REMAINDER positional required: "required: script, args" without a script
    add_launcher_flags(parser)


def run_run(args: argparse.Namespace) -> int:
    """`phalanx run`: check what can be checked here, then start the script on every worker."""
    env = launcher_env()
    if env is None:  # the launcher's own lines (first line, restarts, the failure's) outlive a lost stdout/stderr;
        survive_lost_output(redirect=False)  # the workers inherit the descriptors as given: their prints as python's
    target = Target(args.script, module=args.module)
    target.check()
    launch_config, options, logs = build(LaunchConfig, args), build(RunOptions, args), build(WorkerLogs, args)
    spec = launch_config.spec(parse_devices(launch_config.devices))
    if env is None:  # phalanx run is the launcher: once per host, not once per Slurm task
        alone_in_slurm_step()
    if env is not None and (options.max_restarts or logs.log_dir):  # the launcher's parts: torchrun's there
        raise UsageError("under torchrun, restarts and worker logs are torchrun's: pass --max-restarts and --log-dir "
                         "to torchrun, not to phalanx run")
    if env is not None:  # under torchrun this process is the worker; torchrun decides the count
        if env.rank == 0 and not options.quiet:
            _say(first_line(spec, workers=env.world_size, local_workers=env.local_world_size,
                            store=f"{env.master_addr}:{env.master_port}", launcher="torchrun"))
        if env.local_rank == 0:
            warn_if_oversubscribed(spec, local_workers=env.local_world_size)
        check_shown(options.local_ranks_filter, local_workers=env.local_world_size)
        with contextlib.ExitStack() as teardown:
            _run_script(target, tuple(args.args), spec=spec, device=torchrun_device(spec, env), teardown=teardown,
                        shown=options.local_ranks_filter)
        return 0
    k = spec.plan.num_devices
    check_shown(options.local_ranks_filter, local_workers=k)
    announce = None if options.quiet else (
        lambda store: _say(first_line(spec, workers=k, local_workers=k, store=store, launcher="phalanx")))
    # One device too runs in a spawned worker: the script sees the same process set-up at any k. A
    # worker that exits 0 before the script's end (os._exit(0)) has succeeded, as under torchrun.
    payload = (target, tuple(args.args), spec, options.local_ranks_filter, logs)
    def attempt(restart: int) -> list:  # one attempt's workers, their log files made first (worker_logs.py)
        return logged(logs, attempt=restart, local_workers=k, shown=options.local_ranks_filter, start=lambda: (
            spawn_workers(_script_body, payload, spec=spec, exit_zero_is_success=True, restart_count=restart,
                          announce=announce if restart == 0 else None, max_restarts=options.max_restarts)))
    with_restarts(attempt, max_restarts=options.max_restarts, names=spec.plan.names,
                  say=lambda line: _say(f"phalanx run: {line}"))
    return 0


def first_line(spec: LaunchSpec, *, workers: int, local_workers: int, store: str, launcher: str,
               command: str = "phalanx run") -> str:
    """`phalanx run`'s (and phalanx.launch's) first line on stderr, as `phalanx train`'s names its
    devices and threads: how many workers, each one's threads, and where they meet (`--quiet` drops it)."""
    threads = threads_per_worker(spec, local_workers=local_workers)
    # torchrun's CUDA workers drive cuda:LOCAL_RANK whatever --devices lists; phalanx's, its list
    where = ", ".join(spec.plan.names) if spec.plan.kind == "cuda" and launcher == "phalanx" else spec.plan.kind
    here = "" if local_workers == workers else f" ({local_workers} on this host)"
    note = "" if threads is None else threads_note(threads, flag_given=spec.threads_per_device is not None)
    each = "torch's default threads" if threads is None else f"{threads} thread{'s' * (threads > 1)} each{note}"
    return (f"{command}: {workers} worker{'s' * (workers > 1)} on {where}{here}, {each}; "
            f"rendezvous env:// through {launcher}'s store at {store}")


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
