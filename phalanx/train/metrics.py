"""`reduce`: one value a user's loop wants to log, summed or averaged over the ranks.

Once a script runs on k ranks every number it prints is one rank's: with
`shard_loss` the loss a rank backpropagates is its shard's sum / the *global* batch size, about
the mean / k, so `loss.item()` prints, say, 1.148 where the 1-device script prints 2.31. The
global batch's mean loss is the *sum* of those shares over the ranks:

    world.print(f"loss {phalanx.reduce(loss, op='sum', world=world):.4f}")   # the 1-device number

and a per-rank quantity (a mean the rank computed itself, a time) is averaged with op="mean";
op="max" / "min" give the largest / smallest over the ranks (the slowest rank's time).
It is a collective: every rank calls it at the same point. It reads the result on the host,
which waits for the device (on a GPU: log every N steps, not every step).
"""

from __future__ import annotations

import torch

from phalanx.comm import all_reduce_sum_
from phalanx.comm.gather import per_leaf
from phalanx.runtime.call_habits import phalanx_call
from phalanx.runtime.world import World

REDUCE_OPS = ("mean", "sum", "max", "min")
# torch.distributed.ReduceOp's names of the same (all_reduce(t, op=ReduceOp.SUM)): taken as they are.
TORCH_OPS = {"SUM": "sum", "AVG": "mean", "MAX": "max", "MIN": "min"}


@phalanx_call  # Fabric's reduce_op=, the World by position: one line (call_habits.py)
def reduce(value: float | int | torch.Tensor, *, world: World, op: str = "mean") -> float | int | torch.Tensor:
    """`value` summed over every rank of `world` (`op="sum"`), or that sum / world size
    (`op="mean"`), or its largest / smallest over the ranks (`op="max"` / `"min"`: each rank's
    value in its own row of a k-row sum, through the same watched collective; k times the bytes,
    nothing for a logged number). Real numbers are summed in float64; integers (an int, an integer or bool
    tensor: counts) exactly, in int64, so `op="sum"` gives an int (past 2**53 a float64 sum would
    round). A number or a one-element tensor gives a Python number; a larger tensor a tensor of its
    shape (one collective for all its elements). The caller's tensor is left as it was. A tuple, list
    or dict of values (nested) gives the same collection, each value reduced. `op` may be
    torch.distributed's `ReduceOp.SUM`, `AVG`, `MAX` or `MIN`."""
    world.check_here("phalanx.reduce")
    if not isinstance(op, str):
        op = TORCH_OPS.get(getattr(op, "name", None), op)
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce op {op!r} is unknown; choose one of {', '.join(REDUCE_OPS)}")
    if isinstance(value, (dict, list, tuple)):  # Fabric's all_reduce of a collection: each value alike
        return per_leaf(value, lambda leaf: reduce(leaf, world=world, op=op))
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            raise ValueError("reduce takes real values, got a complex tensor; reduce torch.view_as_real(value) "
                             "and rebuild it with torch.view_as_complex")
        dtype = torch.float64 if value.is_floating_point() else torch.int64
        total = value.detach().to(device=world.device, dtype=dtype, copy=True)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        dtype = torch.int64 if isinstance(value, int) else torch.float64
        total = torch.tensor(value, dtype=dtype, device=world.device)
    else:
        raise ValueError(f"reduce takes a number or a tensor (or a tuple, list or dict of them), got "
                         f"{type(value).__name__}")
    if op in ("max", "min"):
        rows = torch.zeros((world.world_size, *total.shape), dtype=total.dtype, device=world.device)
        rows[world.rank] = total
        all_reduce_sum_(rows, world=world)
        total = rows.amax(dim=0) if op == "max" else rows.amin(dim=0)
        return total.item() if total.numel() == 1 else total
    all_reduce_sum_(total, world=world)
    if op == "mean":
        total = total.to(torch.float64) / world.world_size
    return total.item() if total.numel() == 1 else total
