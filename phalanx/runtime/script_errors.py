"""torch's own errors that a script under `phalanx run` meets for want of one change, re-worded as one line naming it.

A torch error reaches the user as `phalanx: worker rank R failed: <its message>` and a traceback;
for six that a DDP script ported to CPU workers meets first, the message names no fix, so
`reworded` turns each into the line a `UsageError` carries (exit 2), told by the exception's type,
by where in torch it was raised and by what this worker is, not by its wording alone:

- torch.nn.SyncBatchNorm on CPU workers, which torch refuses (DDP's constructor, the layer's
  forward), under torchrun too: phalanx's own sync BatchNorm is one call away.
- A group opened with backend "nccl" on CPU workers (the DDP tutorials' line): NCCL runs on GPUs
  only; a CPU build of torch has none (a RuntimeError), a CUDA build on a host without a GPU refuses
  the group with a ValueError (PyPI's builds of 2.4.1 and 2.11.0), and one with a GPU fails at the
  first collective on CPU tensors.
- `init_process_group` after `phalanx.init()`, which opened the default group already.
- A GPU asked for on CPU workers where torch has none (`torch.cuda.set_device(local_rank)`,
  `model.to(local_rank)`, `.cuda()`: the tutorials' and nanoGPT's lines): a CPU build says "module
  'torch._C' has no attribute '_cuda_setDevice'" or "Torch not compiled with CUDA enabled", a CUDA
  build on a host without a GPU "Found no NVIDIA driver"; the line names the script's own line.
- `DistributedDataParallel(model, device_ids=[local_rank])` with the model on the CPU, and
  `init_process_group(..., device_id=torch.device("cpu"))` (pytorch/examples' FSDP2 script made
  to run on CPU): torch binds a group to an accelerator only.
- DDP's "Expected to have finished reduction in the prior iteration" for parameters a step's loss
  left out, which lists them by index: named, with the fixes (ddp_unused.py).

And two the script's run stops on (exit 1): a collective of its own group that waited out
`--timeout` (`stalled`: gloo's message names the wait, not the fix; the line names the rank and,
on phalanx.init()'s board, where the other local ranks were meanwhile), and a DataLoader worker of
the script's that exited or died (`loader_worker_lost`): torch's RuntimeError, raised wherever the
rank's SIGCHLD lands (often inside a collective, chained to gloo's "connection reset"), named the
pid but not the rank, and each rank's ~20-line traceback made an 80-line report.
`translated` applies them all. And one that is no error of the script's: a rank stopped while it
fetched a batch's shared memory from a loader worker, which then printed multiprocessing's
"Connection reset by peer" traceback under the one line (`quiet_fd_sharing_resets`).
"""

from __future__ import annotations

import linecache
import os
import re
import signal
import sys

import torch
import torch.distributed as dist

from phalanx.errors import RunFailed, UsageError, authors_frame
from phalanx.runtime.ddp_unused import unused_line
from phalanx.runtime.board import FINISHED, WAITING, Line, Ticket, synced_steps
from phalanx.runtime.host_limits import limit_reason
from phalanx.runtime.state_dict_errors import prefix_line
from phalanx.runtime.tags import describe
from phalanx.runtime.world import World

# Making torch's SyncBatchNorm work here would mean replacing a private DDP method and
# SyncBatchNorm.forward in the user's process, and the script would then work under `phalanx run`
# only, not under torchrun; phalanx's own sync BatchNorm is one call away instead.
CPU_SYNC_BATCHNORM = ("torch.nn.SyncBatchNorm runs on GPUs only (torch refuses it for CPU workers, under torchrun "
                      "too); on CPU workers wrap the model with phalanx.prepare(model, batchnorm=\"sync\") instead of "
                      "DistributedDataParallel: it normalizes with the whole global batch's statistics, torch's "
                      "SyncBatchNorm layers included")
NCCL_ON_CPU = ("the script's process group uses backend \"nccl\"{at}, which runs on GPUs only, and these workers are "
               "CPU workers (--devices cpu:N): open it with init_process_group(\"gloo\") on CPU (a script that picks "
               "its backend from a device option of its own, as timm's train.py from --device, takes that option's "
               "CPU value), or call phalanx.init(), which picks gloo on CPU and NCCL on GPUs")
GROUP_AFTER_INIT = ("the script calls torch.distributed.init_process_group after phalanx.init(), which opened the "
                    "process group already: drop the script's own call (phalanx.init() joined the same world), or make "
                    "it before phalanx.init(), which then adopts the group the script opened")

GPU_ON_CPU = ("the script asks for a GPU{at}, and these workers are CPU workers ({why}): keep the model and its "
              "batches on the CPU - phalanx.init().device names each worker's device (cpu here, cuda:LOCAL_RANK on "
              "GPUs) - and leave out torch.cuda.set_device and DistributedDataParallel's device_ids there")
DDP_DEVICE_IDS_ON_CPU = ("the script wraps a model on the CPU as DistributedDataParallel(model, device_ids=[...]){at}: "
                         "device_ids names GPUs; leave it out (None) on CPU workers, or wrap the model with "
                         "phalanx.prepare(model), which needs neither")
GROUP_DEVICE_ID_ON_CPU = ("the script opens its process group with init_process_group(..., device_id=<the CPU>){at}: "
                          "device_id binds a group to one accelerator (cuda:LOCAL_RANK); leave it out on CPU workers, "
                          "where the group needs no device, or call phalanx.init(), which binds the GPU on GPUs only")
_GROUP_DEVICE_ID = ("device_id parameter must be an accelerator with an index",  # torch 2.13.0, 2.14.1
                    "device_id parameter must be a cuda device with an id")  # torch 2.4.1
# What torch says where a GPU is asked for and there is none: a CPU build (the first three: set_device, the
# lazy CUDA start behind .cuda() and .to("cuda"), Module.to(0) or Tensor.to(0) through the accelerator API),
# a CUDA build without a driver or a GPU (the rest).
_NO_GPU = ("has no attribute '_cuda_", "Torch not compiled with CUDA enabled",
           "Cannot access accelerator device when none is available", "Found no NVIDIA driver",
           "No CUDA GPUs are available", "no CUDA-capable device is detected")
_DDP_DEVICE_IDS = "device_ids and output_device arguments only work with"

# What torch says where NCCL cannot serve CPU workers: a CPU build (RuntimeError), a CUDA build on a
# host without a GPU (ValueError, from ProcessGroupNCCL's constructor; from torch 2.15 "nccl" is the
# torchcomms ProcessGroupNCCL2, whose RuntimeError says "nccl2 requires ..."), and a CUDA build's NCCL
# group handed CPU tensors (RuntimeError).
_NCCL_MISSING = ("doesn't have NCCL built in", "ProcessGroupNCCL is only supported with GPUs",
                 "nccl2 requires at least one CUDA device")
_NO_CPU_BACKEND = "No backend type associated with device type cpu"


def reworded(exc: BaseException, *, device_type: str, init_ran: bool) -> str | None:
    """The one line for `exc` (raised by the script on a worker of `device_type`; `init_ran`:
    phalanx.init() made this process's world), or None to report it as it is."""
    where, text = _raised_in(exc), str(exc)
    if device_type == "cpu" and isinstance(exc, ValueError) and "SyncBatchNorm" in text \
            and where in ("torch.nn.parallel.distributed", "torch.nn.modules.batchnorm"):
        return CPU_SYNC_BATCHNORM
    if device_type == "cpu" and isinstance(exc, (RuntimeError, ValueError)) and where.startswith("torch.") and (
            any(said in text for said in _NCCL_MISSING)
            or (_NO_CPU_BACKEND in text and dist.is_initialized() and dist.get_backend() == "nccl")):
        return NCCL_ON_CPU.format(at=_at_scripts_line(exc))
    if init_ran and isinstance(exc, ValueError) and "default process group twice" in text \
            and where == "torch.distributed.distributed_c10d":
        return GROUP_AFTER_INIT
    if device_type == "cpu" and isinstance(exc, (AttributeError, AssertionError, RuntimeError)) \
            and any(said in text for said in _NO_GPU) and not torch.cuda.is_available() \
            and not where.startswith("phalanx"):  # torch raises some from C++, in the frame that called it
        why = f"torch {torch.__version__} has no CUDA" if torch.version.cuda is None else "this host has no GPU"
        return GPU_ON_CPU.format(at=_at_scripts_line(exc), why=why)
    if device_type == "cpu" and isinstance(exc, ValueError) and _DDP_DEVICE_IDS in text \
            and "device(type='cpu')" in text and where == "torch.nn.parallel.distributed":
        return DDP_DEVICE_IDS_ON_CPU.format(at=_at_scripts_line(exc))
    if device_type == "cpu" and isinstance(exc, ValueError) and any(said in text for said in _GROUP_DEVICE_ID) \
            and where == "torch.distributed.distributed_c10d":
        return GROUP_DEVICE_ID_ON_CPU.format(at=_at_scripts_line(exc))
    if isinstance(exc, RuntimeError) and where == "torch.nn.modules.module":
        return prefix_line(text, _at_scripts_line(exc))
    if isinstance(exc, RuntimeError) and where == "torch.nn.parallel.distributed":
        return unused_line(text, _innermost_locals(exc).get("self"), _at_scripts_line(exc))
    return None


def _at_scripts_line(exc: BaseException) -> str:
    """" at train.py:89 (`torch.cuda.set_device(device)`)", or "" where no frame outside torch and
    phalanx is known: the line its author can change (errors.authors_frame), and the installed
    library's that raised it when one came between (timm's train.py wraps DDP inside timm.task)."""
    frames, tb = [], exc.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_globals.get("__name__", "")))
        tb = tb.tb_next
    found = authors_frame(frames[::-1])
    if found is None:
        return ""
    (path, line, _), library = found
    code = linecache.getline(path, line).strip()
    shown = f" (`{code if len(code) <= 80 else code[:77] + '...'}`)" if code else ""
    inner = "" if library is None else f" (in {library[2]}, line {library[1]})"
    return f" at {os.path.basename(path)}:{line}{shown}{inner}"


def stalled(exc: BaseException, *, timeout_s: float, rank: int | None = None, world: World | None = None) -> str | None:
    """The one line for a collective of the script's group that ran out of time on `rank` (gloo says
    "Timed out waiting 20000ms for recv operation to complete", naming neither the cause nor the
    fix), or None for any other error. `world`: the one phalanx.init() made (None: the script opened
    the group itself); its board says where the other local ranks were meanwhile."""
    text = str(exc)
    if not (isinstance(exc, RuntimeError) and "Timed out waiting" in text and "gloo" in text):
        return None
    who = f"rank {rank}" if rank is not None else "a rank"
    if world is None:
        waited = (f"{who} waited {timeout_s:g} s in a collective of the script's own process group for another rank, "
                  "the --timeout phalanx run gives a group opened without timeout= (torchrun leaves torch's 30 minutes)")
        # A library may open the group (transformers' Trainer on CPU drops its ddp_timeout): --timeout always works.
        fix = ("raise --timeout (--timeout 1800 waits as long as torchrun), or pass timeout= to init_process_group "
               "where the script opens the group")
    else:
        waited = (f"{who} waited {timeout_s:g} s in a torch.distributed collective of the script's own for another "
                  "rank, the --timeout of the process group phalanx.init() opened")
        fix = "raise --timeout"
    peers = _peers(world)
    in_ours = _waiting_in_ours(world, peers)
    if in_ours:
        where = ", ".join(f"rank {peer} waited in {describe(ticket.code, ticket.size_bytes)}"
                          for peer, ticket in in_ours)
        return (f"{waited}, while {where}, a collective of phalanx's: the ranks made different collective calls "
                "(a torch.distributed call on some ranks only?); every rank must make the same collective calls in "
                "the same order")
    done = [peer for peer, line in peers if line.state == FINISHED]
    if done:
        return (f"{waited}, while rank {done[0]} had finished its work without making that call (did it run fewer "
                "steps, or skip the call?); every rank must make the same collective calls in the same order")
    return (f"{waited}: another rank was busy that long (a dataset's preprocessing, an evaluation or a save on one "
            f"rank alone?) or never made the call; {fix}")


def _waiting_in_ours(world: World | None, peers: list[tuple[int, Line]]) -> list[tuple[int, Ticket]]:
    """(rank, ticket) of each peer waiting in a collective of phalanx's: one waiting now, or one
    whose wait ended since in a collective this rank never entered, which so cannot have completed:
    its own deadline ran out as this rank's did, and it is failing (RUNNING between the wait's end
    and its FAILED mark, a window the line read "another rank was busy" in once in CI)."""
    own = world.board.line(world.board.local_rank) if peers else None
    found = []
    for peer, line in peers:
        if line.state == WAITING and line.block is not None:
            found.append((peer, line.block))
        elif line.last_block is not None and own is not None \
                and line.last_block.seq > own.entered[line.last_block.channel]:
            found.append((peer, line.last_block))
    return found


def _peers(world: World | None) -> list[tuple[int, Line]]:
    """(rank, line) of each other local rank on `world`'s board (none without one)."""
    board = world.board if world is not None else None
    if board is None:
        return []
    return [(line.rank, line) for line in board.lines() if line is not None and line.rank != board.rank]


def translated(exc: BaseException, *, device_type: str, timeout_s: float, rank: int,
               world: World | None = None) -> BaseException | None:
    """The one-line error `exc` becomes in a `phalanx run` worker (UsageError, RunFailed), or None
    to report it as it is. `world`: the one phalanx.init() made in this process, if it ran."""
    line = reworded(exc, device_type=device_type, init_ran=world is not None)
    if line is not None:
        return UsageError(line)
    step = synced_steps(world)  # the last step this rank synced, when its board knows
    line = stalled(exc, timeout_s=timeout_s, rank=rank, world=world)
    if line is not None:
        return RunFailed(line)
    line = loader_worker_lost(exc, rank=rank, step=step)
    if line is None:
        return None
    failed = RunFailed(line)
    failed.culprit, failed.restartable = rank, True  # like a rank's death: a killed worker may not recur
    return failed


# torch's lines for a DataLoader worker gone: from its SIGCHLD handler (C++, one pid, its exit
# code or signal) and from the loader's own check after a get timed out (pids only).
_LOADER_LOST = re.compile(r"DataLoader worker \(pids?(?:\(s\))? ([\d, ]+)\) (?:exited unexpectedly(?: with exit "
                          r"code (-?\d+))?|is killed by signal: ([^.]+))")


def loader_worker_lost(exc: BaseException, *, rank: int, step: int | None = None) -> str | None:
    """The one line for a DataLoader worker of rank `rank` that exited (os._exit, sys.exit in
    its dataset) or died, or None for any other error (and for one that /dev/shm's size explains:
    host_limits says that)."""
    found = _LOADER_LOST.search(str(exc)) if isinstance(exc, RuntimeError) else None
    if found is None or not _raised_in(exc).startswith("torch.") or limit_reason(exc) is not None:
        return None
    pids, code, signal_name = found.group(1).strip(), found.group(2), found.group(3)
    if code is None and signal_name is None:  # the loader's own check: its frame holds the reaped processes
        codes = {w.exitcode for w in _innermost_locals(exc).get("failed_workers") or () if hasattr(w, "exitcode")}
        code = str(codes.pop()) if len(codes) == 1 and None not in codes else None
        if code is not None and int(code) < 0:
            code, signal_name = None, signal.Signals(-int(code)).name
    how = (f"exited with code {code}" if code is not None else f"was killed by signal {signal_name.strip()}"
           if signal_name else "exited unexpectedly")
    after = f" after step {step}" if step else ""
    return (f"rank {rank}'s DataLoader worker (pid {pids}) {how}{after}: its dataset's code (__getitem__, the "
            "collate_fn, a worker_init_fn) ended that process, whose own error is lost with it; rerun with "
            "num_workers=0 to see it in the rank itself")


def _raised_in(exc: BaseException) -> str:
    """The module of the innermost Python frame of `exc`'s traceback."""
    frame = _innermost_frame(exc)
    return frame.f_globals.get("__name__", "") if frame is not None else ""


def _innermost_locals(exc: BaseException) -> dict:
    """The local variables of the innermost Python frame of `exc`'s traceback."""
    frame = _innermost_frame(exc)
    return frame.f_locals if frame is not None else {}


def _innermost_frame(exc: BaseException):
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame if tb is not None else None


def quiet_fd_sharing_resets() -> None:
    """Wrap sys.excepthook (inherited by the script's forked DataLoader workers) so it drops what
    multiprocessing's file-descriptor server thread (resource_sharer._serve) reports when the
    process that asked it for a descriptor went away mid-request: a rank stopped by torch's SIGCHLD
    check while it fetched a batch from a sibling of the loader worker that died. The thread goes on
    serving; the rank's own line says why it stopped. Everything else reaches the previous hook."""
    previous = sys.excepthook
    if getattr(previous, "quiet_fd_sharing_resets", False):
        return

    def hook(kind, value, tb) -> None:
        outer = tb.tb_frame if tb is not None else None
        if issubclass(kind, (ConnectionError, EOFError)) and outer is not None and outer.f_code.co_name == "_serve" \
                and outer.f_globals.get("__name__") == "multiprocessing.resource_sharer":
            return
        previous(kind, value, tb)

    hook.quiet_fd_sharing_resets = True
    sys.excepthook = hook
