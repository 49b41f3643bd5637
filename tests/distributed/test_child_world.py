"""Under `phalanx run --devices cpu:2`: rank 0 runs a script with subprocess.run after joining the
run, and that child's phalanx.init() is a world of one in one warning, done in seconds (before, it
tried to join as a second rank 0, the child failed with gloo's traceback after --timeout, and the
run stopped with a line blaming rank 0's own work); a wrapper that starts the real script as its
child before any join still has that child join as the worker (a world of 2, a sum over both), and
a torchrun that a joined worker starts (a sweep's trial) has its own workers join their own run."""

from __future__ import annotations

import textwrap

import pytest

from tests.distributed.runs import run_phalanx

pytestmark = pytest.mark.distributed

CHILD = textwrap.dedent("""\
    import torch, phalanx
    world = phalanx.init()
    total = phalanx.reduce(torch.tensor(1.0), op="sum", world=world)
    print(f"child of size {world.world_size}, sum {float(total):g}", flush=True)
    """)

PARENT = textwrap.dedent("""\
    import subprocess, sys, phalanx
    world = phalanx.init()
    if world.is_main:
        done = subprocess.run([sys.executable, "child.py"], capture_output=True, text=True, timeout=60)
        print(f"rc {done.returncode}: {done.stdout.strip()}", flush=True)
        sys.stderr.write(done.stderr)
    phalanx.barrier(world=world)
    """)

NESTED = textwrap.dedent("""\
    import subprocess, sys, phalanx
    world = phalanx.init()
    if world.is_main:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "child.py"],
                              capture_output=True, text=True, timeout=90)
        print(f"rc {done.returncode}: {done.stdout.strip()}", flush=True)
        sys.stderr.write(done.stderr)
    phalanx.barrier(world=world)
    """)

WRAPPER = textwrap.dedent("""\
    import subprocess, sys
    sys.exit(subprocess.run([sys.executable, "child.py"]).returncode)
    """)


@pytest.fixture
def scripts(tmp_path, monkeypatch):
    for name, text in (("child.py", CHILD), ("parent.py", PARENT), ("wrapper.py", WRAPPER), ("nested.py", NESTED)):
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_joined_workers_child_is_a_world_of_one_and_the_run_goes_on(scripts):
    done = run_phalanx("run", "--devices", "cpu:2", "--timeout", "20", "parent.py", timeout_s=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rc 0: child of size 1, sum 1" in done.stdout, done.stdout
    said = [line for line in done.stderr.splitlines() if "PhalanxWarning" in line]
    assert len(said) == 1 and "a process that worker rank 0 (pid " in said[0], done.stderr[-3000:]
    assert "cannot join the run as a second rank 0" in said[0]


def test_a_wrappers_child_started_before_any_join_joins_as_the_worker(scripts):
    done = run_phalanx("run", "--devices", "cpu:2", "--timeout", "20", "wrapper.py", timeout_s=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("child of size 2, sum 2") == 2, done.stdout
    assert "PhalanxWarning" not in done.stderr, done.stderr[-3000:]


def test_a_launcher_a_joined_worker_starts_has_its_workers_join_their_own_run(scripts):
    done = run_phalanx("run", "--devices", "cpu:1", "--timeout", "60", "nested.py", timeout_s=150)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("child of size 2, sum 2") == 2, done.stdout
    assert "PhalanxWarning" not in done.stderr, done.stderr[-3000:]
