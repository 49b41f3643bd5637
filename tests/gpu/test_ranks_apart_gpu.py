"""On a GPU, the fingerprint `phalanx run` compares across ranks (runtime/apart.py) is the CPU's, read
in one copy, and a step recorded into a CUDA graph is left alone (nothing may be read while capturing).
Skipped where no GPU is present (tests/unit/test_ranks_apart.py checks the rest on the CPU)."""

import pytest
import torch
from torch import nn

from phalanx.runtime import apart
from phalanx.runtime.apart import fingerprint, watch_ranks_apart

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_a_gpu_tensors_fingerprint_is_its_cpu_copys():
    tensors = [torch.randn(7, 5, dtype=dtype) for dtype in (torch.float32, torch.bfloat16, torch.float64)]
    assert fingerprint([t.cuda() for t in tensors]) == fingerprint(tensors)


def test_a_captured_optimizer_step_is_not_watched(monkeypatch):
    monkeypatch.setattr(apart, "_group_open", lambda: True)
    watch = watch_ranks_apart(rank=0)
    optimizer = torch.optim.SGD(nn.Linear(8, 8, device="cuda").parameters(), lr=0.1)
    x, graph = torch.ones(8, device="cuda"), torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):  # the hooks as a captured step calls them: a read would end the capture
            y = x * 2
            watch.before_step(optimizer, (), {})
            watch.after_step(optimizer, (), {})
    finally:
        watch.close()
    graph.replay()
    assert len(watch.firsts) == 0 and torch.equal(y, x * 2)
