"""`phalanx run` of a script whose ranks train apart: one line on rank 0, after the first optimizer step.

PyTorch's ImageNet example (pytorch/examples imagenet/main.py at 77f55b9) on CPU workers opens a gloo
group and never wraps its model (its DDP wrap sits in the GPU branch): under torchrun and, before
2026-12-05, under `phalanx run` two ranks trained two resnet18s and each wrote checkpoint.pth.tar,
exit 0, nothing said. Scripts that sum their gradients (DDP, ZeRO over DDP, phalanx.prepare sharded)
or hold rank-sized models by design must hear nothing (runtime/apart.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

TIMEOUT_S = 240
SCRIPT = Path(__file__).resolve().parent / "scripts" / "ranks_apart.py"
SAID = "PhalanxWarning: after this first optimizer step the 2 ranks hold different models"


def _run(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--threads-per-device", "1",
                           "--timeout", "60", "--quiet", str(SCRIPT), mode], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=dict(os.environ))


@pytest.mark.parametrize("mode, started", [("bare", "they were equal before it and apart after it"),
                                           ("seeded", "they were apart before it too"),
                                           ("data-parallel", "they were equal before it and apart after it")])
def test_ranks_that_train_apart_are_said_once_on_rank_0(mode, started):
    done = _run(mode)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if SAID in line]
    assert len(lines) == 1, done.stderr[-3000:]
    step_line = next(n for n, line in enumerate(SCRIPT.read_text().splitlines(), 1) if "optimizer.step()" in line)
    assert lines[0].startswith(f"{SCRIPT}:{step_line}: ")  # the script's step, as any PhalanxWarning
    assert "rank 1's parameters differ from rank 0's in 4 of 4 tensors" in lines[0]
    assert started in lines[0] and "model = phalanx.prepare(model)" in lines[0]
    # The book's concise implementation is named as what sums nothing across processes.
    assert ("; `model` is a torch.nn.DataParallel, which splits each batch over the GPUs of one process and sums "
            "nothing across processes" in lines[0]) == (mode == "data-parallel")
    assert sorted(line for line in done.stdout.splitlines()) == ["rank 0 done", "rank 1 done"]


def test_ranks_that_summed_their_gradients_and_stepped_apart_are_told_the_step_differs():
    done = _run("rank-lr")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if SAID in line]
    assert len(lines) == 1, done.stderr[-3000:]
    assert "they were equal before it and so were their gradients, so the step itself read something" in lines[0]
    assert "an lr set from the rank" in lines[0] and "no gradient was summed" not in lines[0]


@pytest.mark.parametrize("mode", ["ddp", "zero", "prepare-sharded", "rank-widths", "split-alike"])
def test_ranks_that_sum_their_gradients_or_hold_parts_by_design_hear_nothing(mode):
    done = _run(mode)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hold different models" not in done.stderr and "DistributedSampler" not in done.stderr, done.stderr[-3000:]
    assert sorted(line for line in done.stdout.splitlines()) == ["rank 0 done", "rank 1 done"]


def test_a_script_that_never_joins_the_group_is_told_each_worker_trains_alone():
    done = _run("alone")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "PhalanxWarning: this optimizer step ran before" in line]
    assert len(lines) == 1 and "each of the 2 workers trains alone" in lines[0], done.stderr[-3000:]
    assert SAID not in done.stderr


def test_a_distributed_sampler_over_a_split_drawn_per_rank_is_said_once_on_rank_0():
    # DDP over DistributedSampler(random_split(...)) after torch.manual_seed(seed + rank): the models stay equal,
    # every rank reads its shard of another split, and nothing was said before 2026-12-07.
    done = _run("split-by-rank")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "PhalanxWarning" in line]
    assert len(lines) == 1, done.stderr[-3000:]
    assert "PhalanxWarning: the DistributedSampler of `train_loader` shards a different dataset on each rank " \
           "(rank 1's Subset holds other indices than rank 0's)" in lines[0]
    assert "random_split(data, lengths, generator=torch.Generator().manual_seed(0))" in lines[0]
    assert sorted(line for line in done.stdout.splitlines()) == ["rank 0 done", "rank 1 done"]
