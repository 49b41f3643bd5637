"""The model-parallel splits' pieces that need no processes: placement, slicing, and refused input.

Bad input for `--split` ends like every other bad input (tests/unit/test_bad_input.py's contract):
exit 2, one line `phalanx: error: <problem>; <fix>` naming the numbers, nothing written, no worker
started.
"""

import pytest
import torch
import torch.nn.functional as F

from phalanx.cli import main
from phalanx.models import LeNet
from phalanx.model_split.lenet_parts import UNITS, apply_unit, channel_counts, stage_plan
from phalanx.model_split.splits import build_split
from phalanx.runtime.world import World


def _refuse(argv, tmp_path, capsys) -> str:
    out = tmp_path / "out"
    code = main(["train", "--dataset", "synthetic", "--no-progress", "--epochs", "1", "--out", str(out), *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("phalanx: error: ") and "Traceback" not in err, err
    assert not out.exists()
    return lines[0]


@pytest.mark.parametrize("argv, expected", [
    (["--split", "layers", "--devices", "cpu:5"], "needs 1 to 4 devices, not 5; use --devices 4 or fewer"),
    (["--split", "channels", "--devices", "cpu:11"], "needs 1 to 10 devices, not 11; use --devices 10 or fewer"),
    (["--split", "layers", "--devices", "cpu:2", "--micro-batches", "0"], "--micro-batches 0 must be between 1 and"),
    (["--split", "layers", "--devices", "cpu:2", "--micro-batches", "300"],
     "--micro-batches 300 must be between 1 and the global batch (256)"),
    (["--split", "channels", "--devices", "cpu:2", "--micro-batches", "4"], "applies to --split layers only"),
    (["--split", "layers", "--model", "mlp", "--devices", "cpu:2"], "built for --model lenet, not mlp"),
    (["--split", "rows"], "--split 'rows' is unknown; choose one of data, layers, channels"),
    (["--split", "layers", "--schedule", "zigzag"], "--schedule 'zigzag' is unknown"),
    (["--split", "channels", "--grad-accum", "2"], "--grad-accum is a data-parallel option"),
    # Each replica option a split would ignore is refused, not dropped without a word.
    (["--split", "layers", "--allreduce", "naive"], "--allreduce is a data-parallel option; drop it with --split layers"),
    (["--split", "layers", "--overlap"], "--overlap is a data-parallel option"),
    (["--split", "layers", "--no-overlap"], "--no-overlap is a data-parallel option"),
    (["--split", "layers", "--bucket-cap-mb", "1"], "--bucket-cap-mb is a data-parallel option"),
    (["--split", "layers", "--memory-format", "channels_last"], "--memory-format is a data-parallel option"),
    (["--split", "channels", "--allreduce", "ring"], "--allreduce is a data-parallel option; drop it with --split channels"),
    (["--split", "channels", "--optimizer", "adam"], "--split channels trains with plain SGD (no momentum, no clipping); "
                                                     "drop --optimizer"),
    (["--split", "channels", "--trace", "t"], "--trace traces the data-parallel exchange; drop it with --split channels"),
])
def test_bad_split_input_is_one_line(argv, expected, tmp_path, capsys):
    assert expected in _refuse(argv, tmp_path, capsys)


def test_stage_plan_balances_compute_and_keeps_order():
    assert stage_plan(1) == [UNITS]
    assert stage_plan(4) == [(u,) for u in UNITS]
    for k in (2, 3):
        plan = stage_plan(k)
        assert len(plan) == k and tuple(u for stage in plan for u in stage) == UNITS
    assert stage_plan(2) == [("conv1",), ("conv2", "fc1", "fc2")]  # conv2 is ~90% of the MACs


def test_channel_counts_are_even_larger_first():
    assert channel_counts(50, 4) == [13, 13, 12, 12]
    assert channel_counts(10, 4) == [3, 3, 2, 2]
    assert sum(channel_counts(128, 3)) == 128


def test_units_compose_to_lenet():
    torch.manual_seed(0)
    model, x = LeNet().double(), torch.randn(3, 1, 28, 28, dtype=torch.float64)
    h = x
    for name in UNITS:
        h = apply_unit(name, getattr(model, name), h)
    torch.testing.assert_close(h, model(x), rtol=0, atol=0)


@pytest.mark.parametrize("split", ["layers", "channels"])
def test_one_device_split_is_plain_lenet(split):
    world = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend="none",
                  timeout_s=10.0)
    torch.manual_seed(0)
    reference = LeNet().double()
    torch.manual_seed(0)
    piece = build_split(split, LeNet().double(), world=world, global_batch_size=7, micro_batches=3)
    X, y = torch.randn(7, 1, 28, 28, dtype=torch.float64), torch.arange(7) % 10
    loss_sum, correct = piece.forward_backward(X, y, global_batch_size=7)
    logits = reference(X)
    (F.cross_entropy(logits, y, reduction="sum") / 7).backward()
    torch.testing.assert_close(loss_sum, F.cross_entropy(logits, y, reduction="sum").detach())
    assert int(correct) == int((logits.argmax(1) == y).sum())
    grads = {n: p.grad for n, p in piece.module.named_parameters()}
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-12, atol=1e-15)
    assert piece.full_state_dict().keys() == reference.state_dict().keys()
    assert piece.transport.sent_bytes == 0
