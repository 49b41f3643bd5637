"""Modules a replica cannot be built from, refused where one is built, in one line naming the fix.

A lazy module (`nn.LazyLinear`) has no shapes until its first forward; one built on the meta device
(deferred initialization, as torchtitan builds a model) has no values until it is materialized.
Neither can be broadcast from rank 0 or laid out in buckets, and either would die inside torch
(`UninitializedParameter`, "Cannot copy out of meta tensor"). A model already inside a data-parallel
wrapper (torch's DDP, FSDP or `nn.DataParallel`, the book's one-process split over GPUs, or a
phalanx replica) would have its gradients exchanged twice, once by each; so would a model an open
replica holds (`held`), prepared again (a notebook cell run twice, a helper called twice): each
replica's hooks fire on every gradient, and the older one refused every step as never summed.
`prepare` refuses them before converting anything, and `DataParallel` before it moves the module
(replica.py's `placed`), on every world size alike, so a script fails on one device where it would
on k.

The other way round, DDP around a replica (a ported script that keeps its `DDP(model)` line after
`phalanx.prepare`), is refused in DDP's constructor (`RefusesAnOuterWrapper`).

On more than one rank, also an `nn.Embedding` (or `EmbeddingBag`) with `max_norm`: its forward
renormalizes, in place, the rows this rank's batch looks up, so each rank changes other rows and the
replicas part (under `shard="parameters"` the write lands in a gathered copy and is lost). No
exchange can make that the 1-device update; renormalizing after the step, on every rank, can.
"""

from __future__ import annotations

import os
import weakref

from torch import nn
from torch.nn import Embedding, EmbeddingBag
from torch.nn.parallel import DataParallel as OneProcess, DistributedDataParallel

from phalanx.errors import Misuse, frame_outside

# Every replica built, with where the script built it; open while not closed (its hooks hold it alive).
_BUILT: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def held(replica: nn.Module) -> None:
    """`replica` (a DataParallel, built) now exchanges its module's gradients: a later prepare of
    any of them is refused while it is open."""
    frame, _ = frame_outside()
    _BUILT[replica] = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def refuse_unfit(module: nn.Module, *, world_size: int = 1) -> None:
    """ValueError naming the fix for a lazy or meta parameter, or a data-parallel wrapper, in `module`;
    on `world_size` > 1 also for an embedding with `max_norm`."""
    for name, inner in module.named_modules() if world_size > 1 else ():
        if isinstance(inner, (Embedding, EmbeddingBag)) and inner.max_norm is not None:
            raise ValueError(f"{name or 'the model'} is {type(inner).__name__}(max_norm={inner.max_norm}), whose forward "
                             f"renormalizes the rows each rank looks up, in place, so {world_size} ranks cannot equal "
                             "1 device: pass max_norm=None and renormalize the weight after optimizer.step() on every "
                             "rank under torch.no_grad() (shard=\"parameters\": inside `with "
                             "dp.gathered_parameters(writeback=True):`)")
    for name, inner in module.named_modules():
        wrapper = _wrapper(inner)
        if wrapper is not None:
            where = f"its submodule {name}" if name else "the model"
            raise ValueError(f"{where} is already wrapped in {wrapper}, whose gradient exchange phalanx's would "
                             f"repeat; pass the model itself ({'.'.join(filter(None, [name, 'module']))} of this one) "
                             "to phalanx.prepare, once")
    _refuse_held(module)
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        owner = type(module.get_submodule(name.rpartition(".")[0])).__name__
        if nn.parameter.is_lazy(tensor):  # DDP refuses them too
            raise ValueError(f"{name} is not initialized yet ({owner} infers its shape at the first forward): "
                             "run one forward with a batch of your data before phalanx.prepare, on every rank, "
                             "then prepare")
        if tensor.is_meta:
            raise ValueError(f"{name} ({owner}) is on the meta device and holds no values: materialize the model "
                             "before phalanx.prepare, model.to_empty(device=world.device) then initialize it (each "
                             "module's reset_parameters(), or your init; prepare broadcasts rank 0's values)")


def _refuse_held(module: nn.Module) -> None:
    """ValueError if an open replica already exchanges a parameter of `module` (the model, a part, a whole)."""
    open_replicas = [(replica, site) for replica, site in list(_BUILT.items()) if not replica._closed]
    if not open_replicas:
        return
    names = {id(param): name for name, param in module.named_parameters()}
    for replica, site in open_replicas:
        shared = next((names[id(p)] for p in replica.module.parameters() if id(p) in names), None)
        if shared is not None:
            raise ValueError(f"the model's parameter {shared} is already exchanged by an open phalanx replica (made "
                             f"at {site}), and a second would exchange it again: use that replica, or call its "
                             "close() first (a notebook cell that prepares the model, run twice: dp.close(), then "
                             "run it)")


def _wrapper(module: nn.Module) -> str | None:
    """The name of the data-parallel wrapper `module` is, or None."""
    if isinstance(module, DistributedDataParallel):
        return "torch's DistributedDataParallel"
    if isinstance(module, OneProcess):
        return "torch.nn.DataParallel (one process splitting each batch over its GPUs; phalanx runs one per device)"
    kind = type(module).__name__
    if kind in ("FullyShardedDataParallel",) or kind.startswith("FSDP"):  # FSDP1, and FSDP2's FSDP<Model> classes
        return f"torch's FSDP ({kind}; phalanx's own sharding: prepare(model, shard=...))"
    if hasattr(module, "finish_gradient_sync") and hasattr(module, "buckets"):
        return "a phalanx replica (DataParallel)"
    return None


class RefusesAnOuterWrapper:
    """A replica wrapped in torch's DDP would have its gradients exchanged a second time, summed
    then averaged on top (before 2026-12-06 the step was refused later, blaming a clip). DDP's
    constructor reads this attribute of the module it wraps (torch 2.4 to 2.13, its one reader):
    reading it raises the one line, at the script's `DDP(...)` line."""

    @property
    def _ddp_params_and_buffers_to_ignore(self):
        raise Misuse("DistributedDataParallel around the replica phalanx.prepare returned would exchange its "
                     "gradients a second time: drop the DDP(...) wrap and use the replica itself (it keeps DDP's "
                     "habits: .module, no_sync(), state_dict())")
