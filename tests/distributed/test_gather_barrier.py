"""`phalanx.gather`, `phalanx.barrier` and `phalanx.broadcast` on 3 gloo processes: gather equals
torch's own all-gather of every rank's tensor, concatenated in rank order (uneven and empty shards,
every dtype kind, int16 and complex among them, 0-d, a non-contiguous view, rows of width 0), a ShardedLoader's shards gather into the 1-device
global batch, a row mismatch is one ValueError on every rank naming both, and no rank leaves a
barrier before the last has come to it, and main_first's block ends on rank 0 before another
rank's begins (per_host too, on one host); broadcast gives every rank what torch's
broadcast_object_list gives (a dict of a string, a number and tensors, from rank 1; a bare tensor
from rank 2); a tuple, list or dict of tensors gathers (and of values reduces) as each one alone."""

from __future__ import annotations

import collections
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import phalanx
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed


def _cases(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return {
        "float64 rows": torch.randn(rank + 1, 3, generator=g, dtype=torch.float64),
        "int64 1-d": torch.randint(-9, 9, (2 * rank + 1,), generator=g),
        "bool": torch.rand(rank + 2, 2, generator=g) > 0.5,
        "float32 0-d": torch.tensor(float(rank) + 0.5),
        "bfloat16 view": torch.randn(4, 6, generator=g).to(torch.bfloat16)[:, ::2],
        "empty on rank 1": torch.randn(0 if rank == 1 else 2, 2, generator=g),
        "int16 (gloo's all-gather has none)": torch.randint(-300, 300, (rank + 1, 2), generator=g).to(torch.int16),
        "complex64": torch.randn(rank + 1, 2, generator=g, dtype=torch.complex64),
        "rows of width 0": torch.zeros(rank + 1, 0, 3),
    }


Pair = collections.namedtuple("Pair", "preds labels")


def _torch_gather(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """torch's own answer: every rank's tensor as an object, concatenated in rank order."""
    objects = [None] * world_size
    dist.all_gather_object(objects, tensor)
    return torch.cat([t.reshape(1) if t.dim() == 0 else t for t in objects])


def _worker(world, marker_dir: str) -> dict:
    out: dict = {}
    for name, tensor in _cases(world.rank).items():
        before = tensor.clone()
        got = phalanx.gather(tensor, world=world)
        want = _torch_gather(tensor, world.world_size)
        out[name] = (got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
                     and torch.equal(tensor, before))
    # A ShardedLoader's shards gather into the global batch, in its order.
    labels = torch.arange(10)
    dataset = torch.utils.data.TensorDataset(torch.zeros(10, 1), labels)
    loader = phalanx.ShardedLoader(dataset, world=world, global_batch_size=4, seed=3)
    gathered = [phalanx.gather(y, world=world) for (_, y), _ in loader.epoch(0)]
    out["loader"] = gathered
    # A collection (Accelerate's gather_for_metrics((preds, labels)), Fabric's all_gather and all_reduce of
    # a dict): the same collection, each tensor gathered (each value reduced) as alone. Before 2026-12-06
    # both were refused ("gather takes a tensor, got tuple").
    cases = _cases(world.rank)
    nested = {"pair": (cases["float64 rows"], cases["int64 1-d"]), "list": [cases["bool"]],
              "named": Pair(cases["float32 0-d"], cases["complex64"])}
    got = phalanx.gather(nested, world=world)
    leaves = [*got["pair"], *got["list"], *got["named"]]
    wanted = [_torch_gather(t, world.world_size) for t in (*nested["pair"], *nested["list"], *nested["named"])]
    out["collection"] = ([type(got[key]) for key in ("pair", "list", "named")] == [tuple, list, Pair]
                         and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(leaves, wanted)))
    values = {"loss": 0.25 * world.rank, "counts": [world.rank + 1, torch.tensor([world.rank, 2])]}
    for op in ("sum", "mean", "max"):
        got = phalanx.reduce(values, op=op, world=world)
        alone = {"loss": phalanx.reduce(values["loss"], op=op, world=world),
                 "counts": [phalanx.reduce(v, op=op, world=world) for v in values["counts"]]}
        out[f"reduce {op}"] = (got["loss"] == alone["loss"] and got["counts"][0] == alone["counts"][0]
                               and type(got["counts"][0]) is type(alone["counts"][0])
                               and torch.equal(got["counts"][1], alone["counts"][1]))
    # Rows that do not match: every rank raises, naming both.
    try:
        phalanx.gather(torch.zeros(2, 3 if world.rank == 1 else 4), world=world)
    except ValueError as exc:
        out["mismatch"] = str(exc)
    # The barrier: rank 2 arrives late, after writing a file; nobody leaves before it exists.
    marker = Path(marker_dir) / "rank2-was-here"
    if world.rank == 2:
        time.sleep(0.5)
        marker.write_text("x")
    phalanx.barrier(world=world)
    out["after barrier"] = marker.exists()
    # main_first: the first rank's block (filling a cache slowly) ends before any other's begins;
    # per_host on one host: the same first rank. CLOCK_MONOTONIC is one clock for every process.
    for per_host in (False, True):
        cache = Path(marker_dir) / f"cache-{per_host}"
        with phalanx.main_first(world=world, per_host=per_host):
            began = time.monotonic()
            if world.rank == 0:
                time.sleep(0.3)
                cache.write_text("filled")
            out[f"main_first {per_host}"] = (cache.exists(), began, time.monotonic())
    for src, sent in ((1, {"run": "exp-7", "seed": 1234, "weights": torch.arange(6.0).reshape(2, 3),
                           "mask": torch.tensor([True, False])}), (2, torch.randn(5, dtype=torch.float64))):
        mine = sent if world.rank == src else None
        got = phalanx.broadcast(mine, src=src, world=world)
        torchs = [mine]
        dist.broadcast_object_list(torchs, src=src)
        out[f"broadcast from {src}"] = (got, torchs[0], got is mine)
    return out


def test_gather_and_barrier_against_torch(tmp_path):
    results = run_workers(_worker, 3, str(tmp_path), timeout_s=90)
    one_device = phalanx.ShardedLoader(torch.utils.data.TensorDataset(torch.zeros(10, 1), torch.arange(10)),
                                       world=_world_of_one(), global_batch_size=4, seed=3)
    expected = [y for (_, y), _ in one_device.epoch(0)]
    for rank, out in enumerate(results):
        for name in _cases(0):
            assert out[name], f"rank {rank}: {name}"
        assert len(out["loader"]) == len(expected) == 3
        for got, want in zip(out["loader"], expected):
            assert torch.equal(got, want)
        mismatch = out["mismatch"]  # the first rank whose rows differ from this rank's, and this rank's
        assert mismatch.startswith("gather: rank ") and "\n" not in mismatch
        assert "float32 rows of shape (3,)" in mismatch and "float32 rows of shape (4,)" in mismatch
        assert mismatch.endswith("every rank's rows must have the same trailing shape and dtype")
        assert out["collection"] and all(out[f"reduce {op}"] for op in ("sum", "mean", "max")), rank
        assert out["after barrier"]
        for per_host in (False, True):
            saw, began, _ = out[f"main_first {per_host}"]
            assert saw and (rank == 0 or began >= results[0][f"main_first {per_host}"][2]), (rank, per_host)
        for src in (1, 2):
            got, torchs, own = out[f"broadcast from {src}"]
            assert own == (rank == src)  # the sender gets its object back
            if isinstance(torchs, dict):
                assert got.keys() == torchs.keys() and got["run"] == "exp-7" and got["seed"] == 1234
                assert all(torch.equal(got[k], torchs[k]) for k in ("weights", "mask"))
            else:
                assert torch.equal(got, torchs) and got.dtype == torch.float64
    assert results[0]["mismatch"].startswith("gather: rank 1 has float32 rows of shape (3,), rank 0 float32 rows")


def _world_of_one():
    from phalanx.runtime.world import World
    return World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend="none",
                 timeout_s=5.0)


def test_a_world_of_one_gathers_its_own_rows_and_passes_the_barrier():
    world = _world_of_one()
    assert torch.equal(phalanx.gather(torch.tensor(2.0), world=world), torch.tensor([2.0]))
    rows = torch.arange(6).reshape(3, 2)
    got = phalanx.gather(rows, world=world)
    assert torch.equal(got, rows) and got.data_ptr() != rows.data_ptr()
    phalanx.barrier(world=world)
    with phalanx.main_first(world=world), phalanx.main_first(world=world, per_host=True):
        ran = True
    assert ran
    with pytest.raises(ValueError, match=r"gather takes a tensor \(or a tuple, list or dict of them\), got float"):
        phalanx.gather(2.0, world=world)
    with pytest.raises(ValueError, match="dtype torch.uint16 is not supported"):
        phalanx.gather(torch.zeros(2, dtype=torch.uint16), world=world)
    assert torch.equal(phalanx.gather(torch.ones(2, dtype=torch.complex64), world=world), torch.ones(2) + 0j)
    thing = {"run": "exp-7"}
    assert phalanx.broadcast(thing, world=world) is thing
    with pytest.raises(ValueError, match=r"^broadcast: src=1 is not a rank of this world of 1; use 0..0$"):
        phalanx.broadcast(thing, src=1, world=world)
