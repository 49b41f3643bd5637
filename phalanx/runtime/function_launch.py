"""`phalanx.launch(fn, *args, devices=..., **kwargs)`: a function on k workers, from a notebook or any Python code.

The function is a script's body: it calls `phalanx.init()` and trains as a script under `phalanx
run` does, on workers started and supervised by the same launcher (`timeout_s` on every
collective, the first failure takes every worker down and is raised here naming the rank, with
its traceback; a `UsageError` stays one). `launch` returns every rank's result in rank order,
with the tensors and modules in it moved to the CPU (so a GPU run leaves this process free of
CUDA, and it can launch again).

How the workers start (`start_method`):
- "fork", the default on Linux: each worker is a copy of this process, so neither `fn` nor `args`
  is pickled: a function defined in a notebook cell, a lambda, a closure, a dataset already in
  memory (shared copy-on-write, not copied k times). Accelerate's notebook_launcher and Fabric's
  "ddp_notebook" fork too. What a copy must not take over (OpenMP's thread pool, on which they
  hang with more than one thread per worker; the launcher's handlers) and what is refused before
  forking (CUDA initialized here, a process group open here): runtime/forked.py.
- "spawn", the default elsewhere (macOS's system libraries are not safe to fork): fresh
  interpreters, as torch.multiprocessing.spawn starts them. `fn` must then be importable - defined
  at the top level of a module, or of a script that guards its launch with
  `if __name__ == "__main__":` - and `args` picklable; refused in one line here otherwise.

Under torchrun or `phalanx run` this process already is one of the workers: `fn` runs here, once,
and the list holds this rank's result alone (as the launcher's own `launch`: runtime/launch.py).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import re
import sys
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

import torch
from torch import nn

from phalanx.errors import RunFailed, Stopped, UsageError
from phalanx.options import OptionError
from phalanx.runtime.devices import DevicePlan, parse_devices
from phalanx.runtime.forked import START_METHODS, check_forkable, warm_imports
from phalanx.runtime.launch import LaunchSpec, spawn_workers
from phalanx.runtime.launch_config import DEFAULT_TIMEOUT_S, LaunchConfig
from phalanx.runtime.main_module import failed_exit
from phalanx.runtime.restarts import with_restarts
from phalanx.runtime.script import RunOptions, first_line, run_in_worker
from phalanx.runtime.worker_errors import WorkerFailed
from phalanx.runtime.world import launcher_env


def launch(fn: Callable[..., Any], *args: Any, devices: str | int = "1", threads_per_device: int | None = None,
           bind_cores: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S, start_method: str | None = None,
           max_restarts: int = 0, quiet: bool = False, **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on every device of `devices` ("cpu:4", "cuda:0,1", N); its results by rank.

    Inside `fn`, `phalanx.init()` is this worker's world. `threads_per_device`, `bind_cores` and
    `timeout_s` are `phalanx run`'s `--threads-per-device`, `--bind-cores` and `--timeout`;
    `start_method` is "fork" or "spawn" (default: fork on Linux, see above); `max_restarts` is
    `phalanx run`'s `--max-restarts` (every worker starts `fn` again after one fails, up to N
    times: runtime/restarts.py); `quiet` drops the first line (on stderr: the workers, their
    threads, how they started). Every other keyword is `fn`'s; arguments `fn` does not take are
    refused here, not in each worker. A `sys.exit()` in `fn` reads as a process's exit code.
    """
    if not callable(fn):
        raise UsageError(f"launch() takes the function to run first, not a {type(fn).__name__}; "
                         "write phalanx.launch(train, *args, devices='cpu:2')")
    _check_call(fn, args, kwargs)
    try:  # phalanx run's options, checked where they are declared
        config = LaunchConfig(devices=str(devices), threads_per_device=threads_per_device, bind_cores=bind_cores,
                              timeout_s=timeout_s)
        RunOptions(quiet=quiet, max_restarts=max_restarts)
    except OptionError as exc:  # named as this function's keywords, not as phalanx run's flags
        raise UsageError(str(exc.named())) from None
    if launcher_env() is not None:  # torchrun's or phalanx run's worker already: this rank's part is fn, here
        return [fn(*args, **kwargs)]
    method = _start_method(fn, (args, kwargs), start_method)
    spec = config.spec(_plan(config.devices, method))
    k = spec.plan.num_devices
    announce = None if quiet else (lambda store: print(first_line(
        spec, workers=k, local_workers=k, store=store, launcher="phalanx", command=f"phalanx.launch ({method})"),
        file=sys.stderr, flush=True))
    try:
        if method == "fork":
            check_forkable(device_kind=spec.plan.kind)
            warm_imports()
        return with_restarts(lambda restart: spawn_workers(
            _function_body, (fn, args, kwargs, spec), spec=spec, announce=announce if restart == 0 else None,
            start_method=method, restart_count=restart, max_restarts=max_restarts, for_launch=True),
            max_restarts=max_restarts, names=spec.plan.names,
            say=lambda line: print(f"phalanx.launch: {line}", file=sys.stderr, flush=True))
    except (WorkerFailed, UsageError, Stopped, KeyboardInterrupt) as exc:
        raise _as_launchs(exc) from None


def _as_launchs(exc: BaseException) -> BaseException:
    """A failed or interrupted launch's exception as this call raises it: its traceback cut to here (a
    notebook shows it under the cell, where the supervisor's frames told nothing and kept every
    worker's process object, and its pipes, alive for as long as the notebook keeps the traceback),
    and `phalanx run`'s flag in a worker's line (a collective's wait) named as this function's keyword."""
    if isinstance(exc, (WorkerFailed, UsageError)) and exc.args and isinstance(exc.args[0], str):
        exc.args = (re.sub(r"--timeout\b", "timeout_s", exc.args[0]), *exc.args[1:])
    return exc.with_traceback(None)


_OWN_KEYWORDS = "devices, threads_per_device, bind_cores, timeout_s, start_method, max_restarts, quiet"


def _check_call(fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    """Refuse, before any worker starts, arguments `fn` cannot take (a misspelt launch keyword
    lands here too, as one of fn's)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function without one: its call will say
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        raise UsageError(f"launch() cannot call {name}{signature} with these arguments ({exc}); launch's own "
                         f"keywords are {_OWN_KEYWORDS}, every other one goes to the function") from None


def _plan(devices: str, method: str) -> DevicePlan:
    """The device plan, with --devices' messages naming this function's keyword. Before a fork,
    torch counts GPUs through NVML, which (unlike the CUDA runtime) leaves nothing a copy can't use."""
    saved = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    if method == "fork":
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        return parse_devices(devices)
    except UsageError as exc:
        raise UsageError(str(exc).replace("--devices ", "devices=")) from None
    finally:
        if saved is None:
            os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = saved


def _start_method(fn: Callable[..., Any], arguments: tuple[tuple, dict], requested: str | None) -> str:
    """fork or spawn: as asked, else fork on Linux; spawn only for what a fresh interpreter can load."""
    if requested is not None and requested not in START_METHODS:
        raise UsageError(f"start_method={requested!r} is not understood; use 'fork' or 'spawn' (or leave it unset)")
    method = requested or ("fork" if sys.platform == "linux" else "spawn")
    if method == "spawn":
        problem = _unspawnable(fn, arguments)
        if problem is not None:
            way = ", or pass start_method='fork'" if sys.platform == "linux" else ""
            raise UsageError(f"launch() with start_method='spawn' {problem}, and a fresh interpreter could not load "
                             f"it; define the function at the top level of a module or script{way}")
    return method


def _unspawnable(fn: Callable[..., Any], arguments: tuple[tuple, dict]) -> str | None:
    """Why spawn could not hand `fn` and its (args, kwargs) to a fresh interpreter, or None if it can."""
    main_file = getattr(sys.modules["__main__"], "__file__", None)  # python -: "<stdin>"; a notebook: none
    if getattr(fn, "__module__", None) == "__main__" and (main_file is None or not os.path.isfile(main_file)):
        return f"gets {getattr(fn, '__qualname__', fn)!r}, defined in an interactive session (a notebook)"
    try:
        ForkingPickler.dumps((fn, arguments))
    except Exception as exc:  # noqa: BLE001 - any reason pickling fails is the same refusal
        return f"cannot pickle the function or its arguments ({type(exc).__name__}: {exc})"
    return None


def _function_body(rank: int, payload: tuple, teardown: contextlib.ExitStack) -> Any:
    """One worker of `launch`: set up as phalanx run's are, run fn, its result on the CPU."""
    fn, args, kwargs, spec = payload
    return on_cpu(run_in_worker(lambda: _call(fn, args, kwargs, rank=rank), spec=spec,
                                device=spec.plan.torch_device(rank), teardown=teardown))


def _call(fn: Callable[..., Any], args: tuple, kwargs: dict, *, rank: int) -> Any:
    """fn's result; its `sys.exit()` as a process's exit (torch.multiprocessing.spawn's reading): 0 or
    None is a rank that finished with no result, any other code this rank's failure."""
    try:
        return fn(*args, **kwargs)
    except SystemExit as exc:
        detail = failed_exit(exc)
        if detail is None:
            return None
        name = getattr(fn, "__qualname__", type(fn).__name__)
        raise RunFailed(f"{name}() exited with {detail} on rank {rank} (sys.exit)") from None


def on_cpu(value: Any) -> Any:
    """`value` with every tensor and module in it (through lists, tuples and dicts) on the CPU."""
    if isinstance(value, (torch.Tensor, nn.Module)):
        return value.cpu()
    if isinstance(value, dict):  # a copy of its own kind (an OrderedDict state_dict stays one)
        moved = copy.copy(value)
        for key in moved:
            moved[key] = on_cpu(moved[key])
        return moved
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(on_cpu(item) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(on_cpu(item) for item in value)
    return value
