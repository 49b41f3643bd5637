"""A script's own rendezvous under `phalanx run`: its address replaced by the launcher's store, said once.

torch's DDP tutorial opens its group after `os.environ["MASTER_ADDR"] = "localhost"` and
`os.environ["MASTER_PORT"] = "12355"`; other scripts pass `init_method="tcp://localhost:23456"`.
Under torchrun, and under `phalanx run`, which gives each worker torchrun's environment, every rank
is a client of the launcher's store (TORCHELASTIC_USE_AGENT_STORE=True): on another port no one
hosts a store, and each rank retried its connection for the group's timeout and then again after a
pause of torch's choosing (2 workers under `phalanx run --timeout 120`: 3 min 31 s, then torch's
DistNetworkError traceback naming neither cause nor fix; torchrun waits alike). While the script
runs, `init_process_group` is held (as nested_launch.py holds torch's spawn): a call whose `env://`
or `tcp://` rendezvous names another port than the launcher's store is made against that store, its
other arguments as given, and rank 0 warns once at the script's line, naming both addresses and the
lines to drop so that the script runs under torchrun too. `phalanx.init()` joins the launcher's
store whatever the script set (`launcher_store_env`). A `store=`, a `file://` rendezvous and the
launcher's own port are left as they are. A `world_size=` other than the workers started (a
config's default) or a `rank=` other than the worker's RANK (`rank=0` on every worker), as an
argument or set in os.environ before an env:// rendezvous or `phalanx.init()` (which read them), is
refused at once in one line: each was a wait of `--timeout`, then torch's DistStoreError traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import sys
import urllib.parse
import warnings
from typing import Iterator

import torch.distributed as dist

from phalanx.errors import PhalanxWarning, UsageError, script_line
from phalanx.runtime.world import LauncherEnv


@dataclasses.dataclass
class _Held:
    address: tuple[str, str]  # the launcher's MASTER_ADDR and MASTER_PORT, as the worker started
    said: bool  # rank 0 warned already (or this is not rank 0)
    rank: int  # the worker's RANK and WORLD_SIZE, as the launcher gave them
    world_size: int

    def env_moved(self, addr: str, port: str, frame) -> bool:
        """Whether MASTER_ADDR/MASTER_PORT as the script left them (`addr`, `port`) name another port
        than the launcher's store; if so, said once at the script's line outward from `frame`."""
        if port == self.address[1]:
            return False
        self.warn(f"{addr}:{port}", "MASTER_ADDR and MASTER_PORT set by the script", frame)
        return True

    def warn(self, script_address: str, how: str, frame) -> None:
        if not self.said:
            self.said = True
            path, line_number, note = script_line(frame)
            warnings.warn_explicit(moved_line(script_address, how, self.address) + note, PhalanxWarning, path,
                                   line_number)


_HELD: list[_Held] = []  # while joining_launcher_store is held


def launcher_store_env(env: LauncherEnv) -> LauncherEnv:
    """`env` (read from os.environ) with the launcher's store while held: phalanx.init() in a script that
    set MASTER_ADDR/MASTER_PORT joins the launcher's store, said once as for init_process_group."""
    if not _HELD:
        return env
    _check_place(env.rank, env.world_size, rank=_HELD[-1].rank, world_size=_HELD[-1].world_size, environ=True)
    if not _HELD[-1].env_moved(env.master_addr, str(env.master_port), sys._getframe()):
        return env
    address = _HELD[-1].address
    return dataclasses.replace(env, master_addr=address[0], master_port=int(address[1]))


def moved_line(script_address: str, how: str, launcher: tuple[str, str]) -> str:
    """What rank 0 says when the script's group met at `script_address`, set by `how`."""
    return (f"the script's process group meets at {script_address} ({how}), where under phalanx run and torchrun no "
            "process hosts a store (every rank is a client of the launcher's: TORCHELASTIC_USE_AGENT_STORE=True), so "
            "each rank would wait for one until its timeout; phalanx run joined its own store at "
            f"{launcher[0]}:{launcher[1]} instead: drop {'those lines' if how.startswith('MASTER') else 'init_method'} "
            "(both launchers set MASTER_ADDR and MASTER_PORT, which env:// reads) and the script runs under torchrun "
            "too")


@contextlib.contextmanager
def joining_launcher_store(*, rank: int, world_size: int) -> Iterator[None]:
    """While held, torch.distributed's init_process_group meets at the launcher's store (module docstring);
    a `rank=` or `world_size=` other than this worker's (`rank`, `world_size`) is refused in one line."""
    address = (os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not all(address):
        yield
        return
    c10d = dist.distributed_c10d
    original = c10d.init_process_group
    signature = inspect.signature(original)
    held = _Held(address=address, said=rank != 0, rank=rank, world_size=world_size)

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:  # torch's own error for the call as written
            return original(*args, **kwargs)
        method = bound.arguments.get("init_method")
        if bound.arguments.get("store") is not None:
            return original(*args, **kwargs)
        _check_place(bound.arguments.get("rank", -1), bound.arguments.get("world_size", -1), rank=rank,
                     world_size=world_size)
        if method in (None, "env://"):  # it reads RANK and WORLD_SIZE where no argument gives them
            _check_place(-1 if "rank" in bound.arguments else _environ_int("RANK"),
                         -1 if "world_size" in bound.arguments else _environ_int("WORLD_SIZE"), rank=rank,
                         world_size=world_size, environ=True)
            if not held.env_moved(os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""),
                                  sys._getframe()):
                return original(*args, **kwargs)
            with _environment(MASTER_ADDR=address[0], MASTER_PORT=address[1]):
                return original(*args, **kwargs)
        url = urllib.parse.urlsplit(method) if isinstance(method, str) and method.startswith("tcp://") else None
        if url is not None and _port(url) not in ("", address[1]):
            held.warn(url.netloc, f"init_method={method!r}", sys._getframe())
            bound.arguments["init_method"] = url._replace(netloc=f"{address[0]}:{address[1]}").geturl()
            return original(*bound.args, **bound.kwargs)
        return original(*args, **kwargs)  # file://, the launcher's own port, or a URL torch will refuse

    _HELD.append(held)
    c10d.init_process_group = dist.init_process_group = init_process_group
    try:
        yield
    finally:
        c10d.init_process_group = dist.init_process_group = original
        _HELD.pop()


def _check_place(given_rank: int, given_size: int, *, rank: int, world_size: int, environ: bool = False) -> None:
    """UsageError where the script's init_process_group names another world size or rank than the
    launcher gave this worker (`environ`: in os.environ, where env:// and phalanx.init() read them):
    every rank waited --timeout for peers that never came (or for a rank two workers claimed), then
    torch's DistStoreError traceback. The launcher's line names the script's line."""
    if given_size not in (-1, world_size):
        said, fix = _how("world_size", given_size, environ)
        raise UsageError(f"the script {said}, and phalanx run started {world_size} workers (WORLD_SIZE={world_size}): "
                         f"every rank would wait --timeout for ranks that never come; {fix}, or start as many "
                         f"(phalanx run --devices {given_size})")
    if given_rank not in (-1, rank):
        said, fix = _how("rank", given_rank, environ)
        raise UsageError(f"the script {said} on the worker whose RANK is {rank}: two workers would claim rank "
                         f"{given_rank} and every rank wait --timeout; {fix}")


def _how(argument: str, value: int, environ: bool) -> tuple[str, str]:
    """How the script gave `argument` (world_size, rank) its `value`, and the fix for that way."""
    variable = argument.upper()
    if environ:
        return (f'opens its process group after setting os.environ["{variable}"] = "{value}"',
                f"drop the line that sets it (the launcher sets {variable})")
    return (f"opens its process group with {argument}={value}",
            f'leave {argument} out (env:// reads {variable}) or pass int(os.environ["{variable}"])')


def _environ_int(name: str) -> int:
    """os.environ[name] as a number; -1 where absent or not one (torch's own error then)."""
    try:
        return int(os.environ.get(name, "-1"))
    except ValueError:
        return -1


def _port(url: urllib.parse.SplitResult) -> str:
    """The port a tcp:// URL names ("" where none or not a number: torch's own error then)."""
    try:
        return str(url.port or "")
    except ValueError:
        return ""


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """`values` in os.environ for the block; what was there before, after it (the script's own values)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
