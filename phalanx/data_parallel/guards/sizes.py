"""The sizes `shard_loss` gets, compared across the ranks at a few synced steps.

The global batch size is one number for the whole global batch, the same on every rank. Two
habits break that, silently:

- **each rank's own count** (`shard_loss(loss_sum, (labels != pad).sum())`): the ranks' sizes
  differ wherever their padding does, which may first happen at any step (an outside-user trial:
  padding from step 2 ended 0.21 relative from one device);
- **each rank's own token count where every token counts** (`shard_loss(loss_sum, ids.numel())`,
  equal shards): the sizes agree, but every rank's is its own input's elements, k times the gradient.

`SizesAcrossRanks`, on every rank, notes what its shard_loss calls get during a checked step
(beside the elements of the forward's token-id input and whether the loss shows every one of
them counted), and after that step the ranks sum one row each, an 8k-float all-reduce. Checked
are synced steps 1, 2, 4, 8, ...: a schedule every rank knows without asking, so the ranks call
the collective together; a difference that lasts (padding that varies) is caught at the next
power of two, and a run of n steps pays log2(n) small sums. Between checks nothing is noted and
nothing hooked. The first size finding is warned once, then checking stops. A difference only
at steps between the checks (an epoch's last, short batch) is not seen.

The token verdict needs the whole world: a correct global count can equal rank 0's own input
by chance (an SFT loss masking half of every sequence on 2 ranks; a batch of one row on 2 ranks,
where rank 1's shard is empty). It is named only when on *every* rank the size is that rank's own
token count and the loss is a sum of cross-entropy terms over all of those tokens (nothing
ignored): then the global count is k times the size, without doubt.

The same sum carries, at step 1, a fingerprint of each rank's last token-id input to a forward
with autograd on (its elements, their sum, and their sum weighted by position; a prompt sampled
under no_grad is not training data): nanoGPT's `get_batch()` drawing with one seed on every
rank (its `seed_offset = rank` left out) gives every rank the same batch, so k devices train on
1/k of the data the global batch should hold. Equal on every rank: a note.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import nn

from phalanx.comm import Tag
from phalanx.data_parallel.replica_hook import ReplicaHook

_NOTING: weakref.WeakSet = weakref.WeakSet()  # every rank's SizesAcrossRanks, during a checked step
_MAX_NOTED = 4096  # sizes kept at most: a checked step's, in any real loop
_FOLLOWED = {"SumBackward0", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "ToCopyBackward0",
             "CloneBackward0"}  # a loss sum's steps down to its cross-entropy that keep every term


def note_size(global_batch_size, loss_sum: torch.Tensor) -> None:
    """Called by shard_loss (through mark_shard_loss): every noting replica keeps the size."""
    for sizes in list(_NOTING):
        sizes.note(float(global_batch_size), loss_sum)


def counted_terms(loss_sum: torch.Tensor) -> int | None:
    """How many terms a loss sum adds, where its graph shows them: a summed cross-entropy
    (`reduction="sum"`, or `"none"` then `.sum()`) with no target at `ignore_index`; else None."""
    node = loss_sum.grad_fn
    for _ in range(8):
        if node is None:
            return None
        if node.name() == "NllLossBackward0":
            break
        if node.name() not in _FOLLOWED or len(node.next_functions) != 1:
            return None
        node = node.next_functions[0][0]
    else:
        return None
    if node._saved_reduction == 1 or node._saved_weight is not None:
        return None  # a mean, or weighted classes: not a plain count
    ignore = node._saved_ignore_index
    ignore = ignore - 2 ** 64 if ignore >= 2 ** 63 else ignore  # saved as unsigned
    target = node._saved_target
    return None if bool((target == ignore).any()) else target.numel()


def sizes_differ_message(mine: float, rank: int, theirs: float, calls: int, step: int) -> str:
    got = (f"global_batch_size={mine:g}" if calls == 1 else
           f"global_batch_size values summing to {mine:g} over {calls} calls")
    return (f"phalanx.shard_loss got {got} on rank 0 but {theirs:g} on rank {rank} at synced step {step}: the "
            "global batch size is one number for the whole global batch, the same on every rank (for a count of "
            "tokens: each rank's count summed over the ranks, phalanx.reduce(count, world=world)); divided by each "
            "rank's own count the summed gradient is not the 1-device gradient")


def own_tokens_message(size: float, world_size: int, step: int) -> str:
    return (f"phalanx.shard_loss got global_batch_size={size:g} at synced step {step}, on every rank the number "
            f"of tokens that rank's forward just saw, all of them in the loss: the global count is their sum over "
            f"the {world_size} ranks (phalanx.reduce(this rank's count, world=world) sums it); divided by each "
            f"rank's own count the summed gradient is about {world_size}x the 1-device gradient")


def _fingerprint(ids: torch.Tensor) -> list[float]:
    flat = ids.detach().reshape(-1).to(torch.float64)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    return [float(flat.numel()), float(flat.sum()), float((flat * weights).sum())]


def same_batch_note(tokens: int, world_size: int) -> str:
    return (f"every rank's first forward got the same {tokens} token ids: the {world_size} ranks train on one batch, "
            f"1/{world_size} of the data a global batch holds (nanoGPT's get_batch() seeded alike on every rank); "
            "draw each rank's batch with its own seed (torch.manual_seed(seed + world.rank)) or shard one global "
            "batch (phalanx.ShardedLoader, phalanx.rank_shard)")


class SizesAcrossRanks:
    """Every rank's note of the sizes its shard_loss calls get in a checked step, compared across
    the ranks after it; see the module docstring. `module`: whose forwards' token ids are counted."""

    def __init__(self, module: nn.Module | None = None, *, world_size: int) -> None:
        self.module, self.world_size = module, world_size
        self.steps = 0  # synced steps so far
        self.given: list[tuple[float, bool]] = []  # (size, whether it is this rank's own counted tokens)
        self.tokens_forwarded: int | None = None
        self.rows_forwarded: int | None = None
        # Step 1's last token-id input with autograd on (elements, sum, sum weighted by position): the
        # training forward, not a prompt sampled under no_grad (the same on every rank by design).
        self.first_tokens: list[float] = [0.0, 0.0, 0.0]
        self._hook = None
        self._start()

    def _start(self) -> None:
        self.given = []
        self.tokens_forwarded = self.rows_forwarded = None
        _NOTING.add(self)
        if self.module is not None and self._hook is None:
            # ReplicaHook: a copy of the module (an EMA, a teacher) keeps no hook of the replica's
            self._hook = self.module.register_forward_pre_hook(ReplicaHook(self._forwarded), with_kwargs=True)

    def _stop(self) -> None:
        _NOTING.discard(self)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _forwarded(self, module, args, kwargs) -> None:
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        tokens = first is not None and first.dim() >= 2 and not first.is_floating_point() and not first.is_complex()
        self.tokens_forwarded = first.numel() if tokens else None
        self.rows_forwarded = first.shape[0] if tokens else None
        if self.steps == 0 and tokens and first.numel() and torch.is_grad_enabled():
            self.first_tokens = _fingerprint(first)

    def note(self, size: float, loss_sum: torch.Tensor) -> None:
        tokens, rows = self.tokens_forwarded, self.rows_forwarded
        # Also k times the rows: the global number of examples can be that (a per-sequence mean): not judged.
        own = tokens is not None and size == tokens and size != self.world_size * rows and \
            counted_terms(loss_sum) == tokens
        self.given.append((size, own))
        if len(self.given) >= _MAX_NOTED:  # a replica that never syncs (a teacher's) stops noting
            self._stop()

    def after_step(self, allreduce: Callable, *, rank: int, device: torch.device) -> tuple[list[str], bool]:
        """Every rank, once per synced step: at a checked step, the comparison (a collective).
        Returns the messages (rank 0 warns them) and whether checking goes on."""
        self.steps += 1
        checked = self.steps & (self.steps - 1) == 0  # a power of two
        message, same_batch = self.compare(allreduce, rank=rank, device=device) if checked else (None, None)
        notes = [same_batch] if same_batch is not None else []
        if message is not None:
            self.close()
            return [*notes, message], False
        nxt = self.steps + 1
        if nxt & (nxt - 1) == 0:
            self._start()
        elif checked:
            self._stop()
        return notes, True

    def compare(self, allreduce: Callable, *, rank: int, device: torch.device) -> tuple[str | None, str | None]:
        """Every rank: sum each rank's (calls, sum, sum of squares of its sizes, calls with its own
        counted tokens, the first size, and at step 1 its first token-id input's fingerprint) in its
        own row, a collective. Returns the sizes' message and the same-batch note (the same on every
        rank but for rank 0's first size), each or None."""
        k, sizes = self.world_size, [size for size, _ in self.given]
        rows = torch.zeros(k, 8, dtype=torch.float64)
        rows[rank] = torch.tensor([len(sizes), sum(sizes), sum(s * s for s in sizes),
                                   sum(own for _, own in self.given), sizes[0] if sizes else 0.0,
                                   *self.first_tokens], dtype=torch.float64)
        flat = rows.view(-1).to(device)
        allreduce(flat, Tag("first-step check"))
        rows = flat.view(k, 8).tolist()
        same_batch = same_batch_note(int(rows[0][5]), k) if k > 1 and self.steps == 1 and rows[0][5] and \
            all(row[5:] == rows[0][5:] for row in rows) else None
        calls = int(rows[0][0])
        if not calls or any(row[0] != calls for row in rows):
            return None, same_batch  # no calls, or as many calls on no two ranks: a loss of a rank's own, not judged
        other = next((r for r, row in enumerate(rows) if row[1:3] != rows[0][1:3]), None)
        if other is not None:
            return sizes_differ_message(rows[0][1], other, rows[other][1], calls, self.steps), same_batch
        if k > 1 and all(row[3] == calls for row in rows):
            return own_tokens_message(rows[0][4], k, self.steps), same_batch
        return None, same_batch

    def close(self) -> None:
        self._stop()
        self.module = None
