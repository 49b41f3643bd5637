"""Test accuracy computed on all devices at once (the chapter's exercise 4).

The test set is cut into contiguous shards, one per rank (sizes differ by at most one); each rank
counts its correct predictions and the counts are summed, so every test image is counted exactly
once and every rank gets the same accuracy. `evaluate` does this for tensors in memory (the
CLI's datasets; `count_accuracy` also for a model split, whose ranks each read every test image
and where those holding the output count); `evaluate_dataset` for any torch Dataset (a stream
too) and any summed metric (a user's); it moves each batch to the model's device and its
floating tensors to the model's floating dtype, as `evaluate` casts its images (a float64 model
from `prepare(dtype="float64")` takes a float32 Dataset; Lightning's precision plugins convert a
batch the same way).
It first checks that the replicas agree (`check_agree`: their parameters and optimizers in one
small allreduce, their buffers in one small all-gather): each rank evaluates its shard with its
own replica, so replicas that trained apart, or whose running statistics drifted apart, would be
mixed into one number without a word; then, for a map-style dataset, that every rank holds the same
one (`check_same_dataset`: a set each rank cut to its own part would count 1/k of it). Where forward is itself a collective (a
replica with `shard="parameters"` gathers each layer's weights), every rank runs as many
batches as the rank with the most, padding with empty ones (`lockstep_batches`). Its default
metric, `classification_sums`, is for a classifier returning logits and refuses anything else
(probabilities, one output column, float labels) with the fix: a `sums=` of yours.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset
from torch.utils.data._utils.collate import default_collate

from phalanx.comm import Tag, all_reduce_sum_, native
from phalanx.data import shard_bounds, to_float
from phalanx.data.empty_batch import ShardCollate
from phalanx.data.loader import refuse_loader, stream_shards
from phalanx.data_parallel.sharding.gather_hooks import collective_forward
from phalanx.data_parallel.guards.checks import check_replicas
from phalanx.data_parallel.guards.replicas import check_replicas_agree, replica_of
from phalanx.data_parallel.replica import ReplicaModule
from phalanx.runtime.call_habits import phalanx_call
from phalanx.runtime.world import World
from phalanx.train.same_dataset import check_same_dataset

EVALUATION = Tag("evaluation")  # what the board calls the sums below
REPLICA_CHECK = Tag("replica check")


@phalanx_call
def evaluate(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, *, world: World, batch_size: int = 1024
) -> float:
    """Test accuracy of a replica: each rank counts its contiguous shard of (images, labels)."""
    world.check_here("phalanx.evaluate")
    check_agree(model, world=world, where="phalanx.evaluate()")
    first, stop = shard_bounds(images.shape[0], world.world_size, world.rank)
    return count_accuracy(model, model, images, labels, rows=slice(first, stop), world=world, batch_size=batch_size)


def count_accuracy(module: nn.Module, predict: Callable[[torch.Tensor], torch.Tensor | None], images: torch.Tensor,
                   labels: torch.Tensor, *, rows: slice, world: World, batch_size: int = 1024) -> float:
    """Accuracy over every test image, counted once: this rank predicts `rows` (a slice) with
    `module` in eval mode and no gradients, counts where `predict` returns logits (a model split
    returns None on ranks that do not hold the output), and the counts are summed over ranks.
    `evaluate` reads each rank's shard; a model split has every rank read every row."""
    total = images.shape[0]
    images, labels = images[rows], labels[rows]  # views, strided or not
    was_training = module.training
    module.eval()
    counts = torch.zeros(2, dtype=torch.float64, device=world.device)  # correct, seen
    dtype = next(module.parameters()).dtype
    stop = images.shape[0]
    batches = lockstep_batches(-(-stop // batch_size), module, world=world)
    with torch.no_grad():
        for lo in range(0, batches * batch_size, batch_size):
            lo, hi = min(lo, stop), min(lo + batch_size, stop)
            logits = predict(to_float(images[lo:hi], dtype))
            if logits is not None:
                counts[0] += (logits.argmax(dim=1) == labels[lo:hi]).sum()
                counts[1] += hi - lo
    module.train(was_training)
    all_reduce_sum_(counts, world=world, tag=EVALUATION)
    seen = int(counts[1].item())
    if seen != total:  # a sharding bug would silently skew accuracy
        raise RuntimeError(f"evaluation saw {seen} test images, expected {total}")
    return counts[0].item() / max(seen, 1)


def classification_sums(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    """`evaluate_dataset`'s default for (inputs, labels) batches of a classifier that returns
    *logits* [batch, classes] for integer labels [batch]: cross-entropy sum and correct count.
    Other outputs (probabilities, a regression, a sequence) need a `sums=` of their own."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ValueError("evaluate_dataset's default sums take (inputs, labels) batches; pass sums=fn(model, batch) "
                         "-> {name: sum over the batch} for other data")
    inputs, labels = batch
    logits = model(inputs)
    check_logits(logits, labels)
    return {"loss": F.cross_entropy(logits, labels, reduction="sum"),
            "correct": (logits.argmax(dim=1) == labels).sum()}


_SUMS_FIX = "pass sums=fn(model, batch) -> {name: sum over the batch} that fits your model's output"
# Once a user's "count" (tokens) was silently replaced by the examples evaluate_dataset counts itself.
_RESERVED = ("evaluate_dataset's sums= returned a \"count\" key, which evaluate_dataset reserves for the number of "
             "examples it adds itself; name yours differently (e.g. \"tokens\") and divide by result[\"tokens\"]")


def check_logits(logits, labels) -> None:
    """ValueError unless (logits, labels) are what `classification_sums` assumes (one host sync:
    the probability check reads two numbers)."""
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise ValueError(f"evaluate_dataset's default sums expect the model to return a tensor of logits, got "
                         f"{type(logits).__name__}; {_SUMS_FIX}")
    shape = tuple(logits.shape)
    if not logits.is_floating_point() or logits.dim() != 2 or shape[1] < 2 or tuple(labels.shape) != (shape[0],):
        raise ValueError(f"evaluate_dataset's default sums expect class logits [batch, classes >= 2] and integer "
                         f"labels [batch], got outputs {shape} and labels {tuple(labels.shape)}; {_SUMS_FIX}")
    if labels.is_floating_point() or labels.is_complex():
        raise ValueError(f"evaluate_dataset's default sums expect integer class labels, got {labels.dtype}; "
                         f"{_SUMS_FIX}")
    if shape[0] > 0:
        low, row_error = torch.stack([logits.min().double(), (logits.double().sum(dim=1) - 1).abs().max()]).tolist()
        if low >= 0 and row_error < 1e-4:  # logits essentially never look like this
            raise ValueError("evaluate_dataset's default sums apply cross-entropy to logits, but the model's outputs "
                             "look like probabilities (rows in [0, 1] summing to 1); return logits (drop the "
                             f"softmax), or {_SUMS_FIX}")


_NOTHING = ("evaluate_dataset got {what}: there is nothing to evaluate; pass the held-out set itself (the sums "
            "of an empty one would be 0 and its means 0 / 0)")


@phalanx_call
def evaluate_dataset(model: nn.Module, dataset: Dataset, *, world: World, batch_size: int = 256,
                     sums: Callable = classification_sums, collate_fn: Callable | None = None) -> dict[str, float]:
    """Exact evaluation of any Dataset on all ranks: sums over every example, counted once.

    Each rank reads its contiguous shard of the dataset (sizes differ by at most one), calls
    `sums(model, batch)` -> {name: sum over the batch} in eval mode without gradients, and the
    sums are added across ranks in one allreduce. Returns every rank the same dict of global
    sums plus "count" (= len(dataset), checked; a "count" of `sums`' own is refused); divide by it
    for means. A rank with an empty shard evaluates an empty batch, so the names are the same
    everywhere. `model`: the replica (a DataParallel) or its module; its buffers must agree across
    ranks (checked first). A stream (IterableDataset) is read whole by every rank, which evaluates its slice of each
    `batch_size` x k items; "count" is then checked against the items each rank read.
    """
    world.check_here("phalanx.evaluate_dataset")
    refuse_loader(dataset, "evaluate_dataset")
    if not callable(sums):  # before any collective: every rank refuses alike
        raise TypeError(f"evaluate_dataset's sums= takes a function, got a {type(sums).__name__}; {_SUMS_FIX}, "
                        "e.g. sums=lambda model, batch: {\"loss\": F.cross_entropy(model(batch[0]), batch[1], "
                        "reduction=\"sum\")}")
    if not isinstance(dataset, IterableDataset) and len(dataset) == 0:  # every rank alike, before any collective
        raise ValueError(_NOTHING.format(what="a dataset of 0 examples"))
    check_agree(model, world=world, where="evaluate_dataset()")
    if world.distributed and not isinstance(dataset, IterableDataset):  # a stream's count is checked after
        check_same_dataset(dataset, world=world, caller="evaluate_dataset", tag=EVALUATION)
    if isinstance(dataset, IterableDataset):  # a stream: every rank reads it, evaluating its slice of each chunk
        read = [0, 0]  # items this rank read (every rank must read the same), and of them its own
        batches = _counted(stream_shards(dataset, batch_size * world.world_size, world=world,
                                         collate_fn=collate_fn or default_collate), read, world=world)
    else:
        start, stop = shard_bounds(len(dataset), world.world_size, world.rank)
        collate = ShardCollate(dataset, collate_fn or default_collate)
        loader = DataLoader(Subset(dataset, range(start, stop)), batch_size=batch_size, collate_fn=collate)
        empty = max(1, lockstep_batches(len(loader), model, world=world)) - len(loader)
        batches = itertools.chain(iter(loader), (collate([]) for _ in range(empty)))
        read = [len(dataset), stop - start]
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    was_training = model.training
    model.eval()
    totals: dict[str, torch.Tensor] = {}
    try:
        with torch.no_grad():
            for batch in batches:
                for name, value in sums(model, _to_device(batch, world.device, dtype)).items():
                    if name == "count":  # every rank calls sums at least once: all refuse before the sum
                        raise ValueError(_RESERVED)
                    value = torch.as_tensor(value, dtype=torch.float64, device=world.device)
                    totals[name] = totals.get(name, 0) + value
    finally:
        model.train(was_training)
    names = sorted(totals)
    flat = torch.stack([totals[n] for n in names] + [torch.tensor(float(read[1]), dtype=torch.float64,
                                                                   device=world.device)])
    all_reduce_sum_(flat, world=world, tag=EVALUATION)
    result = dict(zip(names, flat[:-1].tolist()))
    result["count"] = flat[-1].item()
    if result["count"] == 0:  # a stream that yielded nothing, on every rank: no sums were taken
        raise ValueError(_NOTHING.format(what="a stream that yielded no items"))
    expected = read[0]
    if int(result["count"]) != expected:  # a sharding bug, or a stream that differs between ranks, would skew it
        stream = (f"; rank {world.rank} read {expected} items of the stream, which must yield the same items in the "
                  "same order on every rank (seed its shuffle)") if isinstance(dataset, IterableDataset) else ""
        raise RuntimeError(f"evaluation saw {int(result['count'])} examples, expected {expected}{stream}")
    return result


def check_agree(model: nn.Module, *, world: World, where: str) -> None:
    """Raise ReplicaMismatch unless every rank's `model` is the same model: a replica (a DataParallel)
    compares its parameters and optimizers (guards/replicas.py), any other module its parameters,
    unless its forward gathers them (a module sharded to stage 3); then the buffers, by name (checks.py).
    `where`: the caller, for the line. A collective: every rank calls it."""
    replica = model if isinstance(model, ReplicaModule) else replica_of(model)  # dp.module: its replica's
    if replica is not None:
        replica.check_replicas(where=where)
    elif world.distributed and not collective_forward(model):
        check_replicas_agree(world=world, parameters=list(model.named_parameters()), optimizers=(), whole_state=False,
                             found=f"found by {where}", allreduce=lambda flat: all_reduce_sum_(flat, world=world,
                                                                                              tag=REPLICA_CHECK))
    check_replicas(world, model, step=None, buffers_only=True)


def _counted(shards, read: list[int], *, world: World):
    """`stream_shards`' batches, counting the items read (read[0]) and this rank's of them (read[1])."""
    for batch, size in shards:
        start, stop = shard_bounds(size, world.world_size, world.rank)
        read[0], read[1] = read[0] + size, read[1] + stop - start
        yield batch


def lockstep_batches(count: int, module: nn.Module, *, world: World) -> int:
    """How many batches this rank evaluates: its own `count`, or - where `module`'s forward is a
    collective (stage 3 gathers every layer) - the largest count of any rank (one small allreduce)."""
    if not world.distributed or not collective_forward(module):
        return count
    most = torch.tensor([float(count)], dtype=torch.float64, device=world.device)
    native(world, EVALUATION, lambda: dist.all_reduce(most, op=dist.ReduceOp.MAX, async_op=True),
           size_bytes=most.element_size())
    return int(most.item())


def _to_device(batch, device: torch.device, dtype: torch.dtype | None):
    """`batch` on `device`, its floating tensors in `dtype` (None: as they are); integer labels,
    token ids and masks keep theirs. Dicts, lists, tuples, named tuples (as default_collate keeps
    them) and dataclasses keep their structure; anything else is passed as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, dtype) if dtype is not None and batch.is_floating_point() else batch.to(device)
    if isinstance(batch, dict):
        return {k: _to_device(v, device, dtype) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple takes its fields one by one
        return type(batch)(*(_to_device(v, device, dtype) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(v, device, dtype) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: _to_device(getattr(batch, f.name), device, dtype)
                                             for f in dataclasses.fields(batch) if f.init})
    return batch
