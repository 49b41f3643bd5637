"""A user's own training script on k workers: `phalanx run script.py` and `init()` inside it.

`phalanx run --devices cpu:3 train.py --lr 0.1` starts the script on k workers through the same
launcher as `phalanx train` (loopback rendezvous, supervision, a timeout on every collective,
one-line failures naming the rank): each worker joins the world, then runs the script as
`__main__` with `sys.argv = [script, *args]`. Inside, `init()` returns this worker's `World`:
the launcher's under `phalanx run`, one joined from torchrun's environment under `torchrun`, and
a world of one under plain `python train.py` - so one script runs unchanged under all three.

The world a script gets lives in one process-level slot (`_current`): a script started by path
has no other way to receive it (Accelerate's `PartialState` and Fabric keep the same kind of
state). phalanx's own code does not read it; it keeps passing `World` by keyword.
"""

from __future__ import annotations

import argparse
import atexit
import os
import runpy
import sys
from pathlib import Path

import torch

from phalanx.devices import parse_devices
from phalanx.errors import RunFailed, UsageError
from phalanx.binding import place_worker
from phalanx.comm.board import open_board
from phalanx.launch import LaunchSpec, launch
from phalanx.world import World, launcher_env, start_world, stop_world

DEFAULT_TIMEOUT_S = 120.0

_current: World | None = None  # this process's world, once `phalanx run` or init() made it


def init(*, timeout_s: float = DEFAULT_TIMEOUT_S, device: str | None = None) -> World:
    """This worker's World; call once at the top of a script (later calls return the same one).

    Under `phalanx run` the launcher has already joined the world. Under torchrun this joins the
    job's process group (gloo on CPU, NCCL on `cuda:LOCAL_RANK`), with `timeout_s` bounding every
    collective, and leaves it at interpreter exit. Otherwise the world has one rank and no
    process group. `device`: "cpu" or "cuda" (default: cuda when present).
    """
    global _current
    if _current is not None:
        return _current
    if device not in (None, "cpu", "cuda"):
        raise UsageError(f"init(device={device!r}) is not understood; use 'cpu' or 'cuda'")
    use_cuda = torch.cuda.is_available() if device is None else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise UsageError("init(device='cuda') but torch sees no CUDA device; use device='cpu'")
    env = launcher_env()
    if env is None:
        world = World(rank=0, world_size=1, local_rank=0, local_world_size=1, backend="none", timeout_s=timeout_s,
                      device=torch.device("cuda:0" if use_cuda else "cpu"))
    else:
        torch_device = torch.device(f"cuda:{env.local_rank}" if use_cuda else "cpu")
        if not use_cuda:  # a CPU worker torchrun started: set up as phalanx's own workers are
            place_worker(env.local_rank, env.local_world_size, bind_cores=False, threads=None)
        world = start_world(rank=env.rank, world_size=env.world_size, local_rank=env.local_rank,
                            local_world_size=env.local_world_size, device=torch_device,
                            master_addr=env.master_addr, master_port=env.master_port, timeout_s=timeout_s,
                            from_launcher_env=True)
        atexit.register(stop_world, world)
        world = open_board(world)  # the collective board: a failure names the rank and collective
    _current = world
    return world


def script_worker(world: World, script: str, args: tuple[str, ...]) -> None:
    """One worker of `phalanx run`: run `script` as __main__ with `world` as what init() returns."""
    global _current
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    _current = world
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))  # as `python script.py` does
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:  # sys.exit() / argparse in the script: 0 is success, else a failure
        if exc.code not in (None, 0):
            detail = f"code {exc.code}" if isinstance(exc.code, int) else repr(exc.code)
            raise RunFailed(f"{Path(script).name} exited with {detail} on rank {world.rank}") from None
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        _current = None


def add_run_parser(sub) -> None:
    run = sub.add_parser("run", help="run your own training script on k workers (phalanx.init() gives it its world)")
    run.add_argument("--devices", default="1", help="N, cpu:N or cuda:0,1 (default 1)")
    run.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds any collective may wait")
    run.add_argument("--threads-per-device", type=int, default=None, help="CPU threads per worker")
    run.add_argument("--bind-cores", action="store_true",
                     help="pin each local worker to its own equal share of the cores (threads = its share)")
    run.add_argument("script", help="the Python file to run on every worker")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")


def run_run(args: argparse.Namespace) -> int:
    """`phalanx run`: check what can be checked here, then start the script on every worker."""
    script = Path(args.script)
    if not script.is_file():
        raise UsageError(f"script {args.script} {'is a directory' if script.is_dir() else 'does not exist'}; "
                         "name a Python file, e.g. phalanx run --devices cpu:2 train.py")
    if not os.access(script, os.R_OK):
        raise UsageError(f"script {args.script} is not readable; check its permissions")
    if not (args.timeout > 0):
        raise UsageError(f"--timeout {args.timeout} must be a positive number of seconds")
    if args.threads_per_device is not None and args.threads_per_device < 1:
        raise UsageError(f"--threads-per-device {args.threads_per_device} must be at least 1")
    plan = parse_devices(args.devices)
    # One device too runs in a spawned worker: the script sees the same process set-up at any k.
    spec = LaunchSpec(plan=plan, threads_per_device=args.threads_per_device, timeout_s=args.timeout,
                      spawn_single=True, bind_cores=args.bind_cores)
    launch(script_worker, str(script), tuple(args.args), spec=spec)
    return 0
