"""A DDP script written for GPUs, under `phalanx run` on CPU workers: each line that asks for a GPU
ends the run in one line naming the script's own line and the fix, exit 2, no traceback.

nanoGPT's train.py (its DDP branch: `device = f'cuda:{ddp_local_rank}'`, `torch.cuda.set_device(device)`,
`DDP(model, device_ids=[ddp_local_rank])`) ran into torch's "AttributeError: module 'torch._C' has no
attribute '_cuda_setDevice'" and then "DistributedDataParallel device_ids and output_device arguments only
work with single-device/multiple-device GPU modules or CPU modules", each with a traceback per rank
(torchrun's the same). The script below has both lines; once they keep to the CPU, it trains.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: torch gives the script one")]

TIMEOUT_S = 240
SCRIPT = """\
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
local_rank = int(os.environ["LOCAL_RANK"])
device = {device}
if device.startswith("cuda"):
    torch.cuda.set_device(device)
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 2).to(device), device_ids={device_ids})
loss = model(torch.randn(8, 4, device=device)).square().sum()
loss.backward()
dist.destroy_process_group()
"""


def _run(tmp_path: Path, *, device: str, device_ids: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(device=device, device_ids=device_ids)))
    return subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--threads-per-device", "1",
                           "--timeout", "60", "--quiet", str(script)], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=dict(os.environ))


def _phalanx_lines(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith("phalanx")]


def test_each_gpu_line_of_a_ddp_script_on_cpu_workers_is_one_line_naming_it(tmp_path):
    asked = _run(tmp_path, device='f"cuda:{local_rank}"', device_ids="[local_rank]")
    assert asked.returncode == 2, asked.stderr[-3000:]
    why = f"torch {torch.__version__} has no CUDA" if torch.version.cuda is None else "this host has no GPU"
    assert _phalanx_lines(asked) == [
        f"phalanx: error: the script asks for a GPU at train.py:11 (`torch.cuda.set_device(device)`), and these "
        f"workers are CPU workers ({why}): keep the model and its batches on the CPU - "
        "phalanx.init().device names each worker's device (cpu here, cuda:LOCAL_RANK on GPUs) - and leave out "
        "torch.cuda.set_device and DistributedDataParallel's device_ids there"], asked.stderr[-3000:]
    assert "Traceback" not in asked.stderr

    wrapped = _run(tmp_path, device='"cpu"', device_ids="[local_rank]")
    assert wrapped.returncode == 2, wrapped.stderr[-3000:]
    assert _phalanx_lines(wrapped) == [
        "phalanx: error: the script wraps a model on the CPU as DistributedDataParallel(model, device_ids=[...]) at "
        "train.py:13 (`model = DDP(torch.nn.Linear(4, 2).to(device), device_ids=[local_rank])`): device_ids names "
        "GPUs; leave it out (None) on CPU workers, or wrap the model with phalanx.prepare(model), which needs "
        "neither"], wrapped.stderr[-3000:]
    assert "Traceback" not in wrapped.stderr

    fixed = _run(tmp_path, device='"cpu"', device_ids="None")
    assert fixed.returncode == 0, fixed.stderr[-3000:]
