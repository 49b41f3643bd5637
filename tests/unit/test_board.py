"""The collective board's bookkeeping and the watchdog's rules, without processes: several ranks'
views of one board in this process (each `Board` writes its own line), and the forgotten-sync
guard on a world of one. Peers played by real child processes (stopped, reaped) are
tests/distributed/test_watchdog_peers.py's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from phalanx.comm import CollectiveMismatch, PeerFinished, PeerGone, PeerStalled
from phalanx.runtime.board import (COMM, FAILED, FINISHED, LINE_WORDS, RING_SLOTS, RUNNING, WAITING, WORLD, Board,
                                   Ticket)
from phalanx.runtime.tags import PHASES, Tag, describe, phase_code
from phalanx.comm.watchdog import check, check_pairing, pairing_error
from phalanx.models import LeNet
from phalanx.data_parallel import DataParallel, DataParallelConfig
from phalanx.runtime.world import World


def boards(k: int, pids=None) -> list[Board]:
    memory = bytearray(LINE_WORDS * 8 * k)
    return [Board(memory, rank=r, local_rank=r, local_world_size=k, world_size=k,
                  pid=None if pids is None else pids[r]) for r in range(k)]


def synced(board: Board, steps: int) -> None:
    """What settling step `steps`'s gradient exchange records on `board` (calls.settle), without
    entering a collective that would shift the peers' numbering."""
    board.settled(Ticket(COMM, 0, Tag("gradient", step=steps - 1).code(0), 0))


def world_of(board: Board, timeout_s: float = 5.0) -> World:
    return World(rank=board.rank, world_size=board.world_size, local_rank=board.local_rank,
                 local_world_size=board.local_world_size, device=torch.device("cpu"), backend="gloo",
                 timeout_s=timeout_s, board=board)


def test_entries_count_per_channel_and_peers_read_each_tag():
    a, b = boards(2)
    first = a.enter(COMM, Tag("gradient", 2), 5632)
    second = a.enter(COMM, Tag("gradient"), 512)
    metrics = a.enter(WORLD, Tag("metrics"), 24)
    assert (first.seq, second.seq, metrics.seq) == (1, 2, 1)  # each channel numbers its own calls
    assert b.tag_of(0, COMM, 1) == (first.code, 5632)  # another rank's view reads rank 0's line
    assert b.tag_of(0, COMM, 3) is None  # not entered yet
    line = b.line(0)
    assert line.entered == (1, 2) and line.state == RUNNING and line.block is None


def test_the_ring_forgets_old_tags_instead_of_returning_wrong_ones():
    a, b = boards(2)
    tickets = [a.enter(COMM, Tag("gradient", i % 7), 4) for i in range(RING_SLOTS + 3)]
    assert b.tag_of(0, COMM, tickets[0].seq) is None  # overwritten by a later call: not readable
    assert b.tag_of(0, COMM, tickets[-1].seq) == (tickets[-1].code, 4)


def test_tags_read_as_the_collective_they_stand_for():
    a, = boards(1)
    synced(a, 75)
    assert describe(a.enter(COMM, Tag("gradient", 2), 5632).code, 5632) == "step 76's gradient bucket 2 (5.5 KiB)"
    assert describe(a.enter(WORLD, Tag("evaluation"), 24).code, 24) == "evaluation after step 75 (24 B)"
    assert describe(a.enter(WORLD, Tag("checkpoint"), 0).code) == "checkpoint after step 75"
    with pytest.raises(ValueError, match="unknown collective phase 'evaluate'; use one of gradient, evaluation"):
        phase_code("evaluate")
    # every phase fits the code's five bits, and reads back as itself, beside the largest bucket index
    for phase in PHASES[1:]:
        code = Tag(phase, 32767, step=9).code(0)
        assert describe(code).startswith("step 10's gradient" if phase == "gradient" else phase), phase
        assert (code >> 40) & 32767 == 32767 and code & ((1 << 40) - 1) == 9
    assert describe(Tag("SyncBatchNorm backward").code(75), 40) == "SyncBatchNorm backward after step 75 (40 B)"
    with pytest.raises(ValueError, match="collective index 32768 outside 0..32767"):
        Tag("gradient", 32768)


def test_the_tag_a_caller_passes_names_its_call():
    a, = boards(1)
    bucket = a.enter(COMM, Tag("gradient", 3, step=0), 8)  # as DataParallel launches a bucket
    plain = a.enter(COMM, Tag(), 8)  # a call that says nothing of itself
    assert (describe(bucket.code), describe(plain.code)) == ("step 1's gradient bucket 3", "allreduce")
    with pytest.raises(ValueError, match="unknown collective phase 'grad'"):
        Tag("grad")


def test_a_reduce_scatter_never_pairs_with_an_allreduce_of_the_same_bucket():
    a, b = boards(2)
    bucket = Tag("gradient", 1, step=0)
    mine = a.enter(COMM, bucket.doing("reduce-scatter"), 64)
    b.enter(COMM, bucket, 64)
    error = pairing_error(a, mine)
    assert error is not None and str(error).startswith(
        "ranks are in different collectives: rank 1 is in step 1's gradient bucket 1 (64 B); "
        "rank 0 in reduce-scatter of step 1's gradient bucket 1 (64 B)")
    # Generic calls of one kind pair by size, as allreduces always did.
    c, d = boards(2)
    mine = c.enter(COMM, Tag("reduce-scatter", op="reduce-scatter"), 64)
    d.enter(COMM, bucket.doing("reduce-scatter"), 64)
    assert pairing_error(c, mine) is None
    assert describe(Tag("all-gather", op="all-gather").code(0), 8) == "all-gather (8 B)"


def test_a_wait_is_published_with_a_new_serial_each_time():
    a, b = boards(2)
    ticket = a.enter(WORLD, Tag("evaluation"), 24)
    a.block(ticket)
    seen = b.line(0)
    assert seen.state == WAITING and seen.block == ticket
    a.unblock()
    a.block(ticket)
    assert b.line(0).serial == seen.serial + 1
    a.unblock()
    assert b.line(0).state == RUNNING and b.line(0).block is None


def test_the_same_number_with_another_tag_is_a_mismatch_naming_both():
    a, b = boards(2)
    mine = a.enter(WORLD, Tag("evaluation"), 24)
    b.enter(WORLD, Tag("evaluation"), 24)
    check_pairing(world_of(a), mine)  # the same collective: nothing to say
    bucket = b.enter(WORLD, Tag("gradient", step=1), 512)
    evaluation = a.enter(WORLD, Tag("evaluation"), 24)
    with pytest.raises(CollectiveMismatch) as info:
        check_pairing(world_of(a), evaluation)
    assert str(info.value).startswith("ranks are in different collectives: rank 1 is in step 2's gradient bucket 0 "
                                      "(512 B); rank 0 in evaluation (24 B)")
    with pytest.raises(CollectiveMismatch, match="rank 0 is in evaluation"):
        check_pairing(world_of(b), bucket)


def test_the_quick_read_agrees_only_when_every_rank_entered_the_same_call():
    ranks = boards(8)
    tickets = [b.enter(COMM, Tag("gradient", 3, step=7), 4096) for b in ranks]
    assert all(b.all_entered_as(t) for b, t in zip(ranks, tickets))
    late = [b.enter(COMM, Tag("gradient", 4, step=7), 4096) for b in ranks[:7]]  # rank 7 has not entered
    assert not ranks[0].all_entered_as(late[0])
    assert pairing_error(ranks[0], late[0]) is None  # a peer not there yet is no mismatch
    other = ranks[7].enter(COMM, Tag("gradient", 5, step=7), 4096)
    assert not ranks[0].all_entered_as(late[0]) and not ranks[7].all_entered_as(other)
    assert pairing_error(ranks[0], late[0]) is not None
    for b in ranks:  # far ahead: the ring no longer holds the call
        for _ in range(RING_SLOTS):
            b.enter(COMM, Tag("gradient", 4, step=7), 4096)
    assert not ranks[0].all_entered_as(late[0])


def test_sizes_differ_for_the_same_tag():
    a, b = boards(2)
    mine = a.enter(WORLD, Tag("metrics"), 24)
    b.enter(WORLD, Tag("metrics"), 32)
    with pytest.raises(CollectiveMismatch, match="rank 1 is in metrics \\(32 B\\), from phalanx.reduce; rank 0 in metrics \\(24 B\\), from phalanx.reduce"):
        check_pairing(world_of(a), mine)


def test_ranks_blocked_in_collectives_the_other_never_entered_are_a_deadlock():
    a, b = boards(2)
    for board in (a, b):
        synced(board, 7)
    bucket = a.enter(COMM, Tag("gradient"), 524)  # rank 0 ran a step more...
    a.block(bucket)
    evaluation = b.enter(WORLD, Tag("evaluation"), 24)  # ...while rank 1 went on to evaluate
    b.block(evaluation)
    with pytest.raises(CollectiveMismatch) as info:
        check(world_of(a), bucket, waited_s=0.5, timeout_s=60)
    assert "rank 1 is in evaluation after step 7 (24 B), from phalanx.evaluate or evaluate_dataset; rank 0 in step 8's gradient bucket 0 (524 B)" in str(info.value)
    with pytest.raises(CollectiveMismatch, match="rank 0 is in step 8's gradient bucket 0"):
        check(world_of(b), evaluation, waited_s=0.5, timeout_s=60)


def test_no_deadlock_while_a_rank_still_runs_or_every_rank_entered():
    a, b, c = boards(3)
    mine = a.enter(COMM, Tag("gradient"), 64)
    a.block(mine)
    theirs = b.enter(WORLD, Tag("evaluation"), 24)
    b.block(theirs)
    check(world_of(a), mine, waited_s=0.5, timeout_s=60)  # rank 2 runs: it may still come
    c.enter(COMM, Tag("gradient"), 64)
    c.block(c.enter(WORLD, Tag("metrics"), 8))
    with pytest.raises(CollectiveMismatch):  # now nobody can move
        check(world_of(a), mine, waited_s=0.5, timeout_s=60)
    b.unblock()
    b.enter(COMM, Tag("gradient"), 64)
    b.block(b.enter(COMM, Tag("gradient", 1), 64))  # every rank entered bucket 0: it completes
    check(world_of(a), mine, waited_s=0.5, timeout_s=60)


def test_a_peer_that_finished_or_failed_is_named_as_such():
    a, b = boards(2)
    synced(b, 7)
    mine = a.enter(COMM, Tag("gradient"), 524)
    b.mark(FINISHED)
    with pytest.raises(PeerFinished, match="rank 1 finished its work normally after step 7 while rank 0 waits for it "
                                           "in step 1's gradient bucket 0"):
        check(world_of(a), mine, waited_s=0.5, timeout_s=60)
    b.mark(FAILED)
    with pytest.raises(PeerGone, match="rank 1 failed after step 7 while rank 0 waited"):
        check(world_of(a), mine, waited_s=0.5, timeout_s=60)


def test_a_peer_that_entered_and_then_finished_is_no_error():
    a, b = boards(2)
    mine = a.enter(WORLD, Tag("metrics"), 8)
    b.enter(WORLD, Tag("metrics"), 8)
    b.mark(FINISHED)  # it took part, then its work ended: this wait can still complete
    check(world_of(a), mine, waited_s=0.5, timeout_s=60)


def test_at_the_deadline_a_running_peer_is_named_busy_with_the_timeout_and_the_rank_alone_cause():
    # Before 2026-12-03 rank 0 sampling alone past --timeout read "worker rank 0 stopped responding".
    a, b = boards(2)  # rank 1's line speaks for this (running) process
    mine = a.enter(WORLD, Tag("broadcast"), 64)
    with pytest.raises(PeerStalled, match="^worker rank 1 was outside any collective \\(state: (running|sleeping)\\) "
                                          "while rank 0 waited 3 s in broadcast from rank 0 \\(64 B\\), past the 3 s "
                                          "timeout: work on rank 1 alone \\(sampling, an evaluation or a save on rank 0 "
                                          "only\\?\\) took that long, or it never made the call; raise --timeout"):
        check(world_of(a), mine, waited_s=3.1, timeout_s=3)


def test_at_the_deadline_a_peer_whose_wait_ended_in_a_collective_this_rank_never_entered_is_a_mismatch():
    # Both deadlines run out together: read between the end of rank 1's wait and its FAILED mark, rank 1
    # shows RUNNING, and the line said "outside any collective ... work on rank 1 alone".
    a, b = boards(2)
    mine = a.enter(WORLD, Tag("broadcast"), 64)
    b.block(b.enter(COMM, Tag("gradient", step=4), 524))
    b.unblock()
    with pytest.raises(CollectiveMismatch, match="^ranks are in different collectives: rank 1 is in step 5's gradient "
                                                 "bucket 0 \\(524 B\\); rank 0 in broadcast from rank 0 \\(64 B\\)"):
        check(world_of(a), mine, waited_s=3.1, timeout_s=3)
    a.enter(COMM, Tag("gradient", step=4), 524)  # one this rank entered too completed: rank 1 is busy after it
    with pytest.raises(PeerStalled, match="^worker rank 1 was outside any collective"):
        check(world_of(a), mine, waited_s=3.1, timeout_s=3)


def _lenet_step(dp: DataParallel, optimizer, *, sync: bool) -> None:
    dp.zero_grad()
    X = torch.rand(4, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    F.cross_entropy(dp(X), torch.tensor([0, 1, 2, 3]), reduction="sum").backward()
    if sync:
        dp.finish_gradient_sync()
    optimizer.step()


def test_an_optimizer_given_the_replicas_parameters_later_is_guarded_from_then_on():
    """Judged again when its groups change (a backbone unfrozen into an optimizer that held a head alone): the
    guard's verdict was once kept per id() for good, so this optimizer's steps went unguarded."""
    world = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
                  backend="none", timeout_s=5.0)
    with DataParallel(LeNet(), world=world, options=DataParallelConfig(overlap=False, exchange_alone=True)) as dp:
        head = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(head.parameters(), lr=0.1)
        F.cross_entropy(dp(torch.rand(2, 1, 28, 28)), torch.tensor([0, 1]), reduction="sum").backward()
        optimizer.step()  # pending, but not this replica's optimizer: judged, and let through
        optimizer.add_param_group({"params": list(dp.module.parameters())})
        with pytest.raises(RuntimeError, match="^optimizer.step\\(\\) after a backward whose gradients were never summed"):
            optimizer.step()
        dp.finish_gradient_sync()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_forgotten_finish_gradient_sync_is_refused_at_the_optimizer_step(overlap):
    world = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
                  backend="none", timeout_s=5.0)
    options = DataParallelConfig(overlap=overlap, exchange_alone=True)
    with DataParallel(LeNet(), world=world, options=options) as dp:
        optimizer = torch.optim.SGD(dp.module.parameters(), lr=0.1)
        other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        _lenet_step(dp, optimizer, sync=True)  # the right order passes
        before = [p.detach().clone() for p in dp.module.parameters()]
        with pytest.raises(RuntimeError, match="optimizer.step\\(\\) after a backward whose gradients were never summed "
                                               "across ranks: call dp.finish_gradient_sync\\(\\) between"):
            _lenet_step(dp, optimizer, sync=False)
        assert all(torch.equal(a, b) for a, b in zip(before, dp.module.parameters()))  # refused before the update
        other.step()  # an optimizer that does not step this replica is none of its business
        with torch.no_grad():  # an update by hand (the book's sgd) reads the unsummed gradient
            for param in dp.module.parameters():
                param -= 0.1 * param.grad
        with pytest.raises(RuntimeError, match="^zero_grad\\(\\) after a backward whose gradients were never summed"):
            dp.zero_grad()
        dp.finish_gradient_sync()
        # A backward whose gradients nothing used (this replica under another model's loss, as a GAN's
        # discriminator under its generator's) is summed, then zeroed at zero_grad, as on one device.
        F.cross_entropy(dp(torch.rand(2, 1, 28, 28)), torch.tensor([0, 1]), reduction="sum").backward()
        dp.zero_grad()
        assert all(not p.grad.any() for p in dp.module.parameters()) and not dp.exchange_in_flight
        _lenet_step(dp, optimizer, sync=True)  # and the next step runs as ever
        with dp.no_sync():  # accumulating locally: summed by the next sync, which a step must wait for
            dp.zero_grad()
            F.cross_entropy(dp(torch.rand(2, 1, 28, 28)), torch.tensor([0, 1]), reduction="sum").backward()
        with pytest.raises(RuntimeError, match="^optimizer.step\\(\\) on gradients accumulated with the sync off \\(inside dp.no_sync"):
            optimizer.step()
        dp.finish_gradient_sync()
        optimizer.step()


def test_a_generic_allreduce_is_compared_by_size_alone():
    a, b = boards(2)
    mine = a.enter(WORLD, Tag("allreduce"), 48)  # e.g. SyncBatchNorm's, which checks its pairing itself
    b.enter(WORLD, Tag("metrics"), 48)
    check_pairing(world_of(a), mine)
    other = a.enter(WORLD, Tag("allreduce"), 48)
    b.enter(WORLD, Tag("metrics"), 56)
    with pytest.raises(CollectiveMismatch, match="rank 1 is in metrics \\(56 B\\), from phalanx.reduce; rank 0 in allreduce \\(48 B\\)"):
        check_pairing(world_of(a), other)


def test_at_the_deadline_a_collective_every_rank_entered_blames_no_peer():
    a, b = boards(2)
    mine = a.enter(WORLD, Tag("metrics"), 8)
    b.enter(WORLD, Tag("metrics"), 8)
    with pytest.raises(PeerStalled, match="rank 0 waited 4 s in metrics \\(8 B\\): every rank entered it, but it did "
                                          "not complete within the 4 s timeout"):
        check(world_of(a), mine, waited_s=4.2, timeout_s=4)


def test_a_save_on_rank_0_alone_names_the_call_and_its_fix():
    # nanoGPT's `if master_process: save` with phalanx.checkpoint inside: the line named the calls behind
    # rank 0's NaN/Inf check but not the fix, make the call on every rank.
    a, b = boards(2)
    for board in (a, b):
        synced(board, 4)
    check_of_save = a.enter(WORLD, Tag("NaN/Inf check", step=4), 32)
    a.block(check_of_save)
    bucket = b.enter(COMM, Tag("gradient", step=4), 1024)
    b.block(bucket)
    with pytest.raises(CollectiveMismatch) as info:
        check(world_of(b), bucket, waited_s=0.5, timeout_s=60)
    assert str(info.value) == (
        "ranks are in different collectives: rank 0 is in NaN/Inf check after step 4 (32 B), from phalanx.checkpoint, "
        "dp.full_state_dict() or dp.close() (each checks the gradient first); rank 1 in step 5's gradient bucket 0 "
        "(1.0 KiB); every rank must make the same collective calls in the same order: if rank 0 made that call alone "
        "(under `if world.is_main:`), make it on every rank; phalanx.checkpoint writes the file from rank 0 itself")
    c, d = boards(2)  # two calls of a script's, neither a training step: no guess which one is alone
    mine = c.enter(WORLD, Tag("metrics", step=4), 24)
    d.enter(WORLD, Tag("evaluation", step=4), 24)
    error = pairing_error(c, mine)
    assert error is not None and str(error).endswith("every rank must make the same collective calls in the same order")
