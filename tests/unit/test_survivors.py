"""The survivors' save's rules (job/survivors.py), without processes: what a rank posts on the board
and a peer reads back, which survivor writes and when none may, whether generators moved, and
which runs arm it. The save itself, after a real worker's death, is tests/distributed/test_survivors_save.py's."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from phalanx.job.survivors import SurvivorsSave, decide, reason_not_armed, rng_changed
from phalanx.runtime.board import FAILED, LINE_WORDS, Board
from phalanx.runtime.world import World
from phalanx.train.rng_state import rng_state, set_rng_state


def boards(k: int) -> list[Board]:
    memory = bytearray(LINE_WORDS * 8 * k)
    return [Board(memory, rank=r, local_rank=r, local_world_size=k, world_size=k) for r in range(k)]


def test_a_post_is_read_back_by_a_peer_whole_and_nothing_before_the_first():
    mine, peer = boards(2)
    assert peer.posted(0) is None
    mine.post(17, [2503.25, 114.0, 1088.0, 0.78])
    assert peer.posted(0) == (17, [2503.25, 114.0, 1088.0, 0.78])
    mine.post(18, [2600.5, 120.0, 1152.0, 0.81])
    assert peer.posted(0) == (18, [2600.5, 120.0, 1152.0, 0.81])
    assert peer.posted(1) is None  # its own line: nothing posted


def test_a_post_cut_short_reads_as_none_not_as_the_old_step_with_new_sums():
    mine, peer = boards(2)
    mine.post(5, [1.0, 2.0, 3.0, 4.0])
    mine._words[mine._base + 12] = 0  # what a rank killed between clearing its step and writing the new one leaves
    assert peer.posted(0) is None


def test_the_written_mark_is_per_rank():
    a, b = boards(2)
    assert (a.written(0), a.written(1)) == (0, 0)
    b.mark_written(34)
    assert (a.written(0), a.written(1)) == (0, 34)


def test_the_lowest_live_rank_writes_when_every_rank_posted_its_step():
    assert decide(rank=0, posts=[17, 17, 17], alive=[0, 2], saved_step=10, written=[0, 0, 0]) is None
    assert decide(rank=1, posts=[17, 17, 17], alive=[1, 2], saved_step=10, written=[0, 0, 0]) is None
    assert decide(rank=2, posts=[17, 17, 17], alive=[0, 2], saved_step=10, written=[0, 0, 0]) == \
        "rank 0 is alive and writes it"


@pytest.mark.parametrize("posts, saved_step, written, why", [
    ([17, 16], 10, [0, 0], "rank 1 posted step 16, not 17"),  # died between its exchange and its post
    ([17, None], 10, [0, 0], "rank 1 posted step None, not 17"),  # died before its first step's post
    ([None, None], 0, [0, 0], "no step was trained yet"),
    ([10, 10], 10, [0, 0], "the newest checkpoint already holds step 10"),  # e.g. died right after the save
    ([17, 17], 10, [0, 17], "rank 1 saved step 17"),  # a survivor that wrote, then exited
])
def test_no_save_where_it_would_not_be_exact_or_is_already_made(posts, saved_step, written, why):
    assert decide(rank=0, posts=posts, alive=[0], saved_step=saved_step, written=written) == why


def test_generators_that_moved_are_told_apart_from_ones_that_did_not():
    start = rng_state()
    assert not rng_changed(start, rng_state())
    try:
        for draw in (lambda: torch.rand(1), lambda: np.random.rand(), lambda: random.random()):
            set_rng_state(start)
            draw()
            assert rng_changed(start, rng_state())
    finally:
        set_rng_state(start)


def _world(k: int, *, board: bool = True, device: str = "cpu") -> World:
    return World(rank=0, world_size=k, local_rank=0, local_world_size=k, device=torch.device(device), backend="gloo",
                 timeout_s=5.0, board=boards(k)[0] if board else None)


@pytest.mark.parametrize("world, options, why", [
    (_world(2), {}, None),
    (_world(2), {"location": None}, "nowhere to save"),
    (_world(1), {}, "not CPU workers of one host"),
    (_world(2, board=False), {}, "not CPU workers of one host"),  # several hosts, or no /dev/shm
    (_world(2, device="cuda"), {}, "not CPU workers of one host"),
    (_world(2), {"data_split": False}, "no rank holds the whole state"),
    (_world(2), {"sharded": True}, "no rank holds the whole state"),
    (_world(2), {"batchnorm": "sync"}, None),  # the same statistics on every rank
    (_world(2), {"batchnorm": "local"}, "BatchNorm's running statistics are each rank's own (--batchnorm local)"),
])
def test_which_runs_arm_it(world, options, why):
    settings = {"data_split": True, "sharded": False, "batchnorm": None, "location": "runs/r1/checkpoints",
                **options}
    assert reason_not_armed(world, **settings) == why


def test_a_training_forward_since_the_last_post_is_seen_and_an_evaluation_is_not():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    armed = SurvivorsSave(world=_world(2), steps_per_epoch=24, start_rng=[rng_state()] * 2, location="ck",
                          write=lambda *args: None, module=model)
    armed.keep_statistics()
    model(torch.randn(5, 3))  # step 1's forward
    armed.post(0, 1, [1.0, 2.0, 5.0, 0.1])
    assert armed.forwards == armed.forwards_at_post == 1
    model.eval()
    model(torch.randn(5, 3))  # an evaluation leaves the running statistics as they are
    assert armed.forwards == armed.forwards_at_post
    model.train()
    model(torch.randn(5, 3))  # step 2's forward, cut short by a peer's death before its post
    assert armed.forwards == armed.forwards_at_post + 1


def _unused_pid() -> int:
    return next(pid for pid in range(4_000_000, 4_100_000) if not os.path.exists(f"/proc/{pid}"))


def _survivor_of_rank_1(model: torch.nn.Module, tmp_path, written: list) -> tuple[SurvivorsSave, Board]:
    """Rank 0's SurvivorsSave, and the board line of a rank 1 whose process is gone."""
    memory = bytearray(LINE_WORDS * 8 * 2)
    mine = Board(memory, rank=0, local_rank=0, local_world_size=2, world_size=2)
    dead = Board(memory, rank=1, local_rank=1, local_world_size=2, world_size=2, pid=_unused_pid())
    world = World(rank=0, world_size=2, local_rank=0, local_world_size=2, device=torch.device("cpu"), backend="gloo",
                  timeout_s=5.0, board=mine)
    armed = SurvivorsSave(world=world, steps_per_epoch=24, start_rng=[rng_state(), rng_state()],
                          location=str(tmp_path), module=model,
                          write=lambda position, every, note: written.append((position, every, note)) or "ck.pt")
    return armed, dead


def test_the_survivor_writes_the_posted_step_with_the_dead_ranks_sums(tmp_path):
    written: list = []
    armed, dead = _survivor_of_rank_1(torch.nn.Linear(3, 2), tmp_path, written)
    armed.post(0, 17, [2503.25, 114.0, 1088.0, 0.78])
    dead.post(17, [2501.93, 122.0, 1088.0, 0.79])
    assert armed.after_peer_lost() == "saved ck.pt (epoch 1, step 17)"
    (position, every, note), = written
    assert (position.epoch, position.step, position.epoch_totals) == (0, 17, (2503.25, 114.0, 1088.0, 0.78))
    assert [r["epoch_totals"] for r in every] == [[2503.25, 114.0, 1088.0, 0.78], [2501.93, 122.0, 1088.0, 0.79]]
    assert (note["lost_ranks"], note["by_rank"]) == ([1], 0)
    assert armed.world.board.written(0) == 17  # a survivor that looks later does not write it again


def test_a_batchnorm_model_whose_next_forward_had_begun_is_saved_with_the_posted_steps_statistics(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    written: list = []
    armed, dead = _survivor_of_rank_1(model, tmp_path, written)
    armed.keep_statistics()
    x = torch.linspace(-1, 1, 15).reshape(5, 3)  # no random numbers: the generators stay where they began
    model(x)  # step 17's forward
    posted = {name: b.clone() for name, b in model.named_buffers()}
    armed.post(0, 17, [1.0, 2.0, 3.0, 0.5])
    dead.post(17, [1.0, 2.0, 3.0, 0.5])
    model(x * 3)  # step 18's forward: the peer died in it
    assert not torch.equal(model[1].running_var, posted["1.running_var"])
    assert armed.after_peer_lost() == "saved ck.pt (epoch 1, step 17)" and len(written) == 1
    assert all(torch.equal(b, posted[name]) for name, b in model.named_buffers())  # step 17's, as written


def test_a_stalled_rank_0_alive_but_frozen_is_lost_and_rank_1_writes(tmp_path):
    memory = bytearray(LINE_WORDS * 8 * 2)
    frozen = Board(memory, rank=0, local_rank=0, local_world_size=2, world_size=2, pid=os.getppid())  # alive
    mine = Board(memory, rank=1, local_rank=1, local_world_size=2, world_size=2)
    world = World(rank=1, world_size=2, local_rank=1, local_world_size=2, device=torch.device("cpu"), backend="gloo",
                  timeout_s=5.0, board=mine)
    written: list = []
    model = torch.nn.Linear(3, 2)  # before the states are taken: its initialisation draws random numbers
    armed = SurvivorsSave(world=world, steps_per_epoch=24, start_rng=[rng_state(), rng_state()], location=str(tmp_path),
                          module=model, write=lambda *args: written.append(args) or "ck.pt")
    frozen.post(30, [1.0, 2.0, 3.0, 0.5])
    armed.post(1, 6, [1.5, 2.0, 3.0, 0.5])
    assert armed.after_peer_lost() == "rank 0 is alive and writes it" and written == []  # a death elsewhere
    assert armed.after_peer_lost(stalled=0) == "saved ck.pt (epoch 2, step 6)"  # PeerStalled(culprit=0)
    assert written[0][2]["lost_ranks"] == [0]
    mine.mark_written(0)  # forget that save: the case below on a board of its own
    frozen.mark(FAILED)  # rank 0 raised an error of its own: lost though its process still lives
    assert armed.after_peer_lost() == "saved ck.pt (epoch 2, step 6)" and written[1][2]["lost_ranks"] == [0]
