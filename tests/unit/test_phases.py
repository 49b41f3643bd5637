"""Where a side-by-side contender's step went (measure/phases.py): spans summed per phase, the
block's remainder, and the ranks' mean per block, the blocks' median."""

from __future__ import annotations

import pytest

from phalanx.measure import phases, side_by_side
from phalanx.measure.job_steps import StepJob
from phalanx.measure.phases import OTHER, PHASES, PhaseClock, phase_ms_per_step, with_other
from phalanx.measure.side_by_side import take_turns


class FakeTime:
    """perf_counter that moves only when told."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def fake_time(monkeypatch):
    clock = FakeTime()
    monkeypatch.setattr(phases, "time", clock)
    monkeypatch.setattr(side_by_side, "time", clock)
    return clock


def test_spans_add_up_per_phase_until_taken(fake_time):
    clock = PhaseClock()
    for seconds in (0.5, 0.25):
        with clock.span("backward"):
            fake_time.now += seconds
    with clock.span("wait"):
        fake_time.now += 1.0
    assert clock.take() == {"forward": 0.0, "backward": 0.75, "wait": 1.0, "optimizer": 0.0}
    assert clock.take() == dict.fromkeys(PHASES, 0.0)


def test_a_span_that_raises_still_counts_its_time(fake_time):
    clock = PhaseClock()
    with pytest.raises(RuntimeError), clock.span("forward"):
        fake_time.now += 0.125
        raise RuntimeError("boom")
    assert clock.take()["forward"] == 0.125


def test_a_phase_of_another_name_is_refused_naming_the_phases():
    with pytest.raises(ValueError, match="phase 'data' is not one of forward, backward, wait, optimizer"):
        PhaseClock().span("data")


def test_other_is_what_no_span_covered_and_never_negative():
    assert with_other({"forward": 1.0, "backward": 2.0}, 3.5) == {"forward": 1.0, "backward": 2.0, OTHER: 0.5}
    assert with_other({"forward": 1.0}, 0.9)[OTHER] == 0.0  # a clock's rounding, not time given back


def test_milliseconds_per_step_average_the_ranks_then_take_the_blocks_median():
    # 2 ranks x 3 blocks of 10 steps: the late rank waits 0 s, its peer 0.2 s (mean 0.1); block 3 is an outlier.
    rank0 = [{"wait": 0.0}, {"wait": 0.0}, {"wait": 0.0}]
    rank1 = [{"wait": 0.2}, {"wait": 0.2}, {"wait": 5.0}]
    assert phase_ms_per_step([rank0, rank1], steps=10) == {"wait": pytest.approx(10.0)}


def test_taking_turns_keeps_each_blocks_phases_without_the_warm_up(fake_time):
    clock = PhaseClock()

    def step():
        with clock.span("forward"):
            fake_time.now += 1.0
        fake_time.now += 0.5  # outside every span: "other"

    job = StepJob(model="lenet", global_batch_size=8, warmup_steps=3, steps=2, lr=0.1, seed=0)
    turns = take_turns({"a": step, "b": lambda: None}, job, 2, barrier=lambda: None, clocks={"a": clock})
    assert turns.seconds == {"a": [3.0, 3.0], "b": [0.0, 0.0]}
    assert turns.phases == {"a": [{"forward": 2.0, "backward": 0.0, "wait": 0.0, "optimizer": 0.0, OTHER: 1.0}] * 2}
