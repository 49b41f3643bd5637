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
