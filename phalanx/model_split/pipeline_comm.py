"""Point-to-point traffic between neighbouring pipeline stages: activations forward, gradients back.

Stage s receives its input activation from stage s-1 and sends its output to s+1; in backward
the gradient of that output comes back from s+1 and the gradient of its input goes to s-1.
Shapes are known on both sides (each unit's output shape times the micro-batch size, which
every stage computes from the same global batch), so no shape travels. Every message goes
through one `CountingTransport`, which counts the bytes and the time a stage sat blocked; its
waits are bounded by the process group's timeout, so a lost neighbour fails the run.

`send_forward_recv_backward` / `send_backward_recv_forward` post a send and a receive as one
exchange: 1F1B's steady state, where two neighbours would otherwise each wait on a blocking
send to the other.
"""

from __future__ import annotations

import torch

from phalanx.comm.counting import CountingTransport


class StageLink:
    def __init__(self, *, rank: int, world_size: int, transport: CountingTransport) -> None:
        self.rank, self.world_size, self.transport = rank, world_size, transport
        self.prev = rank - 1 if rank > 0 else None
        self.next = rank + 1 if rank < world_size - 1 else None

    def send_forward(self, activation: torch.Tensor) -> None:
        self.transport.exchange(sends=[(self.next, activation.detach().contiguous())])

    def recv_forward(self, shape, *, like: torch.Tensor) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=like.dtype, device=like.device)
        self.transport.exchange(recvs=[(self.prev, buffer)])
        return buffer

    def send_backward(self, grad: torch.Tensor) -> None:
        self.transport.exchange(sends=[(self.prev, grad.contiguous())])

    def recv_backward(self, shape, *, like: torch.Tensor) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=like.dtype, device=like.device)
        self.transport.exchange(recvs=[(self.next, buffer)])
        return buffer

    def send_forward_recv_backward(self, activation: torch.Tensor, grad_shape, *, like: torch.Tensor) -> torch.Tensor:
        buffer = torch.empty(grad_shape, dtype=like.dtype, device=like.device)
        self.transport.exchange(sends=[(self.next, activation.detach().contiguous())], recvs=[(self.next, buffer)])
        return buffer

    def send_backward_recv_forward(self, grad: torch.Tensor, act_shape, *, like: torch.Tensor) -> torch.Tensor:
        buffer = torch.empty(act_shape, dtype=like.dtype, device=like.device)
        self.transport.exchange(sends=[(self.prev, grad.contiguous())], recvs=[(self.prev, buffer)])
        return buffer
