"""DataParallel's NaN/Inf check of the gradient (data_parallel/guards/finite.py), in one process: the step
and rank it names (the other ranks stood in for by what their slots of the check's allreduce hold),
the exchange's own overflow, a world of one naming the parameter, the off switch, no host read
between check steps, and the steps since the last check checked before state leaves the replica
(state_dict, full_state_dict, close; one rank alone from its own notes)."""

from __future__ import annotations

import contextlib
import gc
import warnings

import pytest
import torch
import torch.nn.functional as F

from phalanx.data_parallel import DataParallel, DataParallelConfig
from phalanx.data_parallel.guards.finite import FiniteCheck
from phalanx.data_parallel.guards.checks import NonFinite
from phalanx.errors import PhalanxWarning
from phalanx.models import LeNet
from phalanx.runtime.world import World

NAN, INF = float("nan"), float("inf")


def _world(rank: int = 0, world_size: int = 1) -> World:
    return World(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size,
                 device=torch.device("cpu"), backend="none" if world_size == 1 else "gloo", timeout_s=10.0)


def _others(slots: dict[int, tuple[int, int]]):
    """An allreduce as the other ranks would make it: their (own, summed) first bad steps added in."""
    def allreduce(firsts: torch.Tensor) -> None:
        if firsts.numel() == 1:  # the weights' verdict: the other ranks' weights are finite
            return
        for rank, (own, summed) in slots.items():
            firsts[2 * rank] += own
            firsts[2 * rank + 1] += summed
    return allreduce


def _steps(check: FiniteCheck, own: list[float], summed: list[float], *, others=None, first: int = 1) -> None:
    """One synced step per value: two buckets each, the second holding `own[i]` before the sum and `summed[i]` after."""
    for i, (mine, total) in enumerate(zip(own, summed)):
        check.before_sum(torch.ones(3))
        check.before_sum(torch.tensor([1.0, mine]))
        check.after_sum([torch.ones(3), torch.tensor([2.0, total])], step=first + i,
                        allreduce=others or _others({}))


def test_the_interval_is_validated_where_the_replica_options_are_made():
    for bad in (-1, 1.5, True, None):
        with pytest.raises(ValueError, match="check_finite_every must be 0 \\(off\\) or a number of steps"):
            DataParallelConfig(check_finite_every=bad)


def test_names_the_first_step_and_the_rank_whose_own_gradient_went_non_finite():
    world = _world(rank=0, world_size=3)
    check = FiniteCheck(every=4, world=world)
    _steps(check, [1.0] * 4, [1.0] * 4)  # step 4's check passes and forgets steps 1-4
    with pytest.raises(NonFinite, match=r"^gradient NaN/Inf at step 6: rank 2's own gradient went non-finite "
                       r"first and the allreduce spread it to every replica \(found at step 8's check, every 4 "
                       r"steps\); look at that step's loss and data, or lower the lr; check_finite_every=0"):
        _steps(check, [1.0, 1.0, NAN, NAN], [1.0, NAN, NAN, NAN], first=5, others=_others({1: (7, 6), 2: (6, 6)}))
    # Rank 0 itself first, alongside rank 2; and every rank at once (the parameters were already NaN).
    for others, who in (({2: (3, 3)}, "rank 0's and rank 2's own gradients"),
                        ({1: (3, 3), 2: (3, 3)}, "every rank's own gradient")):
        with pytest.raises(NonFinite, match=f"at step 3: {who} went non-finite first"):
            _steps(FiniteCheck(every=4, world=world), [1.0, 1.0, INF, NAN], [1.0, 1.0, INF, NAN],
                   others=_others(others))


def test_a_step_whose_buckets_go_out_twice_keeps_one_note_per_bucket_and_names_either_backward():
    """DCGAN's two backwards overlapped: the first's buckets summed and set aside (overlap.py's settle)."""
    for bad_backward in (0, 1):
        check = FiniteCheck(every=2, world=_world(rank=0, world_size=2))
        _steps(check, [1.0], [1.0])
        for backward in (0, 1):
            check.before_sum(torch.ones(3))
            check.before_sum(torch.tensor([1.0, NAN if backward == bad_backward else 1.0]))
            if backward == 0:
                check.another_backward()
        with pytest.raises(NonFinite, match="at step 2: rank 0's own gradient went non-finite first"):
            check.after_sum([torch.ones(3), torch.tensor([2.0, NAN])], step=2, allreduce=_others({}))
    check = FiniteCheck(every=2, world=_world(rank=0, world_size=2))
    for step in (1, 2):  # finite: rows of one shape, whatever the number of backwards
        for backward in range(step):
            check.before_sum(torch.ones(3))
            check.before_sum(torch.ones(2))
            if backward < step - 1:
                check.another_backward()
        check.after_sum([torch.ones(3), torch.ones(2)], step=step, allreduce=_others({}))


def test_a_sum_that_overflows_although_every_rank_was_finite_is_named_as_such():
    check = FiniteCheck(every=2, world=_world(rank=1, world_size=2))
    with pytest.raises(NonFinite, match="at step 1: the summed gradient overflowed although every rank's own was "
                       "finite .*an fp16 exchange holds at most 65504"):
        _steps(check, [1.0, NAN], [INF, NAN], others=_others({0: (2, 1)}))


def test_a_bucketed_replica_stops_within_the_interval_and_names_the_step():
    torch.manual_seed(0)
    world = _world()
    X, y = torch.randn(6, 1, 28, 28, dtype=torch.float64), torch.randint(0, 10, (6,))
    options = DataParallelConfig(check_finite_every=3, exchange_alone=True, bucket_cap_mb=0.25)  # LeNet in 3
    with DataParallel(LeNet().double(), world=world, options=options) as dp:
        assert len(dp.buckets) == 3  # the exchanging path, as each of k ranks runs it
        optimizer = torch.optim.SGD(dp.parameters(), lr=0.01)
        with pytest.raises(NonFinite, match="at step 5: rank 0's own gradient went non-finite first .found at step "
                           "6's check, every 3 steps"):
            for step in range(1, 10):
                dp.zero_grad()
                scale = NAN if step == 5 else 1.0
                (F.cross_entropy(dp(X), y) * scale).backward()
                dp.finish_gradient_sync()
                optimizer.step()
        assert step == 6


def test_a_world_of_one_names_the_parameter_and_the_steps_it_went_non_finite_in():
    X, y = torch.randn(4, 1, 28, 28, dtype=torch.float64), torch.randint(0, 10, (4,))
    for every, when in ((1, "step 2"), (4, "one of steps 1-4")):
        with DataParallel(LeNet().double(), world=_world(), options=DataParallelConfig(check_finite_every=every)) as dp:
            assert not dp.exchanging
            optimizer = torch.optim.SGD(dp.parameters(), lr=0.01)
            with pytest.raises(NonFinite, match=f"gradient NaN/Inf at {when}, in conv1.weight's gradient"):
                for step in range(1, 5):
                    dp.zero_grad()
                    F.cross_entropy(dp(X), y).backward()
                    if step == 2:
                        dp.module.conv1.weight.grad[0, 0, 0, 0] = INF
                    dp.finish_gradient_sync()
                    optimizer.step()  # the NaN goes on into every later step's gradient


def test_off_keeps_nothing_and_checks_nothing():
    check = FiniteCheck(every=0, world=_world())
    _steps(check, [NAN] * 3, [NAN] * 3)
    check.after_local_step(lambda: {"w's gradient": torch.tensor([NAN])}, step=1)
    assert check._sums is None and check.steps_noted == 0


def _live_tensors() -> int:
    gc.collect()
    return sum(issubclass(type(o), torch.Tensor) for o in gc.get_objects())


def test_the_notes_between_checks_hold_no_more_tensors_as_steps_pass():
    """A tensor kept per step until the check lived across steps in glibc's heap and pinned the holes the
    step's large blocks left: a 2-worker MLP's peak RSS grew from 0.7 to 1.4-2.1 GB in 100 steps."""
    check = FiniteCheck(every=10 ** 6, world=_world(rank=0, world_size=2))
    _steps(check, [1.0] * 5, [1.0] * 5)
    held = _live_tensors()
    _steps(check, [1.0] * 295, [1.0] * 295, first=6)  # the table doubles twice on the way (128 rows first)
    assert _live_tensors() == held and check.steps_noted == 300
    _steps(check, [NAN], [NAN], first=301)
    with pytest.raises(NonFinite, match=r"^gradient NaN/Inf at step 301: rank 0's own gradient"):
        check.check_now(step=301, allreduce=_others({}))


def test_a_step_with_more_buckets_than_the_last_is_noted_as_the_others():
    """The layout changes with requires_grad (a frozen layer thawed): the bucket count may differ between
    steps of one interval, and the check still names the step."""
    check = FiniteCheck(every=4, world=_world(rank=0, world_size=2))
    _steps(check, [1.0], [1.0])
    for bucket in (torch.ones(3), torch.ones(2), torch.tensor([1.0, NAN])):
        check.before_sum(bucket)
    check.after_sum([torch.ones(3), torch.ones(2), torch.tensor([2.0, NAN])], step=2, allreduce=_others({}))
    with pytest.raises(NonFinite, match=r"^gradient NaN/Inf at step 2: rank 0's own gradient"):
        _steps(check, [1.0, 1.0], [1.0, 1.0], first=3)


def test_steps_between_checks_read_nothing_on_the_host(monkeypatch):
    """A host read synchronises a GPU: only the check step may make one."""
    reads = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, __name=name, __original=original, **kwargs):
            reads.append(__name)
            return __original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counting)
    check = FiniteCheck(every=5, world=_world())
    _steps(check, [1.0] * 4, [1.0] * 4)
    assert reads == [] and check.steps_noted == 4
    _steps(check, [1.0], [1.0], first=5)
    monkeypatch.undo()
    assert reads and check.steps_noted == 0


def test_the_steps_since_the_last_check_are_checked_now_on_demand():
    """check_now compares what the periodic check would, at any step: a run shorter than the
    interval, or steps after its last check, are not left unchecked."""
    world = _world(rank=0, world_size=2)
    check = FiniteCheck(every=100, world=world)
    _steps(check, [1.0] * 4, [1.0] * 4)
    calls = []
    check.check_now(step=4, allreduce=lambda t: calls.append(t), found="found by close() after step 4")
    assert len(calls) == 1 and check.steps_noted == 0  # compared and forgotten
    check.check_now(step=4, allreduce=lambda t: calls.append(t))
    assert len(calls) == 1  # nothing noted since: no collective (every rank alike, in lockstep)
    _steps(check, [1.0, 1.0, 1.0], [1.0, NAN, NAN], first=5)
    with pytest.raises(NonFinite, match=r"^gradient NaN/Inf at step 6: rank 1's own gradient went non-finite first "
                       r"and the allreduce spread it to every replica \(found by full_state_dict\(\) after step 7"):
        check.check_now(step=7, allreduce=_others({1: (6, 6)}), found="found by full_state_dict() after step 7")


def test_one_rank_alone_names_the_step_from_its_own_notes_and_keeps_them_for_every_rank():
    for rank, own, who in ((1, NAN, "rank 1's own gradient went non-finite"),
                           (0, 1.0, r"rank 1's own gradient went non-finite \(or the sum overflowed\) while rank 0's "
                                    "stayed finite")):
        check = FiniteCheck(every=100, world=_world(rank=rank, world_size=2))
        _steps(check, [1.0, 1.0, own, own], [1.0, 1.0, NAN, NAN])
        with pytest.raises(NonFinite, match=f"^gradient NaN/Inf at step 3: {who} \\(found by state_dict\\(\\) after "
                           "step 4, before the next check every 100 steps\\)"):
            check.check_local(step=4, where="state_dict()")
        assert check.steps_noted == 4  # a check across ranks still finds them
        check.check_local(step=4, where="state_dict()")  # once per step: a second call finds nothing new
    three = FiniteCheck(every=100, world=_world(rank=0, world_size=3))
    _steps(three, [1.0], [NAN])
    with pytest.raises(NonFinite, match="the summed gradient went non-finite while rank 0's own stayed finite .another "
                       "rank's did, or the sum overflowed; dp.check_finite.. on every rank names it"):
        three.check_local(step=1, where="state_dict()")


def test_a_sharded_replicas_share_of_the_sum_is_completed_by_its_parameters():
    check = FiniteCheck(every=100, world=_world(rank=0, world_size=2))
    _steps(check, [1.0], [1.0])  # this rank's share of the sum was finite; another share was not
    parameters = {"w": torch.ones(3), "v": torch.tensor([1.0, NAN])}
    with pytest.raises(NonFinite, match=r"^parameter v is NaN/Inf on rank 0 \(found by state_dict\(\) after step 1"):
        check.check_local(step=1, where="state_dict()", parameters=parameters.items)


def test_state_leaving_a_replica_is_checked_first_and_nothing_non_finite_leaves():
    """A NaN after the last periodic check (here: a run shorter than the interval) is caught by
    state_dict(), full_state_dict() and close() - each naming the step."""
    X, y = torch.randn(6, 1, 28, 28, dtype=torch.float64), torch.randint(0, 10, (6,))
    world = _world()
    alone = DataParallelConfig(exchange_alone=True)  # buckets and an exchange, as on each of k devices
    for leave in ("state_dict", "full_state_dict", "close"):
        dp = DataParallel(LeNet().double(), world=world, options=alone)  # the default: a check every 100 steps
        optimizer = torch.optim.SGD(dp.parameters(), lr=0.01)
        for step in range(1, 8):
            dp.zero_grad()
            (F.cross_entropy(dp(X), y) * (NAN if step == 3 else 1.0)).backward()
            dp.finish_gradient_sync()
            optimizer.step()
        with pytest.raises(NonFinite, match=f"^gradient NaN/Inf at step 3: rank 0's own gradient went non-finite.*"
                           f"found by {leave}\\(\\) after step 7, before the next check every 100 steps"):
            getattr(dp, leave)()
        # Checked across ranks already: closes without a second error. One rank's state_dict()
        # keeps the notes for the check every rank makes, which close() then makes.
        with pytest.raises(NonFinite) if leave == "state_dict" else contextlib.nullcontext():
            dp.close()
        assert dp._closed
        with DataParallel(LeNet().double(), world=world, options=alone) as healthy:
            healthy.zero_grad()
            F.cross_entropy(healthy(X), y).backward()
            healthy.finish_gradient_sync()
            assert set(getattr(healthy, leave)() or {}) == (set(healthy.module.state_dict()) if leave != "close"
                                                             else set())


def test_close_while_an_error_is_on_its_way_checks_nothing():
    X, y = torch.randn(6, 1, 28, 28, dtype=torch.float64), torch.randint(0, 10, (6,))
    world = _world()
    dp = DataParallel(LeNet().double(), world=world, options=DataParallelConfig(exchange_alone=True))
    dp.zero_grad()
    (F.cross_entropy(dp(X), y) * NAN).backward()
    dp.finish_gradient_sync()
    with pytest.raises(KeyError):  # the script's own error stays the one reported
        with dp:
            raise KeyError("the script's own")
    assert dp._closed


def test_a_world_of_one_checks_its_gradient_when_state_leaves():
    X, y = torch.randn(4, 1, 28, 28, dtype=torch.float64), torch.randint(0, 10, (4,))
    dp = DataParallel(LeNet().double(), world=_world())
    optimizer = torch.optim.SGD(dp.parameters(), lr=0.01)
    for step in range(1, 6):
        dp.zero_grad()
        (F.cross_entropy(dp(X), y) * (NAN if step == 2 else 1.0)).backward()
        dp.finish_gradient_sync()
        optimizer.step()
    with pytest.raises(NonFinite, match=r"gradient NaN/Inf at one of steps 1-5, in conv1.weight's gradient .* found by "
                       r"state_dict\(\) after step 5"):
        dp.state_dict()
    dp.close()


def test_non_finite_steps_that_never_reached_the_weights_were_skipped_and_are_said_once():
    """torch.amp's GradScaler skips the steps whose scaled gradient overflowed: the weights stay finite."""
    weights = [torch.ones(3)]
    sums: list[torch.Tensor] = []
    check = FiniteCheck(every=4, world=_world(rank=0, world_size=2), weights=lambda: weights)

    def others(firsts: torch.Tensor) -> None:  # rank 1 went non-finite at step 2 too; the verdict's sum
        sums.append(firsts.clone())
        if firsts.numel() == 4:
            firsts[2] += 2
            firsts[3] += 2
    with pytest.warns(PhalanxWarning, match=r"^gradient NaN/Inf at step 2: every rank's own gradient went non-finite "
                      r"first and the allreduce spread it to every replica, but no update applied it: the weights are "
                      r"finite \(the step was skipped, as torch.amp.GradScaler"):
        _steps(check, [1.0, NAN, 1.0, 1.0], [1.0, NAN, 1.0, 1.0], others=others)
    assert [s.numel() for s in sums] == [4, 1]  # the check's sum, then the weights' verdict
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        _steps(check, [NAN, 1.0, 1.0, 1.0], [NAN, 1.0, 1.0, 1.0], first=5, others=_others({1: (5, 5)}))
    weights[0][1] = NAN  # an update applied one: the run stops, naming the gradient's step
    with pytest.raises(NonFinite, match=r"^gradient NaN/Inf at step 10: rank 0's own gradient went non-finite"):
        _steps(check, [1.0, NAN, 1.0, 1.0], [1.0, NAN, 1.0, 1.0], first=9, others=_others({}))


def test_a_checked_interval_leaves_no_note_behind_for_a_step_with_fewer_buckets():
    """The notes' table keeps its rows and columns across intervals: a skipped NaN in a second bucket
    must not be found again by a later step that sends one bucket only."""
    check = FiniteCheck(every=2, world=_world(rank=0, world_size=2), weights=lambda: [torch.ones(3)])
    with pytest.warns(PhalanxWarning, match="^gradient NaN/Inf at step 1: rank 0's own gradient"):
        _steps(check, [NAN, 1.0], [NAN, 1.0])  # two buckets; skipped: the weights are finite
    sizes = []

    def allreduce(tensor: torch.Tensor) -> None:
        sizes.append(tensor.numel())
    for step in (3, 4):  # one bucket each, finite
        check.before_sum(torch.ones(3))
        check.after_sum([torch.ones(3)], step=step, allreduce=allreduce)
    assert sizes == [4] and check.steps_noted == 0  # the check's sum, no verdict on the weights: nothing found


def test_a_float64_gradient_is_noted_in_float64_so_large_finite_sums_pass():
    """The exactness tests train in float64: a sum past float32's range is still finite there."""
    check = FiniteCheck(every=2, world=_world(rank=0, world_size=2))
    big = torch.tensor([1e300, 1e300], dtype=torch.float64)
    _steps(check, [1.0], [1.0])  # float32 buckets first: the table is widened to float64 when one comes
    check.before_sum(big)
    check.after_sum([big * 2], step=2, allreduce=_others({}))
    assert check.steps_noted == 0  # checked at step 2, nothing found
    check.before_sum(torch.tensor([1.0, INF], dtype=torch.float64))
    check.after_sum([torch.tensor([1.0, INF], dtype=torch.float64)], step=3, allreduce=_others({}))
    with pytest.raises(NonFinite, match="^gradient NaN/Inf at step 3: rank 0's own gradient"):
        check.check_now(step=3, allreduce=_others({}))


def test_a_non_finite_gradient_at_the_checking_step_is_decided_after_its_update():
    for applied, raised in ((False, False), (True, True)):
        weights = [torch.ones(2)]
        check = FiniteCheck(every=2, world=_world(), weights=lambda: weights)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PhalanxWarning)
            _steps(check, [1.0, NAN], [1.0, NAN])  # step 2 checks itself: its update is yet to come
            assert check._deferred is not None
            if applied:
                weights[0][0] = INF
            with pytest.raises(NonFinite, match=r"^gradient NaN/Inf at step 2: ") if raised else \
                    contextlib.nullcontext():
                _steps(check, [1.0], [1.0], first=3)
            assert check._deferred is None


def test_one_rank_alone_passes_a_skipped_step_whose_weights_are_finite():
    weights = [torch.ones(2)]
    check = FiniteCheck(every=100, world=_world(rank=0, world_size=2), weights=lambda: weights)
    _steps(check, [1.0, NAN, 1.0], [1.0, NAN, 1.0])
    check.check_local(step=3, where="state_dict()")  # skipped: nothing to stop
    weights[0][0] = NAN
    check._local_at = 0
    with pytest.raises(NonFinite, match=r"^gradient NaN/Inf at step 2: rank 0's own gradient went non-finite"):
        check.check_local(step=3, where="state_dict()")


def test_the_amp_recipe_trains_through_its_skipped_overflow_steps():
    """fp16 autocast and a GradScaler whose first scales overflow: skipped steps, finite weights, no stop."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    for alone in (True, False):  # the exchanging path, and a world of one's plain loop
        options = DataParallelConfig(check_finite_every=2, exchange_alone=alone)
        with DataParallel(model, world=_world(), options=options) as dp, warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            optimizer = torch.optim.SGD(dp.parameters(), lr=0.01)
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 60)
            g = torch.Generator().manual_seed(1)
            for _ in range(8):
                X, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
                dp.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = F.cross_entropy(dp(X), y)
                scaler.scale(loss).backward()
                dp.finish_gradient_sync()
                scaler.step(optimizer)
                scaler.update()
            assert scaler.get_scale() < 2.0 ** 60  # it did skip overflowing steps
            assert all(bool(p.isfinite().all()) for p in dp.parameters())
            dp.state_dict()  # checked as it leaves: skipped steps are not a NaN in the model
        assert [str(w.message) for w in said if w.category is PhalanxWarning][0].endswith(
            "a NaN/Inf that reaches the weights still stops it")
