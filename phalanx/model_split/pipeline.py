"""`--split layers`: LeNet's layers placed on k devices in order, global batches pipelined through.

Each device is one *stage*: a contiguous run of LeNet's units (`lenet_parts.stage_plan`). A
global batch is cut into M micro-batches (split_batch's cut); activations flow forward and
their gradients backward between neighbouring stages only (pipeline_comm.py), and every stage
updates only its own layers. Two schedules:

- `gpipe` (Huang et al. 2019, "GPipe"): all M forwards, then all M backwards (last micro-batch
  first), then one update. Every stage holds all M micro-batches' activations; the idle share
  (the "bubble") is (k-1)/(M+k-1).
- `1f1b` (Narayanan et al. 2019, "PipeDream-Flush"; Megatron-LM's schedule): stage s runs
  k-s-1 warm-up forwards, then alternates one forward with one backward, then drains. Same
  bubble, but a stage holds at most k-s micro-batches' activations instead of M.

The loss of micro-batch m is its sum / the *global* batch size, so the gradients accumulated
over the micro-batches are the 1-device gradient of the whole batch (the loop's rule, as in
data parallelism). A batch smaller than M (an epoch's last) is cut into as many micro-batches
as it has examples - every stage computes the same cut.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.comm.counting import CountingTransport
from phalanx.data import split_batch
from phalanx.model_split.lenet_parts import INPUT_SHAPE, apply_unit, check_lenet, stage_plan, unit_shapes
from phalanx.model_split.model_split import ModelSplit
from phalanx.model_split.pipeline_comm import StageLink
from phalanx.runtime.world import World

SCHEDULES = ("gpipe", "1f1b")


class Stage(nn.Module):
    """Some of LeNet's layers, under LeNet's own names (so its state dict keys are LeNet's)."""

    def __init__(self, full_model: nn.Module, units: tuple[str, ...]) -> None:
        super().__init__()
        self.units = units
        for name in units:
            setattr(self, name, getattr(full_model, name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in self.units:
            x = apply_unit(name, getattr(self, name), x)
        return x


class Pipeline(ModelSplit):
    name = "layers"

    def __init__(self, full_model: nn.Module, *, world: World, micro_batches: int, schedule: str = "gpipe",
                 num_classes: int = 10, transport: CountingTransport | None = None) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"--schedule {schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}")
        if micro_batches < 1:
            raise ValueError(f"--micro-batches {micro_batches} must be at least 1")
        check_lenet(full_model, "layers")
        super().__init__(world=world, full_model=full_model, transport=transport)
        self.plan = stage_plan(world.world_size, num_classes)
        self.units = self.plan[world.rank]
        self.module = Stage(full_model, self.units).to(world.device)
        self.micro_batches, self.schedule = micro_batches, schedule
        shapes = unit_shapes(num_classes)
        self.in_shape = INPUT_SHAPE if world.rank == 0 else shapes[self.plan[world.rank - 1][-1]]
        self.out_shape = shapes[self.units[-1]]
        self.first, self.last = world.rank == 0, world.rank == world.world_size - 1
        self.holds_output = self.last
        self.link = StageLink(rank=world.rank, world_size=world.world_size, transport=self.transport)

    def layout(self) -> str:
        stages = " | ".join("+".join(s) for s in self.plan)
        return f"{self.schedule} pipeline of {len(self.plan)} stage(s) [{stages}], {self.micro_batches} micro-batches per step"

    def facts(self) -> dict:
        return {**super().facts(), "micro_batches": self.micro_batches, "schedule": self.schedule}

    def forward_backward(self, X, y, *, global_batch_size):
        pieces = split_batch(X, y, min(self.micro_batches, X.shape[0]))
        self._X, self._pieces, self._n = X, pieces, global_batch_size
        self._inputs, self._outputs, self._loss_sum, self._correct = {}, {}, *self.output_tensors()
        count = len(pieces)
        if self.schedule == "gpipe":
            for m in range(count):
                self._send_output(m, self._forward(m, self._recv_input(m)))
            for m in reversed(range(count)):
                self._send_input_grad(m, self._backward(m, self._recv_output_grad(m)))
        else:
            self._one_f_one_b(count)
        self._inputs, self._outputs = {}, {}
        return self._loss_sum, self._correct

    def _one_f_one_b(self, count: int) -> None:
        warmup = min(self.world.world_size - self.world.rank - 1, count)
        for m in range(warmup):
            self._send_output(m, self._forward(m, self._recv_input(m)))
        steady = count - warmup
        inp = self._recv_input(warmup) if steady else None
        for j in range(steady):
            out = self._forward(warmup + j, inp)
            # Send this output and receive the gradient of micro-batch j in one exchange: the
            # next stage is posting the matching send-gradient/receive-activation pair.
            grad = None if self.last else self.link.send_forward_recv_backward(out, (self._size(j), *self.out_shape), like=out)
            input_grad = self._backward(j, grad)
            if j < steady - 1:
                inp = self._send_grad_recv_input(input_grad, warmup + j + 1)
            else:
                self._send_input_grad(j, input_grad)
        for m in range(steady, count):
            self._send_input_grad(m, self._backward(m, self._recv_output_grad(m)))

    def _size(self, m: int) -> int:
        return self._pieces[m][0].shape[0]

    def _recv_input(self, m: int) -> torch.Tensor:
        if self.first:
            return self._pieces[m][0]
        return self.link.recv_forward((self._size(m), *self.in_shape), like=self._X).requires_grad_()

    def _send_grad_recv_input(self, input_grad, m: int) -> torch.Tensor:
        if self.first:
            return self._pieces[m][0]
        return self.link.send_backward_recv_forward(input_grad, (self._size(m), *self.in_shape),
                                                    like=self._X).requires_grad_()

    def _forward(self, m: int, inp: torch.Tensor) -> torch.Tensor:
        out = self.module(inp)
        self._inputs[m] = inp
        if self.last:
            y = self._pieces[m][1]
            loss_sum = F.cross_entropy(out, y, reduction="sum")
            self._loss_sum += loss_sum.detach()
            self._correct += (out.argmax(dim=1) == y).sum()
            out = loss_sum
        self._outputs[m] = out
        return out

    def _send_output(self, m: int, out: torch.Tensor) -> None:
        if not self.last:
            self.link.send_forward(out)

    def _recv_output_grad(self, m: int) -> torch.Tensor | None:
        return None if self.last else self.link.recv_backward((self._size(m), *self.out_shape), like=self._X)

    def _backward(self, m: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        out = self._outputs.pop(m)
        if self.last:
            (out / self._n).backward()
        else:
            out.backward(grad)
        inp = self._inputs.pop(m)
        return None if self.first else inp.grad

    def _send_input_grad(self, m: int, input_grad: torch.Tensor | None) -> None:
        if not self.first:
            self.link.send_backward(input_grad)

    @torch.no_grad()
    def predict(self, X):
        inp = X if self.first else self.link.recv_forward((X.shape[0], *self.in_shape), like=X)
        out = self.module(inp)
        if self.last:
            return out
        self.link.send_forward(out)
        return None

    def assemble(self, shards):
        full: dict[str, torch.Tensor] = {}
        for shard in shards:
            full.update(shard)
        return full

    def load_full_state_dict(self, state):
        self.module.load_state_dict({k: v for k, v in state.items() if k.split(".")[0] in self.units})
