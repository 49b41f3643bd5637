"""The launcher's endings, probed from outside: a run that delivered its results has
succeeded however long its workers take to tear down; two SIGTERMs in quick succession, or a
stop while torch is still loading, end in the one "stopped" or "interrupted" line with 128 +
the signal's number and nothing left behind; every line a worker printed reaches the terminal,
whole, even from a worker the launcher stops; a worker that exits 0 has succeeded; too many
threads are named in one warning; an output that cannot be written is one line naming it.
"""

from __future__ import annotations

import atexit
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from phalanx.runtime.devices import parse_devices
from phalanx.runtime.launch import LaunchSpec, launch
from tests.distributed.sockets import listening_addresses
from tests.distributed.test_faults import _alive, _wait_for, _workers, assert_all_gone

pytestmark = pytest.mark.distributed

PHALANX = [sys.executable, "-m", "phalanx"]
TRAIN = ["train", "--devices", "cpu:2", "--dataset", "synthetic", "--no-progress"]


def _spec(world_size: int, **overrides) -> LaunchSpec:
    fields = dict(plan=parse_devices(f"cpu:{world_size}", cuda_count=0), threads_per_device=1, timeout_s=30.0)
    return LaunchSpec(**{**fields, **overrides})


def deliver_then_linger(world, linger_s: float) -> tuple[int, int]:
    atexit.register(time.sleep, linger_s)  # runs after the result is delivered, at interpreter exit
    return world.rank, os.getpid()


def test_a_teardown_slower_than_the_collective_timeout_is_still_a_success():
    # The wait for workers to exit is bounded by teardown_s, not by timeout_s (which is about collectives):
    # under timeout_s this run would end "worker rank 0 failed: delivered its result but did not exit in time".
    results = launch(deliver_then_linger, 8.0, spec=_spec(2, timeout_s=5.0))
    assert [rank for rank, _ in results] == [0, 1]


def test_a_teardown_that_never_ends_is_killed_quietly_and_the_results_stand():
    results = launch(deliver_then_linger, 3600.0, spec=_spec(2, teardown_s=2.0))
    assert [rank for rank, _ in results] == [0, 1]
    assert not any(_alive(pid) for _, pid in results)  # killed and reaped, not left lingering


def _start(argv: list[str], tmp_path: Path, *, command=PHALANX) -> subprocess.Popen:
    """`phalanx <argv>` with TMPDIR in tmp_path (where a rendezvous directory would go)."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    return subprocess.Popen([*command, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def _leftovers(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "tmp").iterdir() if p.name.startswith("phalanx-"))


# A run with --out saves where a SIGTERM or a Ctrl-C stops it (tests/distributed/test_stop_saves.py).
SAVED = (r"phalanx: stopped by {} after epoch \d+, step \d+ of \d+, saved in .+; run the same command with --resume "
         r"auto to continue")


@pytest.mark.parametrize("signum, gap_s, code, line", [
    (signal.SIGTERM, 0.01, 143, SAVED.format("SIGTERM")),
    (signal.SIGTERM, 0.05, 143, SAVED.format("SIGTERM")),
    (signal.SIGINT, 0.02, 130, SAVED.format("SIGINT")),  # the second Ctrl-C absorbed: the save is not cut short
])
def test_a_second_stop_signal_while_stopping_is_absorbed(tmp_path, signum, gap_s, code, line):
    # SIGTERM twice, as a scheduler escalating: unabsorbed, the second kills the launcher (exit -15, no
    # "stopped" line, $TMPDIR/phalanx-rendezvous-* left behind with its store file), or cuts its workers' save short.
    out = tmp_path / "run"
    proc = _start([*TRAIN, "--epochs", "200", "--out", str(out)], tmp_path)
    try:
        workers = _workers(proc.pid, 2)
        _wait_for(out / "metrics.jsonl")  # training is under way
        for _ in range(2):
            if signum == signal.SIGINT:
                os.killpg(proc.pid, signum)  # a terminal's Ctrl-C reaches the whole group
            else:
                os.kill(proc.pid, signum)  # the launcher alone, as `timeout` and schedulers do
            time.sleep(gap_s)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == code, stderr[-2000:]
    assert re.fullmatch(line, stderr.strip().splitlines()[-1]), stderr[-2000:]
    assert_all_gone(workers)
    assert _leftovers(tmp_path) == []


def _console_script() -> list[str]:
    found = shutil.which("phalanx", path=str(Path(sys.executable).parent))
    assert found, "the phalanx console script is installed beside this interpreter"
    return [found]


def _wait_until_torch_loads(pid: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if "libtorch" in Path(f"/proc/{pid}/maps").read_text():
                return
        except OSError:
            break  # the process is gone
        time.sleep(0.002)
    raise AssertionError(f"process {pid} never loaded libtorch")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="watches /proc/<pid>/maps")
@pytest.mark.parametrize("entry", ["python -m phalanx", "phalanx"])
@pytest.mark.parametrize("signum, code, line", [
    (signal.SIGINT, 130, "phalanx: interrupted"),
    (signal.SIGTERM, 143, "phalanx: stopped by SIGTERM; every worker was stopped"),
])
def test_a_stop_while_torch_is_loading_is_one_line(tmp_path, entry, signum, code, line):
    # Unhandled, SIGINT here is a 41-line KeyboardInterrupt traceback, and SIGTERM kills without a line.
    command = PHALANX if entry.startswith("python") else _console_script()
    proc = _start([*TRAIN, "--epochs", "1"], tmp_path, command=command)
    try:
        _wait_until_torch_loads(proc.pid)  # torch's shared library is mapped; its import is under way
        os.kill(proc.pid, signum)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert (proc.returncode, stderr.strip()) == (code, line)
    assert _leftovers(tmp_path) == []


FLOOD = textwrap.dedent("""
    import time
    import phalanx

    world = phalanx.init()
    for i in range({lines}):
        print(f"rank {{world.rank}} line {{i:06d}} " + "x" * 40)
    print(f"rank {{world.rank}} LAST")
    if world.rank == 1:
        raise RuntimeError("rank 1 gives up")
    time.sleep(3600)  # rank 0 waits until the launcher stops it
""")
FLOOD_LINES = 19_000  # ~1.1 MB per rank


@pytest.mark.parametrize("stdout_to, unbuffered", [("file", False), ("pipe", True)])
def test_every_line_reaches_the_terminal_whole_when_a_run_fails(tmp_path, stdout_to, unbuffered):
    # Block-buffered (a file, PYTHONUNBUFFERED unset), a rank stopped or failing loses its last ~60 lines
    # unless it flushes first; unbuffered, print writes text and newline separately and two ranks' writes
    # interleave (~1,000 of 38,000 lines torn) unless each line is written in one piece.
    script = tmp_path / "flood.py"
    script.write_text(FLOOD.format(lines=FLOOD_LINES))
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    command = [*PHALANX, "run", "--devices", "cpu:2", "--quiet", str(script)]
    if stdout_to == "file":
        with open(tmp_path / "out.txt", "w") as sink:
            proc = subprocess.run(command, stdout=sink, stderr=subprocess.PIPE, text=True, env=env, timeout=240)
        stdout = (tmp_path / "out.txt").read_text()
    else:
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)
        stdout = proc.stdout
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[0] == "phalanx: worker rank 1 failed: RuntimeError: rank 1 gives up"
    lines = stdout.splitlines()
    torn = [line for line in lines if not re.fullmatch(r"rank [01] (line \d{6} x{40}|LAST)", line)]
    assert torn == [], f"{len(torn)} torn lines, e.g. {torn[:3]}"
    expected = {f"rank {r} line {i:06d} " + "x" * 40 for r in (0, 1) for i in range(FLOOD_LINES)}
    expected |= {"rank 0 LAST", "rank 1 LAST"}
    assert len(lines) == len(expected) and set(lines) == expected, f"{len(expected - set(lines))} lines lost"


def test_a_worker_that_exits_0_has_succeeded(tmp_path):
    # Exit 0 is success even without a result, not "worker rank 0 failed: exited with code 0 without a result".
    script = tmp_path / "early_exit.py"
    script.write_text("import os, phalanx\nworld = phalanx.init()\nprint(f'rank {world.rank} done')\n"
                      "if world.rank == 0:\n    os._exit(0)\n")
    proc = subprocess.run([*PHALANX, "run", "--devices", "cpu:2", str(script)], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["rank 0 done", "rank 1 done"]


def test_threads_beyond_the_cores_get_one_warning(tmp_path):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    proc = subprocess.run([*PHALANX, "train", "--devices", "1", "--dataset", "synthetic", "--epochs", "1",
                           "--no-progress", "--threads-per-device", str(cores + 1), "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("phalanx: warning: ")]
    assert warnings == [f"phalanx: warning: --threads-per-device {cores + 1} x 1 local worker(s) = {cores + 1} "
                        f"threads on {cores} cores: they take turns and training can be many times slower; use "
                        f"--threads-per-device {cores}, or leave it unset (cores / workers)"], proc.stderr


def _file_size_limit(limit_bytes: int):
    def limit() -> None:  # in the child: writes past the limit fail with EFBIG, as a full disk fails with ENOSPC
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return limit


@pytest.mark.parametrize("devices", ["1", "cpu:2"])
def test_an_output_that_cannot_be_written_is_one_line_naming_it(tmp_path, devices):
    # One line naming the file: not a 20-line traceback naming the temporary file, nor silence.
    out = tmp_path / "run"
    proc = subprocess.run([*PHALANX, "train", "--devices", devices, "--dataset", "synthetic", "--epochs", "1",
                           "--no-progress", "--allreduce", "native", "--out", str(out)],
                          capture_output=True, text=True, timeout=240, preexec_fn=_file_size_limit(128 << 10))
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()
    # model.pt is the first output past the limit (the metrics rows are small); no checkpoint holds
    # the weights and the limit stops the spare copy too, so the line says they are lost.
    assert len(last) == 1 and re.fullmatch(
        rf"phalanx: run stopped: cannot write {re.escape(str(out))}/model\.pt \(File too large\) nor a copy at "
        r"\S+ \(File too large\); the trained weights are lost: the file is larger than this process may write "
        r"\(ulimit -f, a filesystem's file-size limit\); raise the limit \(ulimit -f unlimited\) or choose another "
        r"filesystem",
        last[0]), proc.stderr[-2000:]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporary file left


def listening_addresses_of_the_launcher(world) -> list[str]:
    """The addresses every TCP socket the launcher listens on is bound to (it is this worker's
    parent only when spawned: a worker forked by the fork server is the server's child)."""
    return listening_addresses(int(os.environ["PHALANX_TEST_LAUNCHER_PID"]))


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux /proc")
def test_the_launchers_store_listens_on_loopback_only(monkeypatch):
    monkeypatch.setenv("PHALANX_TEST_LAUNCHER_PID", str(os.getpid()))
    addresses = launch(listening_addresses_of_the_launcher, spec=_spec(2))[0]
    assert addresses, "the launcher hosts the run's store: it listens on something"
    assert set(addresses) == {"0100007F"}, addresses  # 127.0.0.1 in /proc's hex


# Rank 0 finishes its step with the first SIGTERM held off (an armed `phalanx train`) and waits for
# rank 1 in a collective; rank 1, past its armed part (in its last collectives, or a script's rank
# that never armed), dies of that SIGTERM.
ONE_RANK_HOLDS_THE_STOP = textwrap.dedent("""
    import signal
    import sys
    import time
    import phalanx

    world = phalanx.init()
    if world.rank == 0:
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
    print(f"rank {world.rank} ready", flush=True)
    if world.rank == 1:
        time.sleep(3600)  # the launcher's SIGTERM ends it here
    phalanx.barrier(world=world)
""")


def test_a_stop_that_kills_one_rank_while_its_peer_waits_is_a_stop_not_a_failure(tmp_path):
    # Found by tools/combo_fuzz.py: a SIGTERM that reached `phalanx train` just after its last step
    # ended in "worker rank 1 failed: died (signal SIGTERM)" and "rank 0 stopped too: PeerGone ...",
    # exit 1, as if rank 1 had failed on its own; the launcher had sent that signal itself.
    script = tmp_path / "holds.py"
    script.write_text(ONE_RANK_HOLDS_THE_STOP)
    proc = _start(["run", "--devices", "cpu:2", "--quiet", "--timeout", "60", str(script)], tmp_path)
    try:
        ready = []
        while len(ready) < 2:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()[-2000:]
            ready += [line] if line.endswith("ready\n") else []
        time.sleep(0.3)  # rank 0 in the barrier
        os.kill(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert (proc.returncode, stderr.strip().splitlines()[-1]) == (143, "phalanx: stopped by SIGTERM; every worker was stopped"), stderr[-2000:]


# Rank 1 delivers its result and lingers at exit deaf to SIGTERM (a teardown that ends by itself,
# exit 0); rank 0 still works when the stop comes.
ONE_RANK_DELIVERED = textwrap.dedent("""
    import atexit
    import os
    import signal
    import time

    if os.environ["RANK"] == "1":
        def linger():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(3)
        atexit.register(linger)
        print("rank 1 done", flush=True)
    else:
        time.sleep(3600)  # the launcher's SIGTERM ends it here
""")


def test_a_stop_while_a_rank_that_delivered_its_result_tears_down_is_a_stop_not_a_failure(tmp_path):
    # Found by tools/combo_fuzz.py (seed 62, draw 8): a SIGTERM that reached `phalanx train` as rank 1
    # tore down after its report ended in "worker rank 1 failed: exited with code 0 without a result",
    # exit 1: the stop asked rank 1 for its report again, and its pipe was empty by then.
    script = tmp_path / "delivered.py"
    script.write_text(ONE_RANK_DELIVERED)
    proc = _start(["run", "--devices", "cpu:2", "--quiet", "--timeout", "60", str(script)], tmp_path)
    try:
        assert proc.stdout.readline() == "rank 1 done\n", proc.stderr.read()[-2000:]
        time.sleep(0.8)  # its report read, rank 1 in its linger
        os.kill(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert (proc.returncode, stderr.strip().splitlines()[-1]) == (143, "phalanx: stopped by SIGTERM; every worker was "
                                                                       "stopped"), stderr[-2000:]
