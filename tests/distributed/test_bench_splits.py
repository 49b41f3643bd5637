"""`phalanx bench splits` counts every byte each split sends, and the counts equal the formulas.

k = 2 and 4, a global batch of 30 (uneven over 4 devices: 8, 8, 7, 7) and LeNet's uneven channel
splits (50 and 10 over 4): the transport's count for each device must equal `expected_bytes`,
step after step. The formula is written from the algorithms; a gather sent twice, a
reduce-scatter replaced by an allreduce, or an activation sent with the wrong batch would each
break the equality.
"""

import pytest

from phalanx.bench.splits import SplitsBenchConfig, expected_bytes, run_splits_bench
from phalanx.bench.splits_report import plot_splits, report_splits
from phalanx.models import LeNet

pytestmark = pytest.mark.distributed

PARAMETERS = sum(p.numel() for p in LeNet().parameters())


def test_counted_bytes_equal_each_splits_formula():
    payload = run_splits_bench(SplitsBenchConfig(world_sizes=(2, 4), global_batch_size=30, micro_batches=3, steps=2,
                                                 rounds=1, schedule="1f1b"))
    rows = {(r["split"], r["k"]): r for r in payload["rows"]}
    assert set(rows) == {(s, k) for s in ("data", "layers", "channels") for k in (2, 4)}
    for (split, k), row in rows.items():
        assert row["sent_bytes_consistent"], (split, k)
        assert row["sent_bytes_per_device"] == row["formula_bytes_per_device"], (split, k)
        assert all(b > 0 for b in row["sent_bytes_per_device"]), (split, k)
        held = row["parameters_per_device"]
        assert (held == [PARAMETERS] * k) if split == "data" else (sum(held) == PARAMETERS), (split, k)
        assert all(0 <= share <= 1 for share in row["idle_share_per_device"])
        assert all(b > 0 for b in row["activation_bytes_per_device"])
    assert max(rows[("channels", 4)]["parameters_per_device"]) < PARAMETERS / 3  # ~1/k of the model each
    assert "formula KB" in report_splits(payload) and "which sums through shared memory" in report_splits(payload)
    plot_splits(payload)


def test_formulas_reduce_to_the_textbook_ones_on_even_splits():
    # Ring allreduce: 2(k-1)/k of the gradient, and of the 8 usage flags (one per tensor) riding with
    # it; LeNet's 129,068 parameters and 8 flags split evenly over 2 and 4.
    for k in (2, 4):
        sent = 2 * (k - 1) * (PARAMETERS + 8) * 4 // k
        assert expected_bytes("data", k=k, rank=0, batch=256, element_size=4) == sent
    # A 4-stage pipeline's middle stage sends its output forward and its input's gradient back.
    assert expected_bytes("layers", k=4, rank=1, batch=10, element_size=4) == 4 * 10 * (800 + 20 * 13 * 13)
    # Channels at k = 2: per gathered layer, half of it forward and half of it back (not the logits back).
    half = (20 * 13 * 13 + 50 * 16 + 128) // 2
    assert expected_bytes("channels", k=2, rank=0, batch=1, element_size=4) == 4 * (2 * half + 5)
