"""The collectives of `--split channels`: gather the channel shards forward, reduce-scatter back.

After each layer every device holds its own output channels (units) for the whole batch;
`gather_channels` concatenates all devices' shards along dim 1, so the next layer - itself split
by output channels - sees its whole input. Its backward depends on who consumes the gathered
tensor (Megatron-LM's column-parallel layer: Shoeybi et al. 2019, "f" and "g"):

- a split layer (`reduce=True`): each device's layer only produced the part of the input
  gradient that flows through *its* output channels, so the true gradient is the sum over
  devices; each device needs only its own channels of it: a reduce-scatter.
- the loss (`reduce=False`): every device computes the same loss from the same gathered logits,
  so the gradient is already complete everywhere; each device keeps its own slice.

Both are written over point-to-point messages through one `CountingTransport` (all sends and
receives of a collective in one exchange), so every byte is counted: per gather a device sends
its shard to each of the k-1 others, (k-1) x its shard; per reduce-scatter it sends each other
device that device's slice of its partial gradient, (whole - its own shard). Partial gradients
are added in rank order on every device.
"""

from __future__ import annotations

import torch

from phalanx.comm.counting import CountingTransport
from phalanx.runtime.world import World


class ChannelComm:
    """Gathers along dim 1 for a world whose ranks own `counts[r]` consecutive channels each."""

    def __init__(self, *, world: World, transport: CountingTransport) -> None:
        self.world, self.transport = world, transport

    def all_gather(self, local: torch.Tensor, counts: list[int]) -> torch.Tensor:
        rank, k = self.world.rank, self.world.world_size
        local = local.contiguous()
        parts = [local if r == rank else torch.empty((local.shape[0], counts[r], *local.shape[2:]),
                                                     dtype=local.dtype, device=local.device) for r in range(k)]
        peers = [r for r in range(k) if r != rank]
        self.transport.exchange(sends=[(r, local) for r in peers], recvs=[(r, parts[r]) for r in peers])
        return torch.cat(parts, dim=1)

    def reduce_scatter(self, full: torch.Tensor, counts: list[int]) -> torch.Tensor:
        rank, k = self.world.rank, self.world.world_size
        slices = [s.contiguous() for s in full.split(counts, dim=1)]
        received = [slices[rank] if r == rank else torch.empty_like(slices[rank]) for r in range(k)]
        peers = [r for r in range(k) if r != rank]
        self.transport.exchange(sends=[(r, slices[r]) for r in peers], recvs=[(r, received[r]) for r in peers])
        total = received[0].clone()
        for part in received[1:]:
            total += part
        return total


class _GatherChannels(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, comm: ChannelComm, counts: list[int], reduce: bool):
        ctx.comm, ctx.counts, ctx.reduce = comm, counts, reduce
        return comm.all_gather(local, counts)

    @staticmethod
    def backward(ctx, grad_full):
        comm, counts = ctx.comm, ctx.counts
        if ctx.reduce:
            grad = comm.reduce_scatter(grad_full, counts)
        else:
            grad = grad_full.split(counts, dim=1)[comm.world.rank].contiguous()
        return grad, None, None, None


def gather_channels(local: torch.Tensor, *, comm: ChannelComm, counts: list[int], reduce: bool) -> torch.Tensor:
    """All devices' channel shards concatenated along dim 1; backward as the module docstring says."""
    if comm.world.world_size == 1:
        return local
    return _GatherChannels.apply(local, comm, counts, reduce)
