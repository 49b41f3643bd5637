"""What the training job needs from a model-parallel split, and the parts both splits share.

A `ModelSplit` holds this device's share of one model (`module`: the parameters its optimizer
updates) and provides what the job drives every way of splitting through (train/loop.py's
`Strategy`; DataParallel provides it through `DataSplit`): `rows` (every rank reads the whole
global batch), `forward_backward` (one step's gradients; the loop steps the optimizer),
`predict` for evaluation, `named_gradients` for the finite check, and the whole model: its
state dict from the shards (`full_state_dict`, a collective; `load_full_state_dict`) and
`whole_model()`, so that `model.pt` and checkpoints look the same whichever split wrote them.
All its traffic goes through `transport` (a `CountingTransport`), so bytes and blocked time
are counted.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from phalanx.comm.counting import CountingTransport
from phalanx.runtime.world import World


class ModelSplit:
    """Base of `Pipeline` (layers) and `ChannelSplit` (channels)."""

    name = "split"
    module: nn.Module
    transport: CountingTransport
    world: World
    holds_output: bool  # this rank sees the logits: it counts loss, correct and examples

    # Shards are not replicas: each rank holds a different part, so there is nothing to compare.
    check_replicas = None

    def __init__(self, *, world: World, full_model: nn.Module, transport: CountingTransport | None) -> None:
        self.world = world
        self.transport = transport if transport is not None else CountingTransport()
        self.keys = list(full_model.state_dict())  # the whole model's key order, for full_state_dict
        self.whole = full_model  # whole_model() gathers the shards into it

    def forward_backward(self, X: torch.Tensor, y: torch.Tensor, *,
                         global_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one global batch (X, y); (loss sum, correct) on holders, zeros elsewhere."""
        raise NotImplementedError

    def predict(self, X: torch.Tensor) -> torch.Tensor | None:
        """Logits for X on ranks that hold the output, None elsewhere (every rank must call)."""
        raise NotImplementedError

    def layout(self) -> str:
        """Where the model's parts live, in words (the plan of stages or of channel slices)."""
        raise NotImplementedError

    def describe(self) -> str:
        """The run's first log line's account of the split."""
        return f"split {self.name}: {self.layout()}; activations sent point to point, contiguous"

    def facts(self) -> dict:
        """What a metrics row and the pre-flight check record about the split."""
        return {"split": self.name, "micro_batches": None, "schedule": None}

    def rows(self, total: int) -> slice:
        """Every rank reads all of a global batch: each computes its part of the model for all of it."""
        return slice(0, total)

    def named_gradients(self) -> dict[str, torch.Tensor]:
        return {n: p.grad for n, p in self.module.named_parameters() if p.grad is not None}

    def whole_model(self) -> nn.Module:
        """The whole model holding the shards' current values, on every rank (a collective)."""
        self.whole.load_state_dict(self.full_state_dict())
        return self.whole

    def close(self) -> None:
        """A split owns no thread or process group of its own: nothing to release."""

    def assemble(self, shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The whole model's tensors from every rank's `module.state_dict()`, in rank order."""
        raise NotImplementedError

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def make_optimizer(self, cls: type, **defaults) -> torch.optim.Optimizer:
        """The optimizer over this rank's part of the model."""
        return cls(self.module.parameters(), **defaults)

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
