"""`auto`'s channels_last given up, at the first forward, for a model whose forward cannot take it.

`prepare(memory_format="auto")` lays a CPU conv net out channels_last (memory_format.py) before
anything has run. A forward that flattens a conv output with `x.view(x.size(0), -1)` - the
PyTorch tutorial's CNN - cannot take that layout: a channels-last activation is not one block in
(C, H, W) order, and torch raises "view size is not compatible with input tensor's size and
stride". Plain torch and DDP run that script, so under `auto` the replica's first forward is a
trial. What a forward may change is kept aside first: the buffers (BatchNorm's running statistics
and `num_batches_tracked`) and the generators dropout draws from (the CPU one, and the device's on
CUDA). If the forward raises that error, they are put back, the weights are laid out contiguous
(their gradient buckets again with them: `relayout`), `describe()` says why, and the forward runs
again: the step is exactly the one a contiguous model takes (1-device and k-device runs agree).

Every rank runs the same model on a shard of the same shape and meets the same error; only a rank
whose shard is empty at that forward would not (`x.view(-1, 400)` of nothing succeeds). So at the first synced
step one small sum counts the ranks that fell back, and a count other than none or all is refused
before the optimizer steps (their buckets would hold gradients in different orders). An explicit
`channels_last`, a sharded replica (its shards are laid out once), or a forward that fails so only
after the first one passed, gets one line naming the fixes instead of torch's.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from phalanx.comm import Tag
from phalanx.data_parallel.memory_format import layout_of
from phalanx.errors import RunFailed, UsageError

VIEW_ERROR = "view size is not compatible with input tensor's size and stride"
REASON = "the model's forward .view()s a conv output"


class ChannelsLastView(UsageError, RuntimeError):
    """The model's forward .view()s a channels_last activation (a RuntimeError, as torch's was)."""


class FormatFallback:
    """A replica's memory format at its forwards: `forward(call, ...)` runs the model, trying the
    first forward under an automatic channels_last (see the module docstring). `requested`: the
    option ("auto", "channels_last", "contiguous"); `can_fall_back`: False for a sharded replica;
    `relayout()`: lays the gradient buckets out again for the parameters' new strides."""

    def __init__(self, module: nn.Module, *, requested: str, can_fall_back: bool, exchanging: bool,
                 relayout: Callable[[], None]) -> None:
        self._module, self._requested, self._relayout, self._can = module, requested, relayout, can_fall_back
        self.channels_last = layout_of(module) == "channels_last"
        self.pending = self.channels_last and requested == "auto" and can_fall_back
        self._to_agree = self.pending and exchanging  # the first synced step counts who fell back
        self.reason: str | None = None  # why "auto" ended contiguous, for describe()

    def forward(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not self.channels_last:
            return call(*args, **kwargs)
        if not self.pending:
            try:
                return call(*args, **kwargs)
            except RuntimeError as exc:
                if VIEW_ERROR not in str(exc):
                    raise
                raise ChannelsLastView(self._refusal()) from exc
        kept = _snapshot(self._module)
        try:
            out = call(*args, **kwargs)
            self.pending = False
            return out
        except RuntimeError as exc:
            if VIEW_ERROR not in str(exc):
                raise
        _restore(self._module, kept)
        self._module.to(memory_format=torch.contiguous_format)
        self.channels_last, self.pending, self.reason = False, False, REASON
        self._relayout()
        return call(*args, **kwargs)

    def agree(self, allreduce: Callable[[torch.Tensor, Tag], object], *, world_size: int, device: torch.device) -> None:
        """At the first synced step: refuse, on every rank alike, a fallback some ranks made and others not."""
        if not self._to_agree:
            return
        self._to_agree = False
        fell_back = torch.tensor([float(self.reason is not None)], dtype=torch.float64, device=device)
        allreduce(fell_back, Tag("first-step check"))
        count = int(fell_back.item())
        if 0 < count < world_size:
            raise RunFailed(f"{count} of {world_size} ranks laid the model out contiguous at their first forward "
                            f"({REASON}) and the others kept channels_last (a rank whose first shard was empty "
                            "views nothing), so their gradients were summed in different orders: prepare with "
                            "memory_format=\"contiguous\", or flatten with .reshape(x.size(0), -1) or x.flatten(1)")

    def _refusal(self) -> str:
        why = {"channels_last": "memory_format=\"channels_last\" lays it out so",
               "auto": "memory_format=\"auto\" chose channels_last and a forward before this one took it"}.get(
            self._requested, "the model was laid out channels_last before prepare")
        if self._requested == "auto" and not self._can:
            why = "memory_format=\"auto\" chose channels_last, and a sharded replica keeps its layout"
        return (f"the model's forward .view()s a conv output that is channels_last ({why}), which torch cannot view "
                "as one block: flatten with .reshape(x.size(0), -1) or x.flatten(1), or prepare with "
                "memory_format=\"contiguous\"")


def _snapshot(module: nn.Module) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """What a forward may change besides its output: the buffers and the random generators' states."""
    buffers = [buffer.detach().clone() for buffer in module.buffers()]
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return buffers, torch.get_rng_state(), cuda


@torch.no_grad()
def _restore(module: nn.Module, kept: tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]) -> None:
    buffers, cpu, cuda = kept
    for buffer, value in zip(module.buffers(), buffers):
        buffer.copy_(value)
    torch.set_rng_state(cpu)
    if cuda:
        torch.cuda.set_rng_state_all(cuda)
