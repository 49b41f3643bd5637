"""The public API without processes: the front door re-exports, ShardedLoader's global-batch
semantics against one device's batches, shard_loss, clip_grad_norm_'s refusals, evaluate_dataset,
init() outside any launcher. The k-process behaviour is tests/distributed/test_run_script.py."""

import collections
import dataclasses
import importlib
import typing

import numpy
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import phalanx
from phalanx.runtime import script
from phalanx.runtime.world import World


def world(rank: int, world_size: int) -> World:
    # ShardedLoader only reads rank and world size; no process group is needed to cut batches.
    return World(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size,
                 device=torch.device("cpu"), backend="gloo" if world_size > 1 else "none", timeout_s=10)


def test_front_door_reexports_the_owners_objects():
    owners = {"DataParallel": "phalanx.data_parallel.data_parallel", "ShardedLoader": "phalanx.train.sharded_loader",
              "shard_loss": "phalanx.data_parallel.step", "clip_grad_norm_": "phalanx.data_parallel.clip",
              "evaluate_dataset": "phalanx.train.evaluate", "init": "phalanx.runtime.script",
              "checkpoint": "phalanx.train.script_checkpoint", "resume": "phalanx.train.script_checkpoint",
              "split_batch": "phalanx.data.split", "allreduce": "phalanx.comm", "World": "phalanx.runtime.world"}
    assert set(owners) <= set(phalanx.__all__)
    for name in phalanx.__all__:
        assert getattr(phalanx, name) is not None
    for name, module in owners.items():
        assert getattr(phalanx, name) is getattr(importlib.import_module(module), name)
    # What a notebook's completion offers: the public names, not the front door's own imports (importlib,
    # sys) or the subpackages loaded so far (before 2026-12-05 all of them).
    assert [name for name in dir(phalanx) if not name.startswith("_")] == sorted(phalanx.__all__)


@pytest.mark.parametrize("k", [2, 3])
def test_sharded_loader_shards_add_up_to_one_devices_batches(k):
    n, batch = 61, 20  # last batch: 1 example, so k - 1 ranks get an empty shard
    data = TensorDataset(torch.arange(n, dtype=torch.float64).unsqueeze(1).repeat(1, 3), torch.arange(n))
    one = list(phalanx.ShardedLoader(data, world=world(0, 1), global_batch_size=batch, seed=7).epoch(2))
    ranks = [list(phalanx.ShardedLoader(data, world=world(r, k), global_batch_size=batch, seed=7).epoch(2))
             for r in range(k)]
    assert [g for _, g in one] == [20, 20, 20, 1]
    for step, ((X, y), global_size) in enumerate(one):
        pieces = [ranks[r][step] for r in range(k)]
        assert all(g == global_size for _, g in pieces)
        assert torch.equal(torch.cat([p[0][1] for p in pieces]), y)  # same examples, same order
        assert all(p[0][0].shape[1:] == (3,) and p[0][0].dtype == torch.float64 for p in pieces)
    assert [len(ranks[r][-1][0][1]) for r in range(k)] == [1] + [0] * (k - 1)
    other_epoch = [y for (_, y), _ in phalanx.ShardedLoader(data, world=world(0, 1), global_batch_size=batch,
                                                            seed=7).epoch(3)]
    assert not torch.equal(torch.cat(other_epoch), torch.cat([y for (_, y), _ in one]))  # reshuffled per epoch


def test_drop_last_leaves_out_only_a_smaller_last_global_batch():
    n, batch = 61, 20
    data = TensorDataset(torch.zeros(n, 1), torch.arange(n))
    kept = phalanx.ShardedLoader(data, world=world(0, 2), global_batch_size=batch, seed=7, drop_last=True)
    whole = phalanx.ShardedLoader(data, world=world(0, 2), global_batch_size=batch, seed=7)
    assert len(kept) == 3 and [g for _, g in kept.epoch(2)] == [20, 20, 20] and len(whole) == 4
    for (a, _), (b, _) in zip(kept.epoch(2), whole.epoch(2)):  # the same order, cut the same way
        assert torch.equal(a[1], b[1])
    even = TensorDataset(torch.zeros(60, 1), torch.arange(60))  # nothing smaller to leave out
    assert len(phalanx.ShardedLoader(even, world=world(0, 2), global_batch_size=batch, drop_last=True)) == 3
    with pytest.raises(ValueError, match="drop_last=True leaves nothing of 4 examples in global batches of 8"):
        phalanx.ShardedLoader(TensorDataset(torch.zeros(4, 1)), world=world(0, 1), global_batch_size=8,
                              drop_last=True)


def test_sharded_loader_refusals():
    data = TensorDataset(torch.zeros(4, 1), torch.zeros(4))
    with pytest.raises(ValueError, match="decides batch_size"):
        phalanx.ShardedLoader(data, world=world(0, 1), global_batch_size=2, batch_size=2)
    with pytest.raises(ValueError, match="smaller than the 3 ranks"):
        phalanx.ShardedLoader(data, world=world(0, 3), global_batch_size=2)
    with pytest.raises(ValueError, match="0 examples"):
        phalanx.ShardedLoader(TensorDataset(torch.zeros(0, 1)), world=world(0, 1), global_batch_size=2)


def test_shard_loss_of_uneven_shards_sums_to_the_global_mean():
    losses = torch.rand(11, dtype=torch.float64)
    shards = torch.split(losses, [4, 4, 3])
    total = sum(phalanx.shard_loss(s.sum(), 11) for s in shards)
    torch.testing.assert_close(total, losses.mean())
    wrong = sum(s.mean() for s in shards) / 3  # the per-rank-mean bug
    assert abs(wrong - losses.mean()) > 1e-6
    with pytest.raises(TypeError, match=r"^shard_loss takes the shard's loss sum as a tensor, got float: pass the "
                                        r"loss itself \(F.cross_entropy\(out, y, reduction='sum'\)\), not its "
                                        r"\.item\(\)$"):  # was "'float' object has no attribute 'requires_grad'"
        phalanx.shard_loss(losses.sum().item(), 11)


def test_clip_grad_norm_refuses_partial_gradients_and_clips_the_summed_one():
    torch.manual_seed(0)
    dp = phalanx.DataParallel(nn.Linear(4, 3), world=world(0, 1), options=phalanx.DataParallelConfig(overlap=False))
    X, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with dp.no_sync():
        F.cross_entropy(dp(X), y).backward()
        with pytest.raises(RuntimeError, match="inside no_sync"):
            phalanx.clip_grad_norm_(dp, 0.1)
    dp.finish_gradient_sync()
    norm = phalanx.clip_grad_norm_(dp, 0.1)
    after = torch.sqrt(sum(p.grad.pow(2).sum() for p in dp.module.parameters()))
    assert norm > 0.1 and after == pytest.approx(0.1, rel=1e-5)
    dp.close()


def test_evaluate_dataset_counts_every_example_once():
    torch.manual_seed(0)
    model = nn.Linear(3, 4)
    X, y = torch.randn(37, 3), torch.randint(0, 4, (37,))
    sums = phalanx.evaluate_dataset(model, TensorDataset(X, y), world=world(0, 1), batch_size=8)
    with torch.no_grad():
        logits = model(X)
    assert sums["count"] == 37
    assert sums["correct"] == (logits.argmax(1) == y).sum().item()
    assert sums["loss"] == pytest.approx(F.cross_entropy(logits, y, reduction="sum").item(), rel=1e-6)


def test_evaluate_dataset_takes_sums_as_a_function_and_says_so_for_anything_else():
    data = TensorDataset(torch.randn(4, 3), torch.randint(0, 2, (4,)))
    with pytest.raises(TypeError, match=r"^evaluate_dataset's sums= takes a function, got a dict; pass "
                                        r"sums=fn\(model, batch\) -> "):
        phalanx.evaluate_dataset(nn.Linear(3, 2), data, world=world(0, 1), sums={"loss": 0.0})  # was "not callable"


def test_evaluate_dataset_refuses_a_count_of_the_sums_own_naming_the_fix():
    # Before 2026-12-03 a language model's {"loss": ..., "count": tokens} came back with "count" the
    # number of sequences (10, not 60): loss / count was 6x the mean token loss, silently.
    model = nn.Linear(3, 2)
    data = TensorDataset(torch.randn(10, 3), torch.randint(0, 2, (10, 6)))
    with pytest.raises(ValueError, match=r'^evaluate_dataset\'s sums= returned a "count" key, which evaluate_dataset '
                                         r'reserves .*name yours differently \(e.g. "tokens"\)'):
        phalanx.evaluate_dataset(model, data, world=world(0, 1), sums=lambda m, b: {"loss": m(b[0]).sum(),
                                                                                   "count": b[1].numel()})
    assert model.training  # put back as it was
    sums = phalanx.evaluate_dataset(model, data, world=world(0, 1), sums=lambda m, b: {"tokens": b[1].numel()})
    assert sums == {"tokens": 60.0, "count": 10.0}


def test_evaluate_dataset_refuses_an_empty_set_or_stream_in_one_line():
    # Before 2026-12-05 an empty Dataset failed inside the empty-shard collate with torch's
    # "IndexError: index 0 is out of bounds for dimension 0 with size 0", and an empty stream came
    # back as {"count": 0.0} without the sums' names (the script's r["loss"] then a KeyError).
    from torch.utils.data import IterableDataset

    class Nothing(IterableDataset):
        def __iter__(self):
            return iter(())

    empty = TensorDataset(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))
    for data, what in ((empty, "a dataset of 0 examples"), (Nothing(), "a stream that yielded no items")):
        with pytest.raises(ValueError, match=rf"^evaluate_dataset got {what}: there is nothing to evaluate; pass the "
                                             r"held-out set itself"):
            phalanx.evaluate_dataset(nn.Linear(3, 2), data, world=world(0, 1))


def test_evaluate_dataset_follows_a_float64_models_dtype():
    # Uncast, a float32 batch fails inside evaluate_dataset with "RNN input dtype (torch.float32) does not
    # match weight dtype (torch.float64)"; it is cast as the internal evaluate casts its images.
    torch.manual_seed(0)

    class Tagger(nn.Module):  # a GRU over the sequence, then logits from its last state
        def __init__(self):
            super().__init__()
            self.gru, self.head = nn.GRU(3, 8, batch_first=True), nn.Linear(8, 4)

        def forward(self, x):
            return self.head(self.gru(x)[0][:, -1])

    model = phalanx.prepare(Tagger(), world=world(0, 1), dtype="float64")
    X, y = torch.randn(21, 5, 3), torch.randint(0, 4, (21,))  # float32 data, int64 labels
    sums = phalanx.evaluate_dataset(model, TensorDataset(X, y), world=world(0, 1), batch_size=8)
    with torch.no_grad():
        logits = model.module(X.double())
    assert sums["count"] == 21 and sums["correct"] == (logits.argmax(1) == y).sum().item()
    assert sums["loss"] == F.cross_entropy(logits, y, reduction="sum").item()  # the float64 result, exactly


def test_init_outside_any_launcher_is_a_world_of_one(monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(script, "_current", None)
    first = phalanx.init(device="cpu")
    assert (first.rank, first.world_size, first.backend, first.device.type) == (0, 1, "none", "cpu")
    assert phalanx.init() is first
    monkeypatch.setattr(script, "_current", None)
    with pytest.raises(phalanx.UsageError, match="not understood"):
        phalanx.init(device="tpu")


class _Stream(torch.utils.data.IterableDataset):
    """n items (x, label) in a fixed order whose labels `set_epoch` changes; with loader workers,
    each yields every `num_workers`-th item, as a stream split by get_worker_info does."""

    def __init__(self, n: int) -> None:
        self.n, self.epochs = n, []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        shift = self.epochs[-1] if self.epochs else 0
        for i in range(start, self.n, step):
            yield torch.full((3,), float(i), dtype=torch.float64), (i + shift) % 5


@pytest.mark.parametrize("k", [2, 3])
def test_sharded_loader_over_a_stream_splits_one_devices_batches(k, workers=0):  # with workers: tests/distributed
    n, batch = 41, 20  # last global batch: 1 item, so k - 1 ranks get an empty shard
    reference = _Stream(n)
    reference.set_epoch(4)
    one = list(torch.utils.data.DataLoader(reference, batch_size=None, num_workers=workers))  # one device's items
    streams = [_Stream(n) for _ in range(k)]
    ranks = [list(phalanx.ShardedLoader(streams[r], world=world(r, k), global_batch_size=batch,
                                        num_workers=workers).epoch(4)) for r in range(k)]
    assert all(s.epochs == [4] for s in streams)  # set_epoch, as DistributedSampler's
    assert [[g for _, g in steps] for steps in ranks] == [[20, 20, 1]] * k
    for step in range(3):
        X = torch.cat([ranks[r][step][0][0] for r in range(k)])
        y = torch.cat([ranks[r][step][0][1] for r in range(k)])
        want = one[step * batch:(step + 1) * batch]
        assert torch.equal(X, torch.stack([x for x, _ in want])) and y.tolist() == [label for _, label in want]
    assert [tuple(ranks[r][-1][0][0].shape) for r in range(k)] == [(1, 3)] + [(0, 3)] * (k - 1)
    with pytest.raises(TypeError, match="over an IterableDataset has no length: the stream decides"):
        len(phalanx.ShardedLoader(_Stream(n), world=world(0, k), global_batch_size=batch))
    with pytest.raises(ValueError, match="reads an IterableDataset in its own order, .*drop shuffle=True"):
        phalanx.ShardedLoader(_Stream(n), world=world(0, k), global_batch_size=batch, shuffle=True)


def test_evaluate_dataset_over_a_stream_counts_every_item_once():
    torch.manual_seed(0)
    model = nn.Linear(3, 5).double()
    stream, items = _Stream(23), TensorDataset(*[torch.stack(t) if i == 0 else torch.tensor(t)
                                                 for i, t in enumerate(zip(*_Stream(23)))])
    want = phalanx.evaluate_dataset(model, items, world=world(0, 1), batch_size=4)
    got = phalanx.evaluate_dataset(model, stream, world=world(0, 1), batch_size=4)
    assert got == want and got["count"] == 23


@pytest.mark.parametrize("k", [2, 3])
def test_sharded_loader_with_a_weighted_sampler_draws_one_order_on_every_rank(k):
    n, batch = 40, 16
    data = TensorDataset(torch.arange(n, dtype=torch.float64).unsqueeze(1), torch.arange(n))
    weights = torch.linspace(0.1, 1.0, n, dtype=torch.float64)

    def loader(rank: int, world_size: int) -> phalanx.ShardedLoader:
        sampler = torch.utils.data.WeightedRandomSampler(weights, num_samples=35, replacement=True)  # no generator
        return phalanx.ShardedLoader(data, world=world(rank, world_size), global_batch_size=batch, seed=3,
                                     sampler=sampler)

    one = list(loader(0, 1).epoch(1))
    ranks = []
    for r in range(k):
        torch.manual_seed(100 + r)  # each rank's global RNG elsewhere: the sampler's draws must not depend on it
        ranks.append(list(loader(r, k).epoch(1)))
    assert len(loader(0, k)) == 3 and [g for _, g in one] == [16, 16, 3]
    for step, ((_, y), global_size) in enumerate(one):
        assert all(ranks[r][step][1] == global_size for r in range(k))
        assert torch.equal(torch.cat([ranks[r][step][0][1] for r in range(k)]), y)
    drawn = torch.cat([y for (_, y), _ in one])
    assert drawn.float().mean() > (n - 1) / 2  # weighted toward the heavy end, with repeats
    assert not torch.equal(drawn, torch.cat([y for (_, y), _ in loader(0, 1).epoch(2)]))  # a new draw each epoch


def test_sharded_loader_refuses_samplers_it_cannot_honour():
    data = TensorDataset(torch.zeros(8, 1), torch.zeros(8))
    with pytest.raises(ValueError, match="DistributedSampler shards by itself, padding or dropping examples; drop the "
                                         "sampler"):
        phalanx.ShardedLoader(data, world=world(0, 2), global_batch_size=4,
                              sampler=torch.utils.data.DistributedSampler(data, num_replicas=2, rank=0))
    with pytest.raises(ValueError, match="the order is the sampler's, which shuffle=True would override; drop "
                                         "shuffle=True"):
        phalanx.ShardedLoader(data, world=world(0, 2), global_batch_size=4, shuffle=True,
                              sampler=torch.utils.data.SequentialSampler(data))
    with pytest.raises(ValueError, match="a stream orders itself; drop the sampler"):
        phalanx.ShardedLoader(_Stream(8), world=world(0, 2), global_batch_size=4,
                              sampler=torch.utils.data.SequentialSampler(data))

    class Liar(torch.utils.data.SequentialSampler):
        def __len__(self) -> int:
            return 9

    with pytest.raises(ValueError, match="the sampler gave 8 indices in epoch 0, but its len\\(\\) is 9"):
        list(phalanx.ShardedLoader(data, world=world(0, 2), global_batch_size=4, sampler=Liar(data)).epoch(0))


class _Example(typing.NamedTuple):
    text: str
    ids: torch.Tensor


class _Texts(torch.utils.data.Dataset):
    """Examples as a text field, its ids and a label: what a tokenizing pipeline's dataset returns."""

    def __len__(self) -> int:
        return 5

    def __getitem__(self, i: int) -> dict:
        return {"text": f"example {i}", "label": i, "pair": (f"a{i}", f"b{i}"),
                "named": _Example(text=f"n{i}", ids=torch.tensor([i, i]))}


def test_an_empty_shard_of_a_text_batch_holds_no_phantom_example():
    # 5 examples in batches of 4 over 3 ranks: the last batch has 1 example, so ranks 1 and 2 get none
    for rank in (1, 2):
        (*_, (last, global_size)) = phalanx.ShardedLoader(_Texts(), world=world(rank, 3), global_batch_size=4).epoch(0)
        assert global_size == 1
        assert last["text"] == [] and last["pair"] == [(), ()] and last["label"].shape == (0,)
        assert isinstance(last["named"], _Example) and last["named"].text == () and last["named"].ids.shape == (0, 2)
    (*_, (last, _)) = phalanx.ShardedLoader(_Texts(), world=world(0, 3), global_batch_size=4).epoch(0)
    assert len(last["text"]) == 1 and last["named"].ids.shape == (1, 2)  # the rank that holds it


@dataclasses.dataclass
class _Batch:
    ids: torch.Tensor
    texts: list


class _Encoding(collections.UserDict):
    """A mapping that is no dict, as Hugging Face's BatchEncoding (what DataCollatorWithPadding returns)."""


def test_empty_batches_of_other_collated_structures():
    from phalanx.data.empty_batch import empty_batch_like

    cut = empty_batch_like(_Batch(ids=torch.ones(1, 3), texts=["one"]))
    assert isinstance(cut, _Batch) and cut.ids.shape == (0, 3) and cut.texts == []
    cut = empty_batch_like(_Encoding({"input_ids": torch.ones(1, 7, dtype=torch.int64), "num_items": 1}))
    assert isinstance(cut, _Encoding) and cut["input_ids"].shape == (0, 7) and cut["num_items"] == 1
    assert empty_batch_like(numpy.ones((1, 4))).shape == (0, 4)
    assert empty_batch_like([object(), object()]) == []  # a batch of objects (images, records): none
    with pytest.raises(TypeError, match="holds a value of type object, which phalanx cannot cut to no examples; have "
                                        "collate_fn return tensors"):
        empty_batch_like({"x": torch.ones(1), "record": object()})


def test_evaluate_dataset_moves_named_tuple_and_dataclass_batches_as_it_moves_tuples():
    # Before 2026-12-03 a dataset of named tuples (default_collate keeps them) failed inside
    # evaluate_dataset with "Pair.__new__() missing 1 required positional argument", and a
    # dataclass batch reached a float64 model in float32 (InputDtypeMismatch), uncast.
    Pair = collections.namedtuple("Pair", "x y")

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        y: torch.Tensor

    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(9, 3, generator=g), torch.randint(0, 2, (9,), generator=g)
    pairs = [Pair(X[i], y[i]) for i in range(9)]
    model = phalanx.prepare(nn.Linear(3, 2), world=world(0, 1), dtype="float64")
    with torch.no_grad():
        expected = F.cross_entropy(model.module(X.double()), y, reduction="sum").item()
    loss = lambda m, b: {"loss": F.cross_entropy(m(b.x), b.y, reduction="sum")}  # noqa: E731
    as_tuples = phalanx.evaluate_dataset(model, pairs, world=world(0, 1), batch_size=4, sums=loss)
    as_dataclass = phalanx.evaluate_dataset(model, pairs, world=world(0, 1), batch_size=4, sums=loss,
                                            collate_fn=lambda items: Batch(torch.stack([p.x for p in items]),
                                                                           torch.stack([p.y for p in items])))
    assert as_tuples == as_dataclass and as_tuples["count"] == 9
    assert as_tuples["loss"] == pytest.approx(expected, rel=1e-12)  # float64: the batches' sums, added
