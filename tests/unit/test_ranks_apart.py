"""`phalanx run`'s line for ranks that train apart (runtime/apart.py): the exact fingerprint, the
line's verdicts, and the hooks on a store standing in for the launcher's (one process: a peer's key
is written by hand). The run end to end: tests/distributed/test_ranks_apart.py."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from phalanx.errors import PhalanxWarning
from phalanx.runtime import apart
from phalanx.runtime.apart import _key, apart_line, fingerprint, watch_ranks_apart


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64])
def test_the_fingerprint_tells_a_one_ulp_difference_and_nothing_else(dtype):
    x = torch.randn(5, 7, dtype=dtype)
    assert fingerprint([x]) == fingerprint([x.clone()])
    nudged = x.clone()
    flat = torch.view_as_real(nudged).reshape(-1) if dtype.is_complex else nudged.reshape(-1)
    flat[3] = torch.nextafter(flat[3], torch.tensor(float("inf"), dtype=flat.dtype))
    assert fingerprint([nudged]) != fingerprint([x])
    assert fingerprint([x])[0][:2] == [5, 7]


def test_the_fingerprint_reads_memory_order_alike_and_takes_any_tensor():
    x = torch.randn(2, 3, 4, 5)
    assert fingerprint([x.contiguous(memory_format=torch.channels_last)]) == fingerprint([x])
    assert fingerprint([torch.zeros(0), torch.arange(4), torch.tensor([True, False])]) == [[0, 0], [4, 6], [2, 1]]
    assert fingerprint([]) == []


def _prints(*afters, befores=None, grads=None):
    """Every rank's fingerprints; by default each rank read gradients of its own (none summed)."""
    befores = befores or [[[2, 10]]] * len(afters)
    grads = grads or [[[2, rank]] for rank in range(len(afters))]
    return [{"before": b, "grads": g, "after": a} for b, g, a in zip(befores, grads, afters)]


def test_the_line_says_nothing_where_the_ranks_agree_or_hold_other_shapes():
    assert apart_line(_prints([[2, 5]], [[2, 5]], [[2, 5]])) is None
    assert apart_line(_prints([[2, 5]], [[3, 6]])) is None  # a pipeline's stages, a shard: not one model
    assert apart_line(_prints([[2, 5]], [[2, 5], [1, 1]])) is None


def test_the_line_names_the_first_rank_apart_and_whether_they_started_equal():
    line = apart_line(_prints([[2, 5], [3, 1]], [[2, 5], [3, 1]], [[2, 6], [3, 1]], [[2, 7], [3, 2]]))
    assert line.startswith("after this first optimizer step the 4 ranks hold different models "
                           "(rank 2's parameters differ from rank 0's in 1 of 2 tensors and 1 more rank): they were "
                           "equal before it and apart after it: no gradient was summed across the ranks")
    assert "model = phalanx.prepare(model), or DistributedDataParallel(model)" in line
    assert "\n" not in line
    started_apart = apart_line(_prints([[2, 5]], [[2, 6]], befores=[[[2, 1]], [[2, 2]]]))
    assert "they were apart before it too (each rank its own initialisation" in started_apart
    assert "and no gradient was summed" in started_apart
    summed_apart = apart_line(_prints([[2, 5]], [[2, 6]], befores=[[[2, 1]], [[2, 2]]], grads=[[[2, 3]]] * 2))
    assert "nothing broadcast rank 0's), so each rank trains" in summed_apart and "no gradient" not in summed_apart


def test_ranks_whose_gradients_were_alike_but_stepped_apart_are_told_the_step_read_something_of_their_own():
    """Summed gradients (DDP, a phalanx replica) and still apart: an lr set from the rank, a scheduler stepped on
    rank 0 only. Before, the line said no gradient was summed, and to wrap a model that was wrapped."""
    line = apart_line(_prints([[2, 5]], [[2, 6]], grads=[[[2, 3]]] * 2))
    assert "they were equal before it and so were their gradients, so the step itself read something that " \
           "differs between the ranks: an optimizer setting changed on some ranks only" in line
    assert "no gradient was summed" not in line and "phalanx.prepare(model)" not in line and "\n" not in line


class _FakeGroup:
    """A group of two whose store is a HashStore, rank 1's key written by the test."""

    def __init__(self, monkeypatch):
        self.store = dist.HashStore()
        monkeypatch.setattr(apart, "_group_open", lambda: True)
        monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: self.store)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)

    def peer_steps(self, ordinal, model, *, nudge: bool) -> None:
        after = fingerprint(list(model.parameters()))
        if nudge:
            after[0][-1] += 1
        mine = json.loads(self.store.get(_key(ordinal, 0)))
        self.store.set(_key(ordinal, 1), json.dumps({"before": mine["before"], "grads": mine["grads"], "after": after}))


def _step(optimizer, model):
    optimizer.zero_grad()
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()


@pytest.mark.parametrize("nudge", [False, True])
def test_rank_0_compares_at_a_later_step_and_warns_once_at_the_scripts_step(monkeypatch, nudge):
    group = _FakeGroup(monkeypatch)
    watch = watch_ranks_apart(rank=0)
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            _step(optimizer, model)
            assert said == [] and len(watch.pending) == 1  # the peer has not stepped yet: nothing waited for
            group.peer_steps(0, model, nudge=nudge)
            for _ in range(3):
                _step(optimizer, model)
    finally:
        watch.close()
    assert watch.pending == [] and len(said) == (1 if nudge else 0)
    if nudge:  # at the line that called optimizer.step() the first time: _step's, in this file
        assert said[0].category is PhalanxWarning and said[0].filename == __file__
        assert said[0].lineno == _step.__code__.co_firstlineno + 3
        assert "rank 1's parameters differ from rank 0's in 1 of 2 tensors" in str(said[0].message)


def test_at_the_end_rank_0_waits_a_bounded_moment_for_a_peer_that_never_steps(monkeypatch):
    _FakeGroup(monkeypatch)
    monkeypatch.setattr(apart, "END_WAIT_S", 0.05)
    watch = watch_ranks_apart(rank=0)
    model = nn.Linear(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(torch.optim.SGD(model.parameters(), lr=0.1), model)
        watch.finish()
    watch.close()
    assert watch.pending == []


class _Wrapper(torch.optim.Optimizer):
    """A wrapper whose step runs an inner optimizer over a part (ZeRO's, local SGD's)."""

    def __init__(self, params, inner):
        super().__init__(params, {})
        self.inner = inner

    def step(self, closure=None):
        self.inner.step()


def test_only_whole_plain_parameters_of_the_outermost_step_are_fingerprinted(monkeypatch):
    group = _FakeGroup(monkeypatch)
    watch = watch_ranks_apart(rank=1)
    model = nn.Linear(3, 2)
    inner = torch.optim.SGD([model.weight], lr=0.1)
    outer = _Wrapper(model.parameters(), inner)
    piece = torch.zeros(8)[:4].requires_grad_()  # a shard's piece: a view of a flat buffer (phalanx's, ZeRO's)
    pieces = torch.optim.SGD([piece], lr=0.1)
    try:
        _step(outer, model)
        assert list(watch.firsts.keys()) == [outer]
        assert group.store.check([_key(0, 1)]) and not group.store.check([_key(1, 1)])
        piece.grad = torch.ones(4)
        pieces.step()
        assert watch.firsts[pieces].before is None and not group.store.check([_key(1, 1)])
    finally:
        watch.close()
    _step(torch.optim.SGD(model.parameters(), lr=0.1), model)  # closed: no hook left
    assert len(watch.firsts) == 2


@pytest.mark.parametrize("rank, workers, said", [(0, 2, 1), (1, 2, 0), (0, 1, 0)])
def test_a_step_before_the_script_joined_any_group_is_said_once_on_rank_0(monkeypatch, rank, workers, said):
    monkeypatch.setattr(apart, "_joined", lambda: False)
    watch = watch_ranks_apart(rank=rank, workers=workers)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                _step(optimizer, model)
    finally:
        watch.close()
    assert len(caught) == said
    if said:
        assert caught[0].filename == __file__ and "each of the 2 workers trains alone" in str(caught[0].message)


def test_a_script_that_never_joined_and_holds_a_torch_data_parallel_hears_what_it_does_not_do(monkeypatch):
    # The book's concise implementation, `net = nn.DataParallel(net)`, started on 2 workers (named as the
    # innermost frame holds it: the step's helper calls it `model`).
    monkeypatch.setattr(apart, "_joined", lambda: False)
    watch = watch_ranks_apart(rank=0, workers=2)
    net = nn.DataParallel(nn.Linear(3, 2))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _step(torch.optim.SGD(net.parameters(), lr=0.1), net)
    finally:
        watch.close()
    assert [str(w.message) for w in caught] == [apart.alone_line(2) + (
        "; `model` is a torch.nn.DataParallel, which splits each batch over the GPUs of one process and sums nothing "
        "across processes (the book's concise implementation): put phalanx.prepare(model) in its place")]


def test_the_samplers_in_the_scripts_frames_are_found_by_name_with_their_datasets():
    from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

    data = TensorDataset(torch.arange(10.0))
    part = Subset(data, [0, 2, 4, 6, 8])
    train_sampler = DistributedSampler(part, num_replicas=2, rank=0)
    val_loader = DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    plain_loader = DataLoader(data, shuffle=True)  # no DistributedSampler: nothing to compare

    def inner():
        return apart.sampler_datasets(__import__("sys")._getframe())

    found = inner()  # from a frame below this one: the caller's locals are searched too
    assert found["train_sampler"] == [5, apart.subset_checksum(part)] and found["val_loader"] == [10, -1]
    assert "plain_loader" not in found and "part" not in found
    assert apart.subset_checksum(Subset(data, [0, 2, 4, 6, 9])) != found["train_sampler"][1]
    del train_sampler, val_loader, plain_loader


def test_the_sampler_line_names_the_sampler_and_the_kind_of_difference():
    def prints(*samplers):
        return [{"before": [], "grads": [], "after": [], "samplers": s} for s in samplers]

    assert apart.sampler_line(prints({"loader": [48, 7]}, {"loader": [48, 7]})) is None
    assert apart.sampler_line(prints({"loader": [48, 7]}, {"other": [48, 8]})) is None  # not held by rank 0
    assert apart.sampler_line(prints({}, {})) is None and apart.sampler_line([{}, {}]) is None  # older records
    split = apart.sampler_line(prints({"loader": [48, 7]}, {"loader": [48, 7]}, {"loader": [48, 9]}))
    assert split.startswith("the DistributedSampler of `loader` shards a different dataset on each rank (rank 2's "
                            "Subset holds other indices than rank 0's): it shards one dataset by rank itself")
    assert "generator=torch.Generator().manual_seed(0)" in split and "\n" not in split
    cut = apart.sampler_line(prints({"loader": [48, -1]}, {"loader": [47, -1]}))
    assert cut.startswith("the DistributedSampler of `loader` shards a different dataset on each rank (rank 1's has 47 "
                          "examples, rank 0's 48)") and cut.endswith("hand the sampler the whole dataset on every rank")
