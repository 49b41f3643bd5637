"""Faults: a worker killed mid-epoch takes the run down fast with the rank and step named; a kill
during a checkpoint write leaves the previous one loadable, and a SIGTERM mid-write leaves no
temporary file; torchrun restarts resume by themselves."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed

PHALANX = [sys.executable, "-m", "phalanx"]


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        text = (task / "children").read_text() if (task / "children").exists() else ""
        found += [int(p) for p in text.split()]
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status


def _workers(parent: int, count: int, timeout_s: float = 60.0) -> list[int]:
    """The workers of a launcher, oldest first: forked by its fork server (runtime/fork_server.py),
    or spawned by it (not multiprocessing's resource tracker)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        servers = [p for p in _children(parent) if "multiprocessing.forkserver" in _cmdline(p)]
        pids = [p for p in _children(parent) if "spawn_main" in _cmdline(p)]
        pids += [p for server in servers for p in _children(server)]
        if len(pids) >= count:
            return sorted(pids)[:count]
        time.sleep(0.1)
    raise AssertionError(f"launcher {parent} never had {count} workers")


def _wait_for(path: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def kill_a_worker_mid_run(argv: list[str], out: Path, devices: int, victim: int, *, start_timeout_s: float = 120.0,
                          stop_timeout_s: float = 60.0) -> tuple[int, str, float, list[int]]:
    """Start `phalanx <argv> --out out`, SIGKILL worker `victim` once epoch 1 is done; return the
    launcher's exit code, its stderr, seconds from the kill to its exit, and the workers' pids."""
    proc = subprocess.Popen([*PHALANX, *argv, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        workers = _workers(proc.pid, devices)
        _wait_for(out / "metrics.jsonl", timeout_s=start_timeout_s)  # training is under way: epoch 1 is done
        os.kill(workers[victim], signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = proc.communicate(timeout=stop_timeout_s)
        elapsed_s = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, stderr, elapsed_s, workers


def assert_all_gone(workers: list[int], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in workers), "a worker outlived the run"


@pytest.mark.parametrize("devices, victim", [(2, 1), (3, 2)])
def test_a_killed_worker_stops_every_process_fast_naming_rank_and_step(tmp_path, devices, victim):
    argv = ["train", "--devices", f"cpu:{devices}", "--dataset", "synthetic", "--epochs", "200", "--no-progress"]
    returncode, stderr, elapsed_s, workers = kill_a_worker_mid_run(argv, tmp_path / "run", devices, victim)
    assert returncode != 0
    assert elapsed_s < 30, f"took {elapsed_s:.1f} s to stop"
    # The first line but the oversubscription warning (3 workers on a 2-core host).
    first = next(line for line in stderr.splitlines() if not line.startswith("phalanx: warning: "))
    assert f"worker rank {victim} failed: died (signal SIGKILL) after step" in first, stderr[-2000:]
    assert_all_gone(workers)


def test_a_kill_during_a_checkpoint_write_leaves_the_previous_one(tmp_path):
    # The child saves checkpoint A, then starts saving B with fsync slowed down: the kill lands
    # after B's bytes are written to the temp file and before the rename.
    script = textwrap.dedent(f"""
        import os, sys, time, torch
        from phalanx.models import LeNet
        from phalanx.train import checkpoint as ckpt
        from phalanx.runtime.world import World
        world = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
                      backend="none", timeout_s=10.0)
        model = LeNet(); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        fp = ckpt.fingerprint(model, model_name="lenet", global_batch_size=256, seed=0, dtype="float32")
        ckpt.save_checkpoint({str(tmp_path)!r}, world=world, model=model, optimizer=opt,
                             position=ckpt.Position(epoch=1, step=3), fingerprint=fp)
        real_fsync = os.fsync
        def slow_fsync(fd):
            print("writing", flush=True); time.sleep(60); real_fsync(fd)
        os.fsync = slow_fsync
        with torch.no_grad():
            for p in model.parameters(): p.add_(1.0)
        ckpt.save_checkpoint({str(tmp_path)!r}, world=world, model=model, optimizer=opt,
                             position=ckpt.Position(epoch=2, step=0), fingerprint=fp)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".checkpoint.pt.")], "no temp file in flight"
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    from phalanx.train import checkpoint as ckpt

    state = ckpt.read_checkpoint(tmp_path)
    assert (state["epoch"], state["step"]) == (1, 3)  # the previous checkpoint, whole


def test_torchrun_restart_resumes_from_the_latest_checkpoint(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    assert torchrun
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "-m", "phalanx", "train",
         "--dataset", "synthetic", "--epochs", "6", "--checkpoint-every", "10", "--no-progress", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        _wait_for(out / "checkpoints" / "checkpoint.pt")
        victims = [p for p in _children(proc.pid) if "phalanx" in _cmdline(p)]
        assert victims, "no torchrun worker found"
        os.kill(victims[-1], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:  # torchrun starts its workers in sessions of their own: kill them first
            for pid in _children(proc.pid):
                os.kill(pid, signal.SIGKILL)
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-3000:]
    assert "resumed from" in stdout, stdout[-2000:]
    assert stdout.strip().splitlines()[-1].startswith("test acc (synthetic): ")  # not Fashion-MNIST: named
    rows = [line for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) == 6  # one row per epoch, none repeated by the restart
    assert set(torch.load(out / "model.pt", weights_only=True)) >= {"conv1.weight"}


def test_a_worker_stopped_by_sigterm_mid_write_leaves_no_temporary_file(tmp_path):
    # A worker's SIGTERM handler dies of the signal (no Python clean-up runs), so a checkpoint
    # write it cuts short must have its temporary file removed by the handler itself.
    target = tmp_path / "checkpoint.pt"
    script = (
        "import os, signal, sys\n"
        "from phalanx.atomic import atomic_open\n"
        "from phalanx.runtime.lifeline import flush_on_sigterm\n"
        "flush_on_sigterm()\n"
        f"with atomic_open({str(target)!r}) as handle:\n"
        "    handle.write(b'half')\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True, text=True)
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_worker_stopped_by_sigterm_dies_of_it_when_a_loader_worker_dies_meanwhile():
    # The launcher's SIGTERM reaches the worker's DataLoader workers too; torch's SIGCHLD handler raises
    # when one dies, and raised inside the SIGTERM handler it ended the worker with a traceback ahead
    # of the run's one line (test_run_loader_workers' os._exit case, a fresh clone on 2026-12-05).
    script = (
        "import os, signal, time\n"
        "import phalanx.runtime.lifeline as lifeline\n"
        "def raising(signum, frame):\n"
        "    raise RuntimeError('DataLoader worker (pid 1) is killed by signal: Terminated.')\n"
        "lifeline.remove_unfinished = lambda: time.sleep(2)  # a child dies while the handler runs\n"
        "lifeline.flush_on_sigterm()\n"
        "signal.signal(signal.SIGCHLD, raising)\n"
        "if os.fork() == 0:\n"
        "    time.sleep(0.3)\n"
        "    os._exit(0)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(10)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True, text=True)
    assert done.returncode == -signal.SIGTERM and "Traceback" not in done.stderr, (done.returncode, done.stderr)
