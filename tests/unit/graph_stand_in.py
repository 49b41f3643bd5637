"""A CPU stand-in for a CUDA graph, so CapturedStep's bookkeeping is tested without a GPU.

`RecordedGraph` follows the contract `phalanx.train.graphs.GraphBackend` describes. `capture`
records the step and, as a real capture does, runs its Python once; unlike a real capture it
also computes (a real one only records kernels), which CapturedStep undoes by restoring the
state it snapshotted, so a test catches a CapturedStep that forgets to. `replay` calls the step
again and copies its outputs into the tensors the capture returned: a graph's outputs are static
tensors that every replay overwrites. `fail` makes the capture raise; `tamper(outputs)` runs
after each replay, to make a replay disagree with the eager step. A real replay runs no Python:
`quiet()` is entered around the stand-in's, so a replica keeps no count of it (its own
`capturing()`), as it keeps none of a real replay.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch


class RecordedGraph:
    def __init__(self, *, quiet=contextlib.nullcontext, fail: Exception | None = None,
                 tamper: Callable[[list], None] | None = None) -> None:
        self.quiet, self.fail, self.tamper = quiet, fail, tamper
        self.warm_steps = self.captures = self.replays = 0
        self.step = None
        self.outputs: list[torch.Tensor] = []

    @contextlib.contextmanager
    def warm(self) -> Iterator[None]:
        self.warm_steps += 1
        yield

    def capture(self, step, params):
        self.captures += 1
        if self.fail is not None:
            raise self.fail
        self.step = step
        self.outputs = [t.detach().clone() for t in step()]
        return self.outputs

    def replay(self) -> None:
        self.replays += 1
        with self.quiet():
            fresh = self.step()
        for static, value in zip(self.outputs, fresh):
            static.copy_(value)
        if self.tamper is not None:
            self.tamper(self.outputs)
