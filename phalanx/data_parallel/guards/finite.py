"""The summed gradient's NaN/Inf check: at which step, and on which rank, a gradient first went non-finite.

One rank's NaN or Inf reaches every replica through the allreduce, and the optimizer step then
makes every parameter NaN: a script runs on and saves a NaN state dict with exit code 0 (torch
DDP says nothing either). `FiniteCheck` is DataParallel's watch over it, on by
default. At every synced step it keeps, on the device and without reading anything back, one
number per bucket from this rank's own gradient just before the bucket goes on the wire
(`before_sum`) and one from the summed bucket after the wait (`after_sum`): the bucket's sum,
which is NaN or Inf when an element is (or when finite elements sum past float32's ~3e38, which
only a diverged run reaches). Each sum is written straight into its cell of one table on the
device (`_sums`: a row per synced step since the last check, this rank's own sums and the summed
ones, a column per bucket; min(every, 128) rows made at the first step, doubled while an interval
needs more, widened for more buckets, then kept), so a step makes no tensor at all: one
vectorised pass per bucket and side, 6 µs for LeNet's 126 k gradients on the 2-core CPU, where
`isfinite(g).all()` costs 250 µs. Until 2026-12-05 each step also stacked its sums, tested them and
wrote two flags, a dozen small ops: the check cost a small MLP's step 75 µs, now 40
(docs/benchmarks.md). Over the shm allreduce the exchange takes both sums itself, in the passes that
copy and sum the bucket (finite_notes.py): a 23 MB gradient's two passes here cost 2-3 ms a step.
The table keeps the memory flat: a stacked tensor kept per step until the check lived across steps
in glibc's heap, where the allocator setting
(runtime/binding.py) puts the step's large blocks too, and pinned the holes they leave; a
worker's peak RSS then grew step by step (a 16.8 M-parameter MLP with Adam, 2 CPU workers, per
rank: 0.78-1.07 GB after 5 steps, 1.36-2.06 GB after 100; with the table 0.75-0.85 GB, torch
DDP under the same setting 0.83-0.96; docs/benchmarks.md). Every `every` synced steps the ranks sum
one small vector over the exchange's own transport - for each rank, the first step since the
last check at which its own gradient, and at which the sum, was non-finite - so every rank
reaches the same verdict by construction (not by trusting the summed buckets to be bitwise equal
everywhere, which a compressed wire or a sharded exchange need not keep) and raises the same
`NonFinite`, naming the first step and rank. An error, not a warning: from that step on every
replica's parameters are NaN, so nothing after it is worth computing or saving, and raised on
every rank the run ends in one line. `every=0` turns it off.

A non-finite gradient that no update applied is no failure: torch.amp's fp16 `GradScaler` makes
them by design (its first scales overflow) and skips those steps. So where a check finds one, the
ranks look at what they hold of the weights (`weights`: the parameters, or a ZeRO-3 rank's
shards) in one more small sum: finite, the steps were skipped, and rank 0 says so once; a NaN/Inf
there stops the run, naming the gradient's step. The periodic check runs before the step's
update, so when that step's own gradient is the non-finite one, the verdict waits one synced
step (`_deferred`), when the update has been applied or skipped.

The steps since the last check are checked again before anything leaves the replica, so a NaN
after the last periodic check (or in a run shorter than the interval) is never saved as the
model: `check_now` - the same comparison across ranks, a collective - runs in
`dp.check_finite()`, which `full_state_dict()`, `phalanx.checkpoint(...)`, `close()` (unless an
error is already on its way) and `phalanx train`'s epoch ends and saves call; `check_local`, with
no collective, runs in `state_dict()`, which one rank may call alone (`torch.save` on rank 0):
it reads this rank's own notes (and, where a sharded replica's notes cover only its share of the
sum, the parameters themselves). Nothing is kept or exchanged that the periodic check did not
already keep: a call with no steps since the last check costs nothing, one with steps costs one
small allreduce.

A world of one with nothing to exchange keeps no per-step numbers (its step stays the plain
loop's): at check steps, and when checked now, it sums its gradients and names the step at which
it found them non-finite.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

import torch

from phalanx.data_parallel.guards.checks import NonFinite
from phalanx.data_parallel.guards.finite_notes import NOTED_DTYPES, TransportNotes
from phalanx.errors import warn_at_caller
from phalanx.runtime.world import World

DEFAULT_CHECK_FINITE_EVERY = 100  # as `phalanx train --check-every`, which sets it for its replicas
_OFF = "check_finite_every=0 turns this check off"


def _sum(tensor: torch.Tensor) -> torch.Tensor:
    """NaN/Inf when an element is; half types summed in float32, so their small range cannot overflow it."""
    return tensor.detach().sum(dtype=torch.float32 if tensor.element_size() < 4 else None)


def _sum_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype `tensor`'s sum is noted in: float64 for float64, else float32 (as `_sum` sums halves)."""
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def _sum_into(cell: torch.Tensor, tensor: torch.Tensor) -> None:
    """`tensor`'s sum written into the 0-d `cell` (its dtype: `_sum_dtype`), no tensor made."""
    torch.sum(tensor.detach().reshape(-1), 0, dtype=cell.dtype, out=cell)


def _first(bad: list[bool], since: int) -> int:
    """The step of the first True in `bad` (whose index 0 is step `since`), or 0 when none is."""
    return next((since + i for i, b in enumerate(bad) if b), 0)


class FiniteCheck:
    """One replica's NaN/Inf watch; see the module docstring. `every`: synced steps between checks
    (the replica's `check_finite_every`, checked where its options were made: config.py)."""

    def __init__(self, *, every: int, world: World,
                 weights: Callable[[], Sequence[torch.Tensor]] | None = None) -> None:
        """`weights`: what this rank holds of the weights, read only where a check found a non-finite
        gradient (None: every non-finite gradient stops the run)."""
        self.every, self.world, self._weights = every, world, weights
        self._deferred: str | None = None  # a verdict waiting for the update of the step that checked
        self._skipped_said = False  # rank 0 said once that non-finite steps never reached the weights
        # A row per synced step since the last check: [row, 0, j] this rank's own sum of the step's j-th
        # launched bucket, [row, 1, j] the j-th summed bucket's; cells a step leaves unwritten stay 0.
        self._sums: torch.Tensor | None = None
        self._noted = 0  # the rows of _sums in use; row _noted is the step being noted
        self._own_at = 0  # the own column the next launch of this step writes
        self._adding = False  # another backward of this step: its launches add to the notes of the earlier
        self._local_at = 0  # the step this rank's own checks last looked at (no collective)
        self._transport = TransportNotes()  # sums the shm allreduce takes as it moves a bucket (finite_notes.py)

    def before_sum(self, bucket: torch.Tensor, *, index: int = 0, buckets: int = 1,
                   by_transport: bool = False) -> torch.Tensor | None:
        """Note this rank's own `bucket` as it goes on the wire (a synced step's launch). `by_transport`:
        the exchange can take the sums as it moves the bucket (the shm allreduce): then the pair it
        adds them to (bucket `index` of `buckets`; finite_notes.py), read at after_sum; else None."""
        if not self.every:
            return None
        if by_transport and bucket.dtype in NOTED_DTYPES:
            self._own_at += 1
            return self._transport.pair(index, buckets=buckets, own_column=self._own_at - 1)
        cell = self._cell(0, self._own_at, bucket)
        if self._adding:
            cell.add_(_sum(bucket).to(cell.dtype))
        else:
            _sum_into(cell, bucket)
        self._own_at += 1

    def another_backward(self) -> None:
        """This step's buckets were summed and go out again for another backward (overlap.py's
        settle): the own sums of their next launches add to those noted, so a step keeps one note
        per bucket (a NaN/Inf in either stays one)."""
        if self.every:
            self._own_at, self._adding = 0, True

    def after_sum(self, summed: Sequence[torch.Tensor], *, step: int, allreduce: Callable[[torch.Tensor], object],
                  laid_out_again: bool = False) -> None:
        """Note synced step `step`'s summed buckets; at a check step, compare notes across ranks
        (`allreduce` sums a small float64 tensor in place on every rank) and raise if any was NaN/Inf.
        `laid_out_again`: the buckets were laid out anew after the sum (layout.py): the sums the
        exchange took of the old ones are not these buckets', so they are summed here."""
        taken = self._transport.take()
        if not self.every or not summed:
            return
        self._settle(allreduce)
        for j, notes in taken.items():
            self._cell(0, notes.own_column, notes.own).copy_(notes.own)
        for j, bucket in enumerate(summed):
            if j in taken and not laid_out_again:
                self._cell(1, j, bucket).copy_(taken[j].summed)
            else:
                _sum_into(self._cell(1, j, bucket), bucket)
        self._noted += 1
        self._own_at, self._adding = 0, False
        if step % self.every == 0:
            self.check_now(step=step, allreduce=allreduce)

    def check_now(self, *, step: int, allreduce: Callable[[torch.Tensor], object], found: str | None = None) -> None:
        """Compare the notes of the synced steps up to `step` since the last check across ranks,
        now (a collective: every rank calls it at the same point; none when no step is noted -
        ranks in lockstep all have the same number), and raise NonFinite naming the first step
        and rank. `found`: where it was found, for the message (default: the periodic check)."""
        if not self.every:
            return
        self._settle(allreduce)
        if not self._noted:
            return
        notes = self._notes()
        own, total = notes[:, 0].tolist(), notes[:, 1].tolist()
        k, rank, since = self.world.world_size, self.world.rank, step - self._noted + 1
        self._sums[:self._noted].zero_()  # compared: the rows serve the next interval
        self._noted = 0
        firsts = torch.zeros(2 * k, dtype=torch.float64, device=notes.device)
        firsts[2 * rank], firsts[2 * rank + 1] = _first(own, since), _first(total, since)
        allreduce(firsts)  # every rank puts its two numbers in its own slots: the sum gathers them
        own_firsts, sum_firsts = [int(s) for s in firsts[0::2].tolist()], [int(s) for s in firsts[1::2].tolist()]
        sum_first = min((s for s in sum_firsts if s), default=0)
        periodic, found = found is None, found or self._found(step)
        first_own = min((s for s in own_firsts if s), default=0)
        message = None
        if first_own and not (sum_first and sum_first < first_own):
            ranks = [r for r, s in enumerate(own_firsts) if s == first_own]
            who = ("every rank's own gradient" if len(ranks) == k > 1 else
                   f"rank {ranks[0]}'s own gradient" if len(ranks) == 1 else
                   " and ".join(f"rank {r}'s" for r in ranks) + " own gradients")
            message = (f"gradient NaN/Inf at step {first_own}: {who} went non-finite first"
                       f"{' and the allreduce spread it to every replica' if k > 1 else ''} ({found}); "
                       f"look at that step's loss and data, or lower the lr; {_OFF}")
        elif sum_first:
            message = (f"gradient NaN/Inf at step {sum_first}: the summed gradient overflowed although every "
                       f"rank's own was finite ({found}); an fp16 exchange holds at most 65504 (grad_dtype "
                       f"bf16 has float32's range), or lower the lr; {_OFF}")
        if message is not None:  # every rank has the same message: the sums above made it so
            # The periodic check runs before its step's update: a bad last step is decided after it.
            self._decide(message, allreduce=allreduce, applied=not periodic or not (own[-1] or total[-1]))

    def _settle(self, allreduce: Callable[[torch.Tensor], object] | None) -> None:
        """Decide a verdict left waiting for the update of the step that checked: by now it was
        applied, or skipped (a collective where `allreduce` is given and a verdict waits)."""
        if self._deferred is not None:
            self._decide(self._deferred, allreduce=allreduce, applied=True)

    def _decide(self, message: str, *, allreduce: Callable[[torch.Tensor], object] | None, applied: bool) -> None:
        """A check found a non-finite gradient (`message`): stop the run if it reached what any
        rank holds of the weights; if they are finite, the updates skipped it, unless the step
        that checked is yet to be applied (`applied` False): then decide after it."""
        self._deferred = None
        if self._weights is None:
            raise NonFinite(message)
        bad = torch.full((1,), float(self._weights_bad()), dtype=torch.float64, device=self.world.device)
        if allreduce is not None and self.world.world_size > 1:
            allreduce(bad)  # on every rank at the same point: the verdict that led here is the same
        if bad.item():
            raise NonFinite(message)
        if not applied:
            self._deferred = message
        elif not self._skipped_said and self.world.is_main:
            self._skipped_said = True
            warn_at_caller(f"{message.split(' (', 1)[0]}, but no update applied it: the weights are finite (the "
                           "step was skipped, as torch.amp.GradScaler skips steps whose scaled gradient overflowed); "
                           "training goes on, and a NaN/Inf that reaches the weights still stops it")

    def _weights_bad(self) -> bool:
        """Whether what this rank holds of the weights has a NaN/Inf (True without `weights`)."""
        if self._weights is None:
            return True
        weights = list(self._weights())
        return bool(weights) and not bool(torch.stack([_sum(w) for w in weights]).isfinite().all())

    def check_local(self, *, step: int, where: str, gradients: Callable[[], Mapping[str, torch.Tensor]] | None = None,
                    parameters: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None) -> None:
        """The synced steps up to `step` since the last check, on this rank alone (no collective:
        one rank may call it by itself), once per step however often it is called: its notes, or
        with nothing exchanged its `gradients()`, and the `parameters()` where its notes hold only
        its share of the sum (a sharded replica). NonFinite names the first step, and whether
        this rank's own gradient went non-finite or another's; the notes stay for the next check
        across ranks (which only some ranks' call here must not upset)."""
        if not self.every or step == self._local_at:
            return
        found = self.found_by(where, step)
        if gradients is not None:
            return self.after_local_step(gradients, step=step, found=found)
        self._local_at = step
        bad = self._notes().any(1).tolist() if self._noted else []
        if any(bad):
            first = bad.index(True)
            mine = bool(self._notes()[first, 0])
            since = step - self._noted + 1  # the notes stay: a check across ranks may still follow
            rank, others = self.world.rank, [r for r in range(self.world.world_size) if r != self.world.rank]
            who = (f"rank {rank}'s own gradient went non-finite" if mine else
                   f"rank {others[0]}'s own gradient went non-finite (or the sum overflowed) while rank {rank}'s "
                   "stayed finite" if len(others) == 1 else
                   f"the summed gradient went non-finite while rank {rank}'s own stayed finite (another rank's "
                   "did, or the sum overflowed; dp.check_finite() on every rank names it)")
            if self._weights_bad():  # else no update applied it (a GradScaler skip): see the module docstring
                raise NonFinite(f"gradient NaN/Inf at step {since + first}: {who} ({found}); look at that step's "
                                f"loss and data, or lower the lr; {_OFF}")
        for name, value in (parameters() if parameters is not None else ()):
            if not bool(_sum(value).isfinite()):
                raise NonFinite(f"parameter {name} is NaN/Inf on rank {self.world.rank} ({found}; a share another "
                                "rank updated: dp.check_finite() on every rank names the step and rank); look at "
                                f"the loss and data, or lower the lr; {_OFF}")

    @property
    def steps_noted(self) -> int:
        """The synced steps noted since the last check across ranks."""
        return self._noted

    def _cell(self, side: int, column: int, like: torch.Tensor) -> torch.Tensor:
        """The cell of the step being noted for bucket `like`'s sum: `side` 0 this rank's own, 1 the
        summed; the table made, or grown (rows doubled, columns for more buckets, float64 for a
        float64 bucket) where it cannot hold it."""
        table, dtype = self._sums, _sum_dtype(like)
        rows, columns = (0, 0) if table is None else (table.shape[0], table.shape[2])
        more_rows, more_columns = self._noted >= rows, column >= columns
        if more_rows or more_columns or table.dtype != torch.promote_types(table.dtype, dtype):
            grown = torch.zeros(max(min(self.every, 128), 2 * self._noted) if more_rows else rows, 2,
                                max(column + 1, 2 * columns) if more_columns else columns,
                                dtype=dtype if table is None else torch.promote_types(table.dtype, dtype),
                                device=like.device)
            if table is not None:
                grown[:rows, :, :columns] = table
            self._sums = table = grown
        return table[self._noted, side, column]

    def _notes(self) -> torch.Tensor:
        """The notes as steps x (this rank's own buckets, the summed buckets): True where a sum was NaN/Inf."""
        return self._sums[:self._noted].isfinite().logical_not_().any(2)

    def after_local_step(self, gradients: Callable[[], Mapping[str, torch.Tensor]], *, step: int,
                         found: str | None = None) -> None:
        """A world of one's synced step `step`: at a check step (or any, given `found`: where it is
        checked now), sum `gradients()` (by name) and raise naming the first that is NaN/Inf."""
        if found is None:
            try:
                self._settle(None)
            except NonFinite:
                self._local_at = step  # named: a check as state leaves finds nothing new at this step
                raise
        if not self.every or (step % self.every if found is None else step == self._local_at):
            return
        self._local_at = step  # checked: a later call at the same step finds nothing new
        named = gradients()
        sums = [_sum(g) for g in named.values()]
        if sums and not bool(torch.stack(sums).isfinite().all()):
            name = next(n for n, s in zip(named, sums) if not bool(s.isfinite()))
            first = step - (self.every if found is None else step % self.every or self.every) + 1
            when = f"step {step}" if first == step else f"one of steps {max(1, first)}-{step}"
            self._decide(f"gradient NaN/Inf at {when}, in {name} (the first parameter holding one; "
                         f"{found or self._found(step)}); look at the loss and data, or lower the lr; {_OFF}",
                         allreduce=None, applied=found is not None)

    def _found(self, step: int) -> str:
        return f"found at step {step}'s check, every {self.every} step{'s' if self.every > 1 else ''}"

    def found_by(self, where: str, step: int) -> str:
        """Where a check out of turn found it, for the message."""
        return f"found by {where} after step {step}, before the next check every {self.every} steps"
