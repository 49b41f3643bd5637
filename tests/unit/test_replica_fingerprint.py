"""The replica check's fingerprint (guards/replicas.py), without processes: bits summed as wrapping
integers (exact: a one-ulp change shows, any summing order agrees), the optimizer's settings and
state in words of their own, a peer whose row is the same passes, and the line's words for ranks
that differ in parameters and lr."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from phalanx.data_parallel.guards.replicas import (ReplicaCheck, _message, bit_sum, check_replicas_agree, fingerprint,
                                                   settings)
from phalanx.runtime.world import World

WORLD2 = World(rank=0, world_size=2, local_rank=0, local_world_size=2, device=torch.device("cpu"), backend="none",
               timeout_s=10.0)


def _model_and_optimizer(lr: float = 0.1):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model(torch.ones(3, 5)).sum().backward()
    optimizer.step()  # momentum buffers exist
    return model, optimizer


def test_bit_sum_is_the_wrapping_sum_of_the_bit_patterns_and_sees_one_ulp():
    values = torch.randn(10_001) * 1e3
    expected = int(values.numpy().view(np.int32).astype(np.int64).sum())
    assert int(bit_sum(values)) == (expected + 2**31) % 2**32 - 2**31  # int32 wraps
    assert int(bit_sum(values.flip(0))) == int(bit_sum(values))  # order-free
    nudged = values.clone()
    nudged[1234] = torch.nextafter(nudged[1234], torch.tensor(float("inf")))
    assert int(bit_sum(nudged)) != int(bit_sum(values))
    assert int(bit_sum(values.double())) != 0 and int(bit_sum(torch.tensor([True, False]))) == 1


def test_fingerprint_parts_parameters_settings_and_state():
    model, optimizer = _model_and_optimizer()
    same = fingerprint(list(model.parameters()), [optimizer], whole_state=True, device=torch.device("cpu"))
    twin, twin_optimizer = _model_and_optimizer()
    assert torch.equal(same, fingerprint(list(twin.parameters()), [twin_optimizer], whole_state=True,
                                         device=torch.device("cpu")))
    twin_optimizer.param_groups[0]["lr"] = 0.05  # a scheduler stepped on this rank only
    lr_only = fingerprint(list(twin.parameters()), [twin_optimizer], whole_state=True, device=torch.device("cpu"))
    assert torch.equal(lr_only[:2], same[:2]) and torch.equal(lr_only[4:], same[4:])
    assert not torch.equal(lr_only[2:4], same[2:4])
    twin_optimizer.param_groups[0]["lr"] = 0.1
    with torch.no_grad():
        twin_optimizer.state[twin[0].weight]["momentum_buffer"][0, 0] += 1.0
    state_only = fingerprint(list(twin.parameters()), [twin_optimizer], whole_state=True, device=torch.device("cpu"))
    assert torch.equal(state_only[:4], same[:4]) and not torch.equal(state_only[4:], same[4:])
    shares = fingerprint(list(twin.parameters()), [twin_optimizer], whole_state=False, device=torch.device("cpu"))
    assert shares[4:].tolist() == [0.0, 0.0]  # a sharded optimizer's state is each rank's own share
    assert ("lr", 0.1) in [(key, value) for _, _, key, value in settings([optimizer])]


def test_a_peer_with_the_same_row_passes_without_a_second_exchange():
    model, optimizer = _model_and_optimizer()

    def peer_alike(flat: torch.Tensor) -> None:
        rows = flat.view(2, -1)
        rows[1] = rows[0]

    check_replicas_agree(world=WORLD2, parameters=list(model.named_parameters()), optimizers=[optimizer],
                         whole_state=True, found="found by a test", allreduce=peer_alike)


def test_the_line_names_the_ranks_how_far_and_both_causes():
    settings_of = [[(0, 0, "lr", 0.1)], [(0, 0, "lr", 0.05)], [(0, 0, "lr", 0.05)]]
    details = [{"far": 0.0, "first": None, "count": 0, "settings": settings_of[0]},
               {"far": 0.25, "first": "0.weight", "count": 3, "settings": settings_of[1]},
               {"far": 0.5, "first": "1.bias", "count": 1, "settings": settings_of[2]}]
    line = _message(details, apart=[1, 2], reference=0, differs=[True, True, False], found="found by close()",
                    count=4)
    assert line.startswith("replicas diverged (found by close()): ranks 1 and 2's parameters differ from rank 0's "
                           "by up to 0.5 (in 1 of 4 tensors, 1.bias first), and their optimizer's lr is 0.05 where "
                           "rank 0's is 0.1 (param group 0); an lr scheduler stepped ")
    assert "; or a checkpoint loaded " in line  # a setting apart explains parameters apart: named first


def test_an_optimizer_given_the_replica_by_add_param_group_later_is_compared_from_then_on():
    # Its verdict ("does it step this replica?") was taken once, at its first step over a head of
    # its own: the replica's parameters added after (a backbone unfrozen) were never compared.
    model = nn.Linear(3, 2)
    head = nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([head], lr=0.1)
    check = ReplicaCheck(every=1, world=WORLD2, module=model, sharding=None, allreduce=lambda flat, tag: None,
                         owner=model)
    try:
        head.grad = torch.ones_like(head)
        optimizer.step()
        assert check._stepped == {}  # not this replica's
        optimizer.add_param_group({"params": list(model.parameters())})
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        assert list(check._stepped.values()) == [optimizer]
    finally:
        check.close()
