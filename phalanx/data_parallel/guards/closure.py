"""An optimizer step driven by a closure (LBFGS): the loss it returns, as one device has it.

`optimizer.step(closure)` calls the closure (zero_grad, forward, backward and, on k ranks,
`dp.finish_gradient_sync()`) as often as it likes, and LBFGS reads what the closure returns: its
strong-Wolfe line search compares losses, and it stops once the loss stops changing. On one
device that is the global batch's loss. On k ranks each closure returns its own rank's: its share
under `shard_loss` (the shard's sum / the global size), or a per-rank mean (`average=True`). Each
rank's LBFGS then searched a line of its own: the ranks stepped apart while their gradients were
summed, made different numbers of closure calls and met in different collectives (2 workers,
float64, `line_search_fn="strong_wolfe"`: apart after the first step). Without a line search the
parameters stayed equal, but the state's `prev_loss` did not, and the replica check stopped the
run at close().

`ClosureLoss` hands every such step over this replica's parameters a closure that calls the
script's and returns the global loss: the ranks' values summed (`average=True`: their mean), in
float64, in one small collective per call, with the type and dtype the closure returned. Every
rank then holds the same bits and LBFGS runs as on one device (equal in float64 within rounding).
A loss already equal on every rank (a closure that reduced it itself, DDP's recipe:
`dist.all_reduce(loss); loss /= world_size`) is returned as it was; anything but a number (None)
too. A closure whose backward was never summed is refused as it returns, before the optimizer
reads that rank's own gradient, naming the call to add. The same holds for any optimizer given a
closure (`SGD.step(closure)` returns the loss too), so the loss a step returns is the one device's:
log it as it is, not reduced again.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from phalanx.comm import Tag
from phalanx.data_parallel.replica_hook import OptimizerVerdicts, steps_replica
from phalanx.errors import Misuse
from phalanx.runtime.world import World

CLOSURE_LOSS = Tag("closure loss")
UNSUMMED = ("the closure given to optimizer.step() returned after a backward whose gradients were never summed "
            "across ranks, so the optimizer would read each rank's own: call dp.finish_gradient_sync() in the "
            "closure, after loss.backward()")


class ClosureLoss:
    """The closure-driven steps of one replica (see the module docstring); `close()` removes the hook.

    `module`, `sharding`: the replica's (whose optimizers step it); `unsynced`: its UnsyncedGradientGuard;
    `allreduce(flat, tag)` sums in place on its exchange."""

    def __init__(self, *, world: World, average: bool | None, module: torch.nn.Module, sharding, unsynced,
                 allreduce: Callable[[torch.Tensor, Tag], object]) -> None:
        self.world, self.average, self._module, self._sharding = world, bool(average), module, sharding
        self._unsynced, self._allreduce = unsynced, allreduce
        self._verdicts = OptimizerVerdicts()  # does it step this replica?
        self._handle = register_optimizer_step_pre_hook(_step_hook(weakref.ref(self)))

    def closure_args(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The step's arguments (`args[0]` is the optimizer itself, as torch passes them to its hooks) with
        the closure wrapped, or None (no closure, or not this replica's optimizer)."""
        if len(args) > 1 and callable(args[1]):
            if self._verdicts.of(optimizer, self._steps_replica):
                return (args[0], self.wrap(args[1]), *args[2:]), kwargs
        elif callable(kwargs.get("closure")) and self._verdicts.of(optimizer, self._steps_replica):
            return args, {**kwargs, "closure": self.wrap(kwargs["closure"])}
        return None

    def _steps_replica(self, optimizer: torch.optim.Optimizer) -> bool:
        return steps_replica(optimizer, self._module, self._sharding)

    def wrap(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        def global_loss() -> Any:
            loss = closure()
            if self._unsynced.unsummed:
                raise Misuse(UNSUMMED)
            return self.combined(loss)

        return global_loss

    def combined(self, loss: Any) -> Any:
        """`loss` over every rank: each rank's value in its own row of one float64 sum, so every rank
        reads the same rows and takes the same branch and the same bits."""
        if isinstance(loss, torch.Tensor) and loss.is_floating_point() and loss.numel() == 1:
            value = loss.detach().reshape(())
        elif isinstance(loss, (float, int)) and not isinstance(loss, bool):
            value = torch.tensor(float(loss))
        else:
            return loss  # None, or nothing a line search reads: as it was
        rows = torch.zeros(self.world.world_size, dtype=torch.float64, device=self.world.device)
        rows[self.world.rank] = value.to(device=rows.device, dtype=torch.float64)
        self._allreduce(rows, CLOSURE_LOSS)  # its step: the last the board recorded
        if bool((rows == rows[0]).all()):
            return loss  # reduced in the closure already: the global loss on every rank
        total = rows.mean() if self.average else rows.sum()
        if isinstance(loss, torch.Tensor):
            return total.to(device=loss.device, dtype=loss.dtype).reshape(loss.shape)
        return total.item()

    def close(self) -> None:
        self._handle.remove()


def _step_hook(owner: "weakref.ref[ClosureLoss]"):
    """torch's process-wide step pre-hook for `owner`, held weakly: a dropped replica's does nothing."""
    def hook(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        target = owner()
        return None if target is None else target.closure_args(optimizer, args, kwargs)

    return hook
