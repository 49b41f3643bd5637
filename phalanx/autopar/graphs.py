"""Experiment 5's programs: the chapter's two-layer MLP over two devices and the host, and a
diamond beside a long chain, written as sequential programs of steps that name what they read
and write (taskgraph_program.py turns them into task graphs).

The MLP (D2L 13.2's figure, "a two-layer MLP on a CPU and two GPUs"): the global batch is split
in halves; device d holds a replica of W1 (in x hidden) and W2 (hidden x out) and computes its
half's forward (relu(X W1) W2), mean-squared-error gradient and backward by hand (no autograd:
every operation is a step the scheduler can see). Each gradient goes to the host as soon as it
exists (W2's before W1's is computed), the host sums the two devices' gradients, each device
copies the sum back and updates its replica with SGD. Steps are unrolled, so step t+1's forward
waits only for the update of the weight it reads. A "device" is a tensor placement: CPU tensors
on a CPU lane, or a CUDA device (with pinned host buffers and non-blocking copies).

The diamond and chain: a source feeds two branches that join (a diamond), beside a chain of
`chain_length` in-place steps that alternate lanes, and a sink reads both ends. It exists to show
that a scheduler respects every dependency, so its lanes cross on every edge of the chain.
"""

from __future__ import annotations

from typing import Callable

import torch

from phalanx.autopar.taskgraph_program import Step

HOST = "host"


class MLPProgram:
    """Buffers (by name) and the sequential program of `steps` SGD steps on two devices."""

    def __init__(self, *, batch_size: int, in_features: int, hidden: int, out_features: int, steps: int,
                 lr: float = 0.05, dtype: torch.dtype = torch.float32,
                 devices: tuple[torch.device, torch.device] = (torch.device("cpu"), torch.device("cpu")),
                 seed: int = 0) -> None:
        if batch_size < 2 or batch_size % 2:
            raise ValueError(f"batch_size must be even and at least 2 (two halves), got {batch_size}")
        self.steps, self.lr, self.devices = steps, lr, devices
        self.scale = 2.0 / (batch_size * out_features)  # d/dO of the mean squared error over the batch
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(batch_size, in_features, generator=g, dtype=dtype)
        y = torch.randn(batch_size, out_features, generator=g, dtype=dtype)
        self.initial_w1 = torch.randn(in_features, hidden, generator=g, dtype=dtype) / in_features ** 0.5
        self.initial_w2 = torch.randn(hidden, out_features, generator=g, dtype=dtype) / hidden ** 0.5
        cuda = any(d.type == "cuda" for d in devices)
        self.b: dict[str, torch.Tensor] = {}
        half = batch_size // 2
        for d, device in enumerate(devices):
            def put(name: str, value: torch.Tensor) -> None:
                self.b[f"{name}{d}"] = value.to(device).contiguous()
            put("X", x[d * half:(d + 1) * half])
            put("Y", y[d * half:(d + 1) * half])
            for name, shape in (("W1", (in_features, hidden)), ("W2", (hidden, out_features)),
                                ("Z", (half, hidden)), ("H", (half, hidden)), ("O", (half, out_features)),
                                ("dH", (half, hidden)), ("gW1", (in_features, hidden)), ("gW2", (hidden, out_features)),
                                ("r1", (in_features, hidden)), ("r2", (hidden, out_features))):
                put(name, torch.zeros(shape, dtype=dtype))
            for name, shape in (("h1_", (in_features, hidden)), ("h2_", (hidden, out_features))):
                self.b[f"{name}{d}"] = torch.zeros(shape, dtype=dtype, pin_memory=cuda)
        self.b["s1"] = torch.zeros(in_features, hidden, dtype=dtype, pin_memory=cuda)
        self.b["s2"] = torch.zeros(hidden, out_features, dtype=dtype, pin_memory=cuda)
        self.non_blocking = cuda  # pinned host buffers: copies may overlap compute
        self.reset()

    def reset(self) -> None:
        for d in range(2):
            self.b[f"W1{d}"].copy_(self.initial_w1)
            self.b[f"W2{d}"].copy_(self.initial_w2)

    def parameters(self) -> dict[str, torch.Tensor]:
        """Both replicas' weights, on the CPU (replicas must agree with each other too)."""
        return {name: self.b[name].detach().cpu().clone() for name in ("W10", "W11", "W20", "W21")}

    def program(self) -> list[Step]:
        b, nb = self.b, self.non_blocking
        steps: list[Step] = []

        def step(name: str, lane: str, reads: tuple[str, ...], writes: tuple[str, ...], fn: Callable[[], None]):
            steps.append(Step(name=name, lane=lane, reads=reads, writes=writes, fn=fn))

        for t in range(self.steps):
            for d in range(2):
                lane = f"device{d}"
                X, Y, W1, W2, Z, H, O, dH, gW1, gW2 = (f"{n}{d}" for n in ("X", "Y", "W1", "W2", "Z", "H", "O", "dH",
                                                                           "gW1", "gW2"))
                step(f"fwd1 d{d} s{t}", lane, (X, W1), (Z, H), lambda X=X, W1=W1, Z=Z, H=H: (
                    torch.mm(b[X], b[W1], out=b[Z]), torch.clamp(b[Z], min=0, out=b[H])))
                step(f"fwd2 d{d} s{t}", lane, (H, W2, Y), (O,), lambda H=H, W2=W2, Y=Y, O=O: (
                    torch.mm(b[H], b[W2], out=b[O]), b[O].sub_(b[Y]).mul_(self.scale)))
                step(f"bwd2 d{d} s{t}", lane, (H, O, W2), (gW2, dH), lambda H=H, O=O, W2=W2, gW2=gW2, dH=dH: (
                    torch.mm(b[H].T, b[O], out=b[gW2]), torch.mm(b[O], b[W2].T, out=b[dH])))
                step(f"send2 d{d} s{t}", lane, (gW2,), (f"h2_{d}",), lambda gW2=gW2, d=d: b[f"h2_{d}"].copy_(
                    b[gW2], non_blocking=nb))
                step(f"bwd1 d{d} s{t}", lane, (dH, Z, X), (dH, gW1), lambda dH=dH, Z=Z, X=X, gW1=gW1: (
                    b[dH].mul_(b[Z] > 0), torch.mm(b[X].T, b[dH], out=b[gW1])))
                step(f"send1 d{d} s{t}", lane, (gW1,), (f"h1_{d}",), lambda gW1=gW1, d=d: b[f"h1_{d}"].copy_(
                    b[gW1], non_blocking=nb))
            step(f"sum2 s{t}", HOST, ("h2_0", "h2_1"), ("s2",), lambda: torch.add(b["h2_0"], b["h2_1"], out=b["s2"]))
            step(f"sum1 s{t}", HOST, ("h1_0", "h1_1"), ("s1",), lambda: torch.add(b["h1_0"], b["h1_1"], out=b["s1"]))
            for d in range(2):
                lane = f"device{d}"
                for k in ("2", "1"):
                    r, w = f"r{k}{d}", f"W{k}{d}"
                    step(f"recv{k} d{d} s{t}", lane, (f"s{k}",), (r,), lambda r=r, k=k: b[r].copy_(
                        b[f"s{k}"], non_blocking=nb))
                    step(f"upd{k} d{d} s{t}", lane, (r, w), (w,), lambda r=r, w=w: b[w].sub_(b[r], alpha=self.lr))
        return steps


class DiamondChainProgram:
    """A diamond (a -> b, c -> d) beside a chain of in-place steps; `sink` reads both ends."""

    def __init__(self, *, size: int = 32, chain_length: int = 12, lanes: tuple[str, ...] = ("device0", "device1"),
                 dtype: torch.dtype = torch.float64, seed: int = 0) -> None:
        if chain_length < 2 or len(lanes) < 2:
            raise ValueError(f"need a chain of at least 2 steps on at least 2 lanes, got {chain_length} on {lanes}")
        g = torch.Generator().manual_seed(seed)
        self.m = torch.randn(size, size, generator=g, dtype=dtype) / size ** 0.5
        self.initial = torch.randn(size, size, generator=g, dtype=dtype)
        self.chain_length, self.lanes = chain_length, lanes
        self.b = {name: torch.zeros(size, size, dtype=dtype) for name in ("a", "b", "c", "d", "chain", "sink")}
        self.reset()

    def reset(self) -> None:
        for value in self.b.values():
            value.zero_()
        self.b["chain"].copy_(self.initial)

    def program(self) -> list[Step]:
        b, m = self.b, self.m
        lane0, lane1 = self.lanes[0], self.lanes[1]
        steps = [
            Step(name="a", lane=lane0, writes=("a",), fn=lambda: torch.mm(self.initial, m, out=b["a"])),
            Step(name="b", lane=lane0, reads=("a",), writes=("b",), fn=lambda: torch.mm(b["a"], m, out=b["b"])),
            Step(name="c", lane=lane1, reads=("a",), writes=("c",), fn=lambda: torch.tanh(b["a"], out=b["c"])),
            Step(name="d", lane=lane1, reads=("b", "c"), writes=("d",),
                 fn=lambda: torch.add(b["b"], b["c"], out=b["d"])),
        ]
        for i in range(self.chain_length):
            steps.append(Step(name=f"chain{i}", lane=self.lanes[i % len(self.lanes)], reads=("chain",),
                              writes=("chain",), fn=lambda i=i: b["chain"].copy_(torch.tanh(b["chain"] @ m + i))))
        steps.append(Step(name="sink", lane=lane0, reads=("d", "chain"), writes=("sink",),
                          fn=lambda: torch.add(b["d"], b["chain"], out=b["sink"])))
        return steps

    def result(self) -> torch.Tensor:
        return self.b["sink"].clone()
