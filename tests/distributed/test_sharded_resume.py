"""Sharded runs resume exactly on any device count and stage, and their faults end in one line.

float64 LeNet on synthetic data (its first 3,000 images), AdamW with weight decay (state that
sharding divides), 2 epochs of 24 steps of 128 images, a checkpoint every 17 steps; the reference
trains uninterrupted on 2 devices with `--shard none`. A `--shard parameters` run on 3 CPU workers
is SIGKILLed right after its checkpoint at epoch 2, step 10 lands (runs.crash_script); finished on 2
devices (stage 3 again) and on one device (no sharding at all) it must end within 1e-9 of the
reference. A checkpoint whose newest generation misses a rank's share goes back to the previous
generation and says so; with no generation left it is refused in one line naming the share. So does
one whose rank-1 share is an intact share of the previous generation copied over the newest one's
name (each share's digest is in the manifest): the resumed run ends within 1e-9 of the reference,
and the manifest named on its own is refused in one line naming the share and the generation it
holds. `--max-restarts 1 --elastic` gives up a device that keeps dying and finishes the sharded run
on the rest, within 1e-9. And the docs' snippet reads a sharded checkpoint into a plain model.
"""

import shutil
from pathlib import Path

import pytest
import torch

from phalanx.data_parallel.sharding.flat_layout import Slot
from phalanx.data_parallel.sharding.state import whole_state
from phalanx.models import LeNet
from phalanx.train.sharded_checkpoint import reader_of
from tests.distributed.runs import assert_same_rows, crash_script, finished_run, metrics_rows, relative_difference, run_phalanx
from tests.distributed.test_elastic import kill_rank_1_for_good

pytestmark = pytest.mark.distributed

COMMON = ["train", "--dataset", "synthetic", "--train-examples", "3000", "--batch-size", "128", "--dtype", "float64",
          "--no-progress", "--threads-per-device", "1", "--epochs", "2", "--checkpoint-every", "17", "--optimizer", "adamw",
          "--weight-decay", "0.01"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return finished_run(tmp_path_factory.mktemp("reference") / "run", *COMMON, "--devices", "cpu:2")


@pytest.fixture(scope="module")
def crashed_stage3_on_3(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("crashed")
    out = base / "run"
    crashed = run_phalanx(*COMMON, "--devices", "cpu:3", "--shard", "parameters", "--out", str(out),
                          script=crash_script(base))
    assert crashed.returncode != 0 and len(metrics_rows(out)) == 1, crashed.stderr[-2000:]
    shares = sorted(p.name for p in (out / "checkpoints").glob("checkpoint.shard-*.pt"))
    assert len(shares) == 6 and all("-of-00003." in name for name in shares), shares  # 2 generations x 3 ranks
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.parametrize("devices, shard", [("cpu:2", "parameters"), ("1", "none")])
def test_a_stage_3_run_killed_on_3_devices_finishes_on_2_or_1_as_if_uninterrupted(
        reference, crashed_stage3_on_3, tmp_path, devices, shard):
    out = _copy(crashed_stage3_on_3, tmp_path)
    resumed = run_phalanx(*COMMON, "--devices", devices, "--shard", shard, "--out", str(out), "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    count = "3 -> 2" if devices == "cpu:2" else "3 -> 1"
    change = "" if shard == "parameters" else ", --shard parameters -> none"
    assert f"at epoch 2, step 10; changed since the checkpoint: devices {count}{change}" in resumed.stdout, \
        resumed.stdout[-2000:]
    worst = relative_difference(out, reference)
    assert worst <= 1e-9, f"final weights {worst:.3g} (relative) from the uninterrupted run"
    assert_same_rows(out, reference, rel=1e-9)


def test_a_missing_share_goes_back_a_generation_and_with_none_left_is_one_line(reference, crashed_stage3_on_3,
                                                                               tmp_path):
    out = _copy(crashed_stage3_on_3, tmp_path)
    manifest = out / "checkpoints" / "checkpoint.pt"
    newest = torch.load(manifest, weights_only=True)
    missing = out / "checkpoints" / newest["shards"][1]["file"]
    missing.unlink()
    resumed = run_phalanx(*COMMON, "--devices", "cpu:2", "--shard", "optimizer", "--out", str(out), "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"names rank 1's share {missing.name}, which is missing" in resumed.stdout, resumed.stdout[-2000:]
    assert relative_difference(out, reference) <= 1e-9

    alone = _copy(crashed_stage3_on_3, tmp_path / "alone")
    (alone / "checkpoints" / missing.name).unlink()
    refused = run_phalanx(*COMMON, "--devices", "cpu:2", "--out", str(alone),
                          "--resume", str(alone / "checkpoints" / "checkpoint.pt"))
    assert refused.returncode == 2, refused.stderr[-2000:]
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and f"names rank 1's share {missing.name}, which is missing" in lines[0], lines


def test_a_share_of_another_generation_goes_back_a_generation_and_named_alone_is_one_line(reference,
                                                                                         crashed_stage3_on_3, tmp_path):
    out = _copy(crashed_stage3_on_3, tmp_path)
    checkpoints = out / "checkpoints"
    newest = torch.load(checkpoints / "checkpoint.pt", weights_only=True)  # epoch 2, step 10
    older = torch.load(checkpoints / "checkpoint.previous.pt", weights_only=True)  # the end of epoch 1
    stale = checkpoints / newest["shards"][1]["file"]
    shutil.copyfile(checkpoints / older["shards"][1]["file"], stale)  # intact, CRCs and all: another generation's
    said = (f"names rank 1's share {stale.name}, which holds the share of another generation (saved at the end of "
            "epoch 1), not this one's (saved at epoch 2, step 10): its SHA-256 differs from the manifest's")
    alone = _copy(out, tmp_path / "alone")
    resumed = run_phalanx(*COMMON, "--devices", "cpu:3", "--shard", "parameters", "--out", str(out),
                          "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    first = resumed.stdout.splitlines()[0]
    assert first.startswith(f"resumed from {checkpoints / 'checkpoint.previous.pt'} at epoch 2, step 0; "
                            f"{checkpoints / 'checkpoint.pt'} {said}"), first
    assert "so this is the checkpoint before it" in first
    assert relative_difference(out, reference) <= 1e-9
    refused = run_phalanx(*COMMON, "--devices", "cpu:2", "--out", str(alone),
                          "--resume", str(alone / "checkpoints" / "checkpoint.pt"))
    assert refused.returncode == 2, refused.stderr[-2000:]
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], lines


def test_elastic_gives_up_a_dying_device_and_finishes_the_sharded_run_on_the_rest(reference, tmp_path):
    out = tmp_path / "run"
    code, stdout, stderr, said = kill_rank_1_for_good(*COMMON, "--devices", "cpu:3", "--shard", "gradients",
                                                      "--checkpoint-every", "5", "--elastic", tmp_path=tmp_path)
    assert code == 0, stderr[-3000:]
    assert "giving cpu:1 up (--elastic)" in said[1], said
    assert stdout.strip().splitlines()[-1].endswith("on [cpu:0, cpu:2]")
    assert relative_difference(out, reference) <= 1e-9


def test_the_docs_snippet_reads_a_sharded_checkpoint_into_a_plain_model(crashed_stage3_on_3):
    path = crashed_stage3_on_3 / "checkpoints" / "checkpoint.pt"
    state = torch.load(path, weights_only=True)  # the manifest
    model = LeNet().double()
    params, optimizer_state = whole_state(reader_of(path, state), slots=[Slot.of(s) for s in state["layout"]],
                                          names=[n for n, _ in model.named_parameters()])
    model.load_state_dict({**state["model"], **params})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    optimizer.load_state_dict(optimizer_state)
    assert optimizer.state[model.fc2.weight]["exp_avg"].shape == model.fc2.weight.shape
    assert int(optimizer.state[model.conv1.weight]["step"]) == 24 + 10  # epoch 2, step 10
