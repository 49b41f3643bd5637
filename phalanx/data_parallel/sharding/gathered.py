"""`dp.gathered_parameters(writeback=...)`: the block in which a script reads or edits a stage-3 replica's
whole parameters between steps - an EMA, a weight norm logged, WGAN's weight clipping, a re-initialised
layer, a deep copy.

Under `shard="parameters"` each rank keeps only its range of every parameter between steps
(at_rest.py refuses the parameters there). The block gathers every bucket on every rank (a
collective: all ranks enter it, as DeepSpeed's `GatheredParameters` and FSDP's `summon_full_params`),
and nothing inside it frees them (a forward there gathers nothing). On the way out one small
allreduce compares the ranks' whole parameters (bit sums, exact: guards/replicas.py) and whether
any rank changed them; then:

- `writeback=False` (FSDP's default): a change is refused in one line on every rank (FSDP drops it
  without a word);
- `writeback=True`: every rank must have made the same edit - the usual habit, one script on every
  rank - and each rank keeps its own range of it: exact, with nothing more on the wire. Ranks whose
  edits differ are refused in one line. DeepSpeed's `modifier_rank=0` instead broadcasts rank 0's
  edit, which takes a random re-initialisation made with a different seed per rank without a word.

An optimizer step or a load inside the block is refused (params.py, `check_outside_whole`): it
changes each rank's range under the whole parameters the block holds.

Any other stage keeps the whole parameters on every rank, so the block is a no-op there and a
script runs unchanged at any stage. An error raised inside the block leaves it with nothing kept
and no collective (a peer without the error would wait on it).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import torch

from phalanx.data_parallel.guards.replicas import bit_sum
from phalanx.errors import Misuse

_COLUMNS = 3  # per rank: the whole parameters' bit sum as two exact 32-bit halves, changed (0 or 1)


@contextlib.contextmanager
def gathered_parameters(sharding, *, writeback: bool, rank: int, world_size: int,
                        allreduce: Callable[[torch.Tensor], object]) -> Iterator[None]:
    """The block above over a replica's `sharding` (None: unsharded); `allreduce` sums a small
    float64 tensor in place on every rank."""
    if sharding is None or sharding.keeps_parameters:
        yield
        return
    params = sharding.params
    with params.whole():
        before = _bit_sum(params.views)
        yield
        after = _bit_sum(params.views)
        rows = torch.zeros(world_size, _COLUMNS, dtype=torch.float64, device=after.device)
        rows[rank] = torch.stack([after & 0xFFFFFFFF, (after >> 32) & 0xFFFFFFFF,
                                  (after != before).to(torch.int64)]).to(torch.float64)
        allreduce(rows.view(-1))  # each rank fills its own row: the sum gathers them, exactly (integers < 2**32)
        table = [tuple(row) for row in rows.tolist()]
        changed = [r for r in range(world_size) if table[r][2]]
        if changed and not writeback:
            raise Misuse(f"the parameters were changed inside dp.gathered_parameters() ({_ranks(changed)}), "
                         "whose default writeback=False drops a change: pass writeback=True to keep it")
        if changed:
            apart = [r for r in range(world_size) if table[r][:2] != table[0][:2]]
            if apart:
                raise Misuse(f"the parameters edited inside dp.gathered_parameters(writeback=True) differ "
                             f"between ranks ({_ranks(apart)} from rank 0's): each rank keeps its range of "
                             "one model, so make the same edit on every rank (the same values, the same seed)")
            params.take_whole()


def _bit_sum(views: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """One int64 over every parameter's bit pattern, each weighted by its position (a swap shows)."""
    sums = [bit_sum(view) for bucket in views for view in bucket]
    if not sums:
        return torch.zeros((), dtype=torch.int64)
    return (torch.stack(sums) * torch.arange(1, len(sums) + 1, dtype=torch.int64, device=sums[0].device)).sum()


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)
