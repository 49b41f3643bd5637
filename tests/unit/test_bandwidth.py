"""telemetry/bandwidth.py: nccl-tests' bus-bandwidth factor, the one `bench allreduce`, `--trace` and
`predict` share."""

from __future__ import annotations

import pytest

from phalanx.telemetry.bandwidth import COLLECTIVES, busbw_factor


def test_busbw_factor_is_nccl_tests_formula():
    # nccl-tests PERFORMANCE.md: busbw = algbw * 2(n-1)/n for allreduce
    assert [busbw_factor(k) for k in (1, 2, 4, 8)] == [0.0, 1.0, 1.5, 1.75]
    # reduce-scatter and all-gather: (n-1)/n of the whole buffer, half an allreduce's
    assert busbw_factor(4, "reduce-scatter") == busbw_factor(4, "all-gather") == 0.75
    assert COLLECTIVES == ("allreduce", "reduce-scatter", "all-gather")


@pytest.mark.parametrize("args, words", [((0,), "world_size must be at least 1, got 0"),
                                         ((4, "broadcast"), "collective 'broadcast' is unknown")])
def test_a_bad_world_size_or_collective_is_refused(args, words):
    with pytest.raises(ValueError, match=words):
        busbw_factor(*args)
