"""A scheduler's SIGTERM keeps the work: `phalanx train --out R` stopped mid-run (the launcher
signalled, as `timeout`, Kubernetes and Slurm do; one worker alone; torchrun's agent; one device
in-process) saves after a step every rank agrees on, says where in one line (exit 143), and
`--resume auto` then ends bitwise equal to the run nobody stopped (float64). Before, the work
since the last checkpoint was lost: with no --checkpoint-every, all of it. A Ctrl-C does the same
(exit 130). A run with nowhere to save stops at once, as before."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from phalanx.train.checkpoint import read_checkpoint
from tests.distributed.test_faults import _wait_for, _workers, assert_all_gone

pytestmark = pytest.mark.distributed

PHALANX = [sys.executable, "-m", "phalanx"]
TRAIN = ["train", "--dataset", "synthetic", "--train-examples", "3000", "--dtype", "float64", "--epochs", "3",
         "--seed", "5", "--no-progress"]
SAVED = re.compile(r"phalanx: stopped by (?:SIGTERM|SIGINT) after epoch (\d+), step (\d+) of (\d+), saved in (.+); "
                   r"run the same command with --resume auto to continue")


def _launch(devices: str, out: Path, *extra: str) -> subprocess.Popen:
    if devices.startswith("torchrun"):
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", devices.split(":")[1],
                   "-m", "phalanx", *TRAIN]
    else:
        command = [*PHALANX, *TRAIN, "--devices", devices]
    return subprocess.Popen([*command, "--out", str(out), *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _finish(proc: subprocess.Popen, timeout_s: float = 240) -> tuple[int, str]:
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, stderr


def _model(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", map_location="cpu", weights_only=True)


ZERO3 = ("--shard", "parameters", "--optimizer", "adamw")  # each rank writes its own share of the checkpoint


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[tuple, dict[str, torch.Tensor]]:
    """model.pt of the runs nobody stopped: on 1 device, on 2, on 2 with ZeRO-3 (equal to rounding, not bitwise)."""
    models = {}
    for devices, extra in (("1", ()), ("cpu:2", ()), ("cpu:2", ZERO3)):
        out = tmp_path_factory.mktemp(f"whole-{devices.replace(':', '')}{len(extra)}")
        code, stderr = _finish(_launch(devices, out, *extra))
        assert code == 0, stderr[-3000:]
        models[devices, extra] = _model(out)
    return models


def _relaunch_command(devices: str) -> list[str]:
    if devices.startswith("torchrun"):
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "phalanx", *TRAIN]
    return [*PHALANX, *TRAIN, "--devices", devices]


@pytest.mark.parametrize("devices, target, extra", [
    ("cpu:2", "launcher", ()), ("cpu:2", "worker", ()), ("torchrun:2", "launcher", ()), ("1", "launcher", ()),
    ("cpu:2", "launcher", ZERO3),  # before 2026-12-02 its shares went to a directory nobody had made
    ("cpu:2", "ctrl-c", ()), ("1", "ctrl-c", ()),  # before 2026-12-02 a Ctrl-C kept only the last checkpoint
])
def test_a_sigterm_saves_an_agreed_step_and_the_resume_is_the_uninterrupted_run(tmp_path, uninterrupted, devices,
                                                                               target, extra):
    out = tmp_path / "run"
    proc = _launch(devices, out, *extra)
    workers = _workers(proc.pid, 2) if devices == "cpu:2" else []
    _wait_for(out / "metrics.jsonl")  # epoch 1 is written: training is under way
    if target == "ctrl-c":  # a terminal's Ctrl-C: SIGINT to the launcher's group (the workers lead their own)
        os.killpg(proc.pid, signal.SIGINT)
    else:  # the launcher alone, as `timeout` does
        os.kill(workers[1] if target == "worker" else proc.pid, signal.SIGTERM)
    code, stderr = _finish(proc)
    lines = [line for line in stderr.strip().splitlines() if line.startswith("phalanx: stopped")]
    expected = 1 if devices.startswith("torchrun") else 130 if target == "ctrl-c" else 143  # torchrun: its agent's
    assert code == expected and (f"by {'SIGINT' if target == 'ctrl-c' else 'SIGTERM'} " in lines[0]), stderr[-3000:]
    assert len(lines) == 1, stderr[-3000:]  # once, also where every rank of torchrun raised it
    match = SAVED.fullmatch(lines[0])
    assert match, stderr[-3000:]
    epoch, step, steps, saved_in = int(match[1]), int(match[2]), int(match[3]), match[4]
    assert Path(saved_in) == out / "checkpoints" and steps == 12 and 1 <= step <= steps
    state = read_checkpoint(saved_in)
    assert (state["epoch"], state["step"]) == (epoch - 1, step)
    assert_all_gone(workers)
    resumed = subprocess.run([*_relaunch_command(devices), *extra, "--out", str(out), "--resume", "auto"],
                             capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    reference = uninterrupted["1" if devices == "1" else "cpu:2", extra]
    model = _model(out)
    assert model.keys() == reference.keys()
    assert all(torch.equal(model[name], reference[name]) for name in reference)


def test_a_signal_to_one_worker_alone_is_named_by_every_rank(tmp_path):
    # `kill -INT` to rank 1 alone: rank 0 got no signal of its own and used to report SIGTERM, so
    # the run ended "stopped by SIGTERM", exit 143, for a SIGINT.
    out = tmp_path / "run"
    proc = _launch("cpu:2", out)
    workers = _workers(proc.pid, 2)
    _wait_for(out / "metrics.jsonl")
    os.kill(workers[1], signal.SIGINT)
    code, stderr = _finish(proc)
    lines = [line for line in stderr.strip().splitlines() if line.startswith("phalanx: stopped")]
    assert code == 130 and len(lines) == 1 and SAVED.fullmatch(lines[0]), stderr[-3000:]
    assert lines[0].startswith("phalanx: stopped by SIGINT after "), stderr[-3000:]
    assert_all_gone(workers)


def test_a_run_with_nowhere_to_save_stops_at_once_as_before(tmp_path):
    proc = subprocess.Popen([*PHALANX, *TRAIN, "--devices", "cpu:2", "--epochs", "200"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=tmp_path)
    workers = _workers(proc.pid, 2)
    assert proc.stdout.readline().startswith("training ")  # under way (epoch rows follow)
    os.kill(proc.pid, signal.SIGTERM)
    code, stderr = _finish(proc, timeout_s=60)
    assert (code, stderr.strip().splitlines()[-1]) == (143, "phalanx: stopped by SIGTERM; every worker was stopped")
    assert_all_gone(workers)
    assert list(tmp_path.iterdir()) == []  # nothing written


SCRIPT = """
import sys, torch, torch.nn.functional as F, phalanx
world = phalanx.init()
torch.manual_seed(0)
dp = phalanx.prepare(torch.nn.Linear(10, 2), world=world)
opt = torch.optim.SGD(dp.parameters(), lr=0.1)
X, y = torch.randn(64, 10), torch.randint(0, 2, (64,))
for step in range(10**6):
    opt.zero_grad()
    phalanx.shard_loss(F.cross_entropy(dp(X), y, reduction="sum"), 64).backward()
    dp.finish_gradient_sync()
    opt.step()
    if step == 20:
        world.print("under way", flush=True)
    if phalanx.stop_requested(dp):
        phalanx.checkpoint(sys.argv[1], world=world, model=dp, optimizer=opt, epoch=0, step=step + 1,
                           global_batch_size=64, seed=0)
        print(f"rank {world.rank} saved at step {step + 1}", flush=True)
        break
dp.close()
"""


def test_a_script_that_asks_stop_requested_saves_the_same_step_on_every_rank(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([*PHALANX, "run", "--devices", "cpu:2", "--quiet", str(script), str(tmp_path / "ckpt")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    workers = _workers(proc.pid, 2)
    assert proc.stdout.readline().strip() == "under way"
    os.kill(proc.pid, signal.SIGTERM)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "phalanx: stopped by SIGTERM and every worker ended its work by itself (exit 0)"
    saved = sorted(line for line in stdout.splitlines() if "saved at step" in line)
    steps = {line.split()[-1] for line in saved}
    assert len(saved) == 2 and len(steps) == 1, stdout  # both ranks, after the same step
    assert read_checkpoint(tmp_path / "ckpt")["step"] == int(steps.pop())
    assert_all_gone(workers)


INTERRUPTED = """
import sys, time, phalanx
world = phalanx.init()
try:
    print(f"rank {world.rank} under way", flush=True)
    time.sleep(600)
except KeyboardInterrupt:
    open(f"{sys.argv[1]}/emergency-{world.rank}.txt", "w").write("saved")
    raise
"""


def test_ctrl_c_lets_a_scripts_own_keyboardinterrupt_handling_run_on_every_rank(tmp_path):
    # Before 2026-12-02 the workers got SIGTERM and died without running it; torchrun forwards the SIGINT.
    script = tmp_path / "train.py"
    script.write_text(INTERRUPTED)
    proc = subprocess.Popen([*PHALANX, "run", "--devices", "cpu:2", "--quiet", str(script), str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    workers = _workers(proc.pid, 2)
    assert sorted(proc.stdout.readline().strip() for _ in range(2)) == ["rank 0 under way", "rank 1 under way"]
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the launcher's group (the workers lead their own)
    code, stderr = _finish(proc, timeout_s=60)
    # then where each rank was when the Ctrl-C came (crash_site.py): a line of the script, its sleep unless a
    # loaded machine held a rank back between its print and its sleep; test_crash_site.py checks the lines
    lines = stderr.strip().splitlines()
    at = next(n for n, line in enumerate(lines) if line.startswith("phalanx: interrupted"))
    assert code == 130 and lines[at] in ("phalanx: interrupted", "phalanx: interrupted; where each rank was:"), \
        stderr[-3000:]
    assert all(re.fullmatch(rf"rank [01] at {re.escape(str(script))}:[56] \(<module>\)", line)
               for line in lines[at + 1:]), stderr[-3000:]
    # Once in a full run (2026-12-03) rank 1's save did not run: tests/distributed/test_signal_main_thread.py.
    assert sorted(p.name for p in tmp_path.glob("emergency-*.txt")) == ["emergency-0.txt", "emergency-1.txt"], \
        stderr[-3000:]
    assert_all_gone(workers)
