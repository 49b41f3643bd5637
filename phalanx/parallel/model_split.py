"""What the training loop needs from a model-parallel split, and the parts both splits share.

A `ModelSplit` holds this device's share of one model (`module`: the parameters its optimizer
updates), runs one step's forward and backward (`train_batch`: gradients only; the loop steps
the optimizer), predicts for evaluation, and converts between its shards and one ordinary
state dict of the whole model (`full_state_dict`, a collective; `load_full_state_dict`), so
that `model.pt` and checkpoints look the same whichever split wrote them. All its traffic goes
through `transport` (a `CountingTransport`), so bytes and blocked time are counted.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from phalanx.comm.counting import CountingTransport
from phalanx.world import World


class ModelSplit:
    """Base of `Pipeline` (layers) and `ChannelSplit` (channels)."""

    name = "split"
    module: nn.Module
    transport: CountingTransport
    world: World
    holds_output: bool  # this rank sees the logits: it counts loss, correct and examples

    def __init__(self, *, world: World, full_model: nn.Module, transport: CountingTransport | None) -> None:
        self.world = world
        self.transport = transport if transport is not None else CountingTransport()
        self.keys = list(full_model.state_dict())  # the whole model's key order, for full_state_dict

    def train_batch(self, X: torch.Tensor, y: torch.Tensor, *, global_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one global batch (X, y); (loss sum, correct) on holders, zeros elsewhere."""
        raise NotImplementedError

    def predict(self, X: torch.Tensor) -> torch.Tensor | None:
        """Logits for X on ranks that hold the output, None elsewhere (every rank must call)."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def assemble(self, shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The whole model's tensors from every rank's `module.state_dict()`, in rank order."""
        raise NotImplementedError

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        for p in self.module.parameters():
            p.grad = None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every rank's shard, gathered and assembled: an ordinary state dict, on every rank (collective)."""
        return self.gather_named(self.module.state_dict())

    def full_grads(self) -> dict[str, torch.Tensor]:
        """The whole model's gradients, assembled like its parameters (collective; verify compares them)."""
        return self.gather_named({n: p.grad if p.grad is not None else torch.zeros_like(p)
                                  for n, p in self.module.named_parameters()})

    def gather_named(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        mine = {k: v.detach().cpu() for k, v in named.items()}
        shards = [mine]
        if self.world.distributed:
            shards = [None] * self.world.world_size
            dist.all_gather_object(shards, mine)
        full = self.assemble(shards)
        return {k: full[k] for k in self.keys if k in full}

    def output_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.world.device
        return torch.zeros((), dtype=torch.float64, device=device), torch.zeros((), dtype=torch.long, device=device)
