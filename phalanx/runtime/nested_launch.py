"""A script under `phalanx run` that starts workers of its own, refused at the call in one line.

torch's DDP tutorial starts its ranks with `torch.multiprocessing.spawn`, each child opening its
group with `init_process_group(rank=rank, world_size=n)` on a MASTER_PORT of the script's choosing.
Under `phalanx run` those children inherit torchrun's environment, whose
TORCHELASTIC_USE_AGENT_STORE makes every rank a client of a store on that port that no one hosts:
they wait torch's 30 minutes (fresh interpreters, which `--timeout` does not reach), and with k > 1
workers every worker spawns its own set besides. Before this refusal such a run hung until it was
killed, on one worker as on two (under torchrun it hangs alike). `python script.py` runs it, and
phalanx.init() in each child joins the group it opens.

Both of torch's entry points are held, in the package and in its `spawn` module (where `spawn`
calls `start_processes`): `mp.spawn(...)` and `from torch.multiprocessing.spawn import
start_processes` (both tested), and a launcher that imports them while the script runs, meet the
refusal; a worker's own processes (DataLoader workers, multiprocessing pools) do not. Lightning's
Trainer and Fabric with strategy="ddp_spawn" or "ddp_fork" start their workers through
`start_processes`: their refusal names Lightning's fix, strategy="ddp" (checked with lightning
2.6.6's Trainer, 2026-12-05).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Callable, Iterator

import torch.multiprocessing

from phalanx.errors import UsageError
from phalanx.runtime.main_module import Target

ENTRY_POINTS = ("spawn", "start_processes")


def nested_launch_message(name: str, *, nprocs: int, device_type: str, target: Target, caller: str = "") -> str:
    """The refusal; `caller`: the file that called torch's starter (Lightning's own launchers get their fix)."""
    if {"lightning", "pytorch_lightning", "lightning_fabric"} & set(Path(caller).parts):
        return ('Lightning\'s strategy="ddp_spawn" (or "ddp_fork") would start its own workers under phalanx run, '
                'which starts the workers itself (its children would wait forever for a rendezvous): pass '
                f'strategy="ddp" to the Trainer (or Fabric), which joins the workers `phalanx run --devices '
                f'{device_type}:{nprocs} {target.command}` starts')
    return (f"torch.multiprocessing.{name} would start {nprocs} workers of the script's own under phalanx "
            "run, which starts the workers itself (its children would wait forever for a rendezvous): run it as "
            f"`python {target.command}` (phalanx.init() in each child joins the group it opens), or drop the spawn "
            f"and run `phalanx run --devices {device_type}:{nprocs} {target.command}`")


@contextlib.contextmanager
def refusing_nested_launch(*, device_type: str, target: Target) -> Iterator[None]:
    """While the script runs, torch's process starters raise UsageError."""
    holders = [torch.multiprocessing, sys.modules["torch.multiprocessing.spawn"]]
    saved = [(holder, name, getattr(holder, name)) for holder in holders for name in ENTRY_POINTS]

    def refusal(name: str) -> Callable[..., None]:
        def refuse(fn: object, args: object = (), nprocs: int = 1, *rest: object, **kwargs: object) -> None:
            raise UsageError(nested_launch_message(name, nprocs=nprocs, device_type=device_type, target=target,
                                                   caller=sys._getframe(1).f_code.co_filename))
        return refuse

    for holder, name, _ in saved:
        setattr(holder, name, refusal(name))
    try:
        yield
    finally:
        for holder, name, original in saved:
            setattr(holder, name, original)
