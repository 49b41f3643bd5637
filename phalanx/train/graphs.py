"""A training step replayed as one CUDA graph, never silently wrong: `CapturedStep`.

LeNet's step on a GPU is bound by the host: ~40 small kernels, each launched from Python.
Captured once as a CUDA graph (PyTorch's "whole network capture"), the step is one launch: the
plain loop captured this way ran 3.0x its eager speed on an H200. `CapturedStep` wraps the step
a loop already has - a function that runs one whole step (zero_grad, forward, loss, backward,
optimizer step) on static input tensors and returns its outputs - and runs it in three phases:

1. warm-up: the first `warmup_steps` calls run eagerly (on the capture stream, as PyTorch's
   recipe asks), so lazily created state - optimizer moments, cuBLAS workspaces - exists before
   capture; they are real steps, the training trajectory is eager's;
2. capture and check: the next call records the step, then runs it eagerly from the same state
   and replays the graph from that state too, and compares the two updates of every parameter,
   buffer and optimizer state and the outputs (a tolerance of `rtol` of the update's size:
   kernels whose sums run in another order differ in the last bits). A capture that raises, or
   a replay that disagrees, leaves the eager result in place and runs eagerly from then on,
   saying why in one line (`say`); torch's stream and random generator are put back as they
   were before the capture (`_after_aborted_capture`);
3. replay: every later call copies its inputs into the static buffers and replays.

Between replays anything eager may run (an epoch's smaller last batch): the graph reads and
writes only its static tensors and the model's own. A replay runs no Python, so what the step
keeps on the host - a replica's step count and its periodic NaN/Inf check - is `after_replay`'s
job, and `capturing` is entered around the runs of the step that are not steps of their own -
the capture, and the eager run the first replay is checked against (DataParallel.capturing).
The graph itself is a `GraphBackend`: `CudaGraph` on a GPU; on the CPU the tests hand in a
stand-in that records the step and calls it back, so everything here but the kernel is tested
without a GPU. Refusals (what cannot be captured) are graph_plan.py's;
`capture_step` is the front door for a user's own step (`phalanx.capture_step`).
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator, Protocol, Sequence

import torch
from torch import nn

from phalanx.data_parallel.data_parallel import DataParallel
from phalanx.data_parallel.sync_batchnorm import has_sync_batchnorm
from phalanx.train.graph_plan import StepFacts, refusal

WARMUP_STEPS = 3  # PyTorch's whole-network example warms up 3 iterations before capture
RTOL = {torch.float64: 1e-9}  # of an update's size; other dtypes DEFAULT_RTOL
DEFAULT_RTOL = 1e-4  # float32: reordered sums differ by ~1e-6 of an update; a wrong update by far more


class GraphBackend(Protocol):
    """What records and replays a step: on a GPU `CudaGraph`, in the CPU tests a stand-in."""

    def warm(self) -> ContextManager[None]: ...
    def capture(self, step: Callable[[], Sequence[torch.Tensor]],
                params: Sequence[nn.Parameter]) -> Sequence[torch.Tensor]: ...
    def replay(self) -> None: ...


class CudaGraph:
    """`torch.cuda.CUDAGraph` on one side stream, used for the warm-up and the capture alike."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self._params: list[nn.Parameter] = []
        self._grads: list[torch.Tensor | None] = []

    @contextlib.contextmanager
    def warm(self) -> Iterator[None]:
        # The side stream waits for what the main stream queued, and the main stream for the step,
        # so tensors handed across (the batch in, the outputs out) are never read before written.
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            yield
        current.wait_stream(self.stream)

    def capture(self, step, params):
        current = torch.cuda.current_stream(self.device)
        current.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(self.graph, stream=self.stream):
                outputs = step()
        except BaseException:
            self.graph = None
            _after_aborted_capture(self.device, current)
            raise
        # The gradients backward allocated in the graph's pool: replays write them there. An eager
        # step in between sets .grad to tensors of its own, so every replay points them back.
        self._params, self._grads = list(params), [p.grad for p in params]
        return outputs

    def replay(self) -> None:
        self.graph.replay()
        for param, grad in zip(self._params, self._grads):
            if param.grad is not grad:
                param.grad = grad


def _after_aborted_capture(device: torch.device, stream: torch.cuda.Stream) -> None:
    """Undo what a capture that raised leaves behind (torch 2.11): `torch.cuda.graph` ends the
    capture in its exit, and when that fails too it neither restores the current stream nor tells
    the device's default generator the capture is over - every later random draw on the device
    (dropout, `torch.randn`) then raises "Offset increment outside graph capture encountered
    unexpectedly". The generator gets a fresh copy of its own state (same seed and offset, not
    capturing): the eager steps that follow draw what they would have drawn with no capture tried."""
    torch.cuda.set_stream(stream)
    generator = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    generator.graphsafe_set_state(generator.clone_state())


class CapturedStep:
    """`step` (one whole eager step on `inputs`, returning its output tensors) run as a CUDA
    graph after `warmup_steps` eager calls; see the module docstring. Call it with the batch's
    tensors (copied into `inputs`); it returns the step's outputs, valid until the next call.
    `eager_reason` (with `backend` None): why it runs eagerly from the start."""

    def __init__(self, step: Callable[[], Sequence[torch.Tensor]], *, inputs: Sequence[torch.Tensor],
                 module: nn.Module, optimizer: torch.optim.Optimizer, backend: GraphBackend | None,
                 warmup_steps: int = WARMUP_STEPS, capturing: Callable[[], ContextManager] = contextlib.nullcontext,
                 after_replay: Callable[[], object] | None = None, say: Callable[[str], None] = print,
                 eager_reason: str | None = None) -> None:
        if (backend is None) == (eager_reason is None):
            raise ValueError("give CapturedStep a graph backend, or (for a step that runs eagerly) eager_reason")
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be at least 1 (state such as momentum must exist before capture), "
                             f"got {warmup_steps}")
        self.step, self.inputs, self.module, self.optimizer = step, tuple(inputs), module, optimizer
        self.backend, self.warmup_steps, self.capturing = backend, warmup_steps, capturing
        self.after_replay, self.say = after_replay, say
        self.warmed = 0
        self.replaying = False
        self.eager_reason = eager_reason  # why it runs eagerly for good, once it does
        self._outputs: Sequence[torch.Tensor] = ()
        self._settings: list[tuple] = []
        dtype = next((p.dtype for p in module.parameters()), torch.float32)
        self.rtol = RTOL.get(dtype, DEFAULT_RTOL)

    @property
    def state(self) -> str:
        return "eager" if self.eager_reason else "replaying" if self.replaying else "warming up"

    def __call__(self, *batch: torch.Tensor) -> Sequence[torch.Tensor]:
        for buffer, value in zip(self.inputs, batch, strict=True):
            buffer.copy_(value)
        if self.replaying:
            if _settings(self.optimizer) != self._settings:
                self._give_up("the optimizer's settings (lr, ...) changed after capture, and the graph holds them")
                return self.step()
            self.backend.replay()
            if self.after_replay is not None:
                self.after_replay()
            return self._outputs
        if self.eager_reason is not None:
            return self.step()
        if self.warmed < self.warmup_steps:
            self.warmed += 1
            with self.backend.warm():
                return self.step()
        return self._capture_and_check()

    def _capture_and_check(self) -> Sequence[torch.Tensor]:
        params = list(self.module.parameters())
        before = _snapshot(self.module, self.optimizer)
        try:
            with self.capturing():
                outputs = self.backend.capture(self.step, params)
        except Exception as exc:  # noqa: BLE001 - any failure of the capture means: run eagerly
            _restore(before, self.module, self.optimizer)
            first_line = (str(exc).strip().splitlines() or [""])[0][:160]
            self._give_up(f"capturing the step raised {type(exc).__name__}: {first_line}")
            return self.step()
        _restore(before, self.module, self.optimizer)  # a real capture ran nothing; a stand-in may have
        with self.capturing():  # one of the two runs of this step is kept: it is counted below, once
            eager_outputs = [t.detach().clone() for t in self.step()]
        eager = _snapshot(self.module, self.optimizer)
        _restore(before, self.module, self.optimizer)
        self.backend.replay()
        problem = _disagreement(before, eager, _snapshot(self.module, self.optimizer), eager_outputs, outputs,
                                rtol=self.rtol)
        if problem is not None:
            _restore(eager, self.module, self.optimizer)
            self._give_up(f"its first replay disagreed with the eager step ({problem})")
            outputs = eager_outputs
        else:
            self._outputs, self._settings, self.replaying = outputs, _settings(self.optimizer), True
        if self.after_replay is not None:
            self.after_replay()
        return outputs

    def _give_up(self, reason: str) -> None:
        self.replaying, self.eager_reason = False, reason
        self.say(f"CUDA graph step abandoned, running eagerly: {reason}")


def capture_step(step: Callable[[], Sequence[torch.Tensor]], *, inputs: Sequence[torch.Tensor], dp: DataParallel,
                 optimizer: torch.optim.Optimizer, warmup_steps: int = WARMUP_STEPS,
                 say: Callable[[str], None] = print) -> CapturedStep:
    """A user's own step as a CUDA graph: `step()` runs one whole step of replica `dp` (zero_grad,
    forward, `shard_loss(...).backward()`, `finish_gradient_sync()`, `optimizer.step()`) on the
    static tensors `inputs` and returns its outputs; call the result with each batch's tensors
    (their shapes: the inputs'). Captured on one CUDA device (graph_plan.py's refusals apply);
    anywhere else it runs the step eagerly, saying why in one line (`say`) when it is built."""
    world = dp.world
    why = refusal(StepFacts(device_type=world.device.type, num_devices=world.world_size,
                            sync_batchnorm=has_sync_batchnorm(dp.module), backend=world.backend,
                            exchanging=dp.exchanging))
    if why is not None:
        say(f"step not captured, running eagerly: {why}")
    return CapturedStep(step, inputs=inputs, module=dp.module, optimizer=optimizer,
                        backend=CudaGraph(world.device) if why is None else None, eager_reason=why,
                        warmup_steps=warmup_steps, capturing=dp.capturing, after_replay=dp.finish_gradient_sync,
                        say=say)


def _settings(optimizer: torch.optim.Optimizer) -> list[tuple]:
    """The numbers a captured optimizer step holds as constants (lr, momentum, ...), per group."""
    return [tuple((k, v) for k, v in group.items() if isinstance(v, (bool, int, float)))
            for group in optimizer.param_groups]


def _state_tensors(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    named = {f"parameter {n}": p for n, p in module.named_parameters()}
    named.update({f"buffer {n}": b for n, b in module.named_buffers()})
    names = {id(p): n for n, p in module.named_parameters()}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                named[f"optimizer {key} of {names.get(id(param), '?')}"] = value
    return named


def _snapshot(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in _state_tensors(module, optimizer).items()}


@torch.no_grad()
def _restore(snapshot: dict[str, torch.Tensor], module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Copy `snapshot` back into the same tensors (in place: a captured graph holds their addresses)."""
    for name, tensor in _state_tensors(module, optimizer).items():
        if name in snapshot:
            tensor.copy_(snapshot[name])


def _disagreement(before: dict[str, torch.Tensor], eager: dict[str, torch.Tensor], replayed: dict[str, torch.Tensor],
                  eager_outputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], *, rtol: float) -> str | None:
    """None when the replayed step's update of every tensor is the eager step's within `rtol` of
    the update's size (and the outputs agree); else what differs first, and by how much."""
    if set(eager) != set(replayed):
        return f"state {sorted(set(eager) ^ set(replayed))[0]} exists after one step only"
    for name, after in eager.items():
        if not after.is_floating_point():
            if not torch.equal(after, replayed[name]):
                return f"{name} differs"
            continue
        update = (after - before[name]).double() if name in before else after.double()
        got = (replayed[name] - before[name]).double() if name in before else replayed[name].double()
        error, scale = float((got - update).abs().max()), float(update.abs().max())
        if not error <= rtol * scale:  # also catches NaN
            return f"{name}: update off by {error:.2g}, {error / scale if scale else float('inf'):.2g} of its size"
    for index, (want, got) in enumerate(zip(eager_outputs, outputs, strict=True)):
        if want.is_floating_point():
            error, scale = float((got.double() - want.double()).abs().max()), float(want.double().abs().max())
            if not error <= rtol * max(scale, 1e-30):
                return f"output {index} off by {error:.2g}"
        elif not torch.equal(want, got):
            return f"output {index} is {got.tolist()} instead of {want.tolist()}"
    return None


__all__ = ["CapturedStep", "CudaGraph", "DEFAULT_RTOL", "GraphBackend", "RTOL", "WARMUP_STEPS", "capture_step"]
