"""phalanx.launch on a GPU, in a fresh interpreter (the test process has CUDA initialized): a
forked worker drives cuda:0 and its result comes back on the CPU, leaving the launching process
free of CUDA, so it can launch again; once CUDA is initialized there, fork is refused in one line
naming the fix and spawn still runs. Skipped where no GPU is present; the CPU checks are in
tests/unit/test_function_launch.py and tests/distributed/test_function_launch.py."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""\
    import torch
    from torch import nn
    import phalanx

    def body():
        world = phalanx.init()
        model = nn.Linear(4, 2).to(world.device)
        return {"device": str(world.device), "out": model(torch.ones(3, 4, device=world.device)), "model": model}

    if __name__ == "__main__":
        got = phalanx.launch(body, devices="cuda:0", quiet=True)[0]
        print("forked", got["device"], got["out"].device, next(got["model"].parameters()).device,
              torch.cuda.is_initialized(), flush=True)
        again = phalanx.launch(body, devices="cuda:0", quiet=True)[0]
        print("again", again["device"], flush=True)
        torch.zeros(1, device="cuda")
        try:
            phalanx.launch(body, devices="cuda:0", quiet=True)
        except phalanx.UsageError as exc:
            print("refused:", exc, flush=True)
        spawned = phalanx.launch(body, devices="cuda:0", start_method="spawn", quiet=True)[0]
        print("spawned", spawned["device"], spawned["out"].device, flush=True)
""")


def test_a_forked_gpu_worker_returns_cpu_values_and_leaves_cuda_alone(tmp_path):
    script = tmp_path / "gpu_launch.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "forked cuda:0 cpu cpu False", proc.stdout
    assert lines[1] == "again cuda:0", proc.stdout
    assert lines[2].startswith("refused: launch() on GPUs forks this process, in which CUDA is already initialized")
    assert lines[3] == "spawned cuda:0 cpu", proc.stdout
