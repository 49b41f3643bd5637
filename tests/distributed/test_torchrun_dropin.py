"""`phalanx run` takes a script written for torchrun unchanged: every worker gets
torchrun's environment, no process group is opened for it, its own `init_process_group("gloo")`
(env://) joins phalanx's rendezvous, and it ends with the same model as under torchrun; it also
gets phalanx's one-line failures and `--timeout` on the group it opened. `phalanx.init()` after
the script's own `init_process_group` adopts that group instead of opening a second one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parent / "scripts" / "torchrun_style.py"
RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
             "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _phalanx_run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "phalanx", "run", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env())


def _records(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_a_torchrun_script_runs_unchanged_and_ends_as_under_torchrun(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    assert torchrun, "torchrun ships with torch and must be on PATH"
    under_torchrun, under_phalanx = tmp_path / "torchrun", tmp_path / "phalanx"
    under_torchrun.mkdir()
    under_phalanx.mkdir()
    ran = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", str(SCRIPT), "--out", str(under_torchrun)],
                         capture_output=True, text=True, timeout=300, env=_env())
    # torchrun fails a job whose worker hit gloo's known exit-time abort (SIGABRT after
    # destroy_process_group, ~1 run in 80 for a group the script opens); everything was written by then.
    exit_time_abort = "exitcode  : -6" in ran.stderr and all(
        (under_torchrun / name).exists() for name in ("model.pt", "rank0.json", "rank1.json"))
    assert ran.returncode == 0 or exit_time_abort, ran.stderr[-3000:]
    ran = _phalanx_run("--devices", "cpu:2", str(SCRIPT), "--out", str(under_phalanx))
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert sorted(ran.stdout.splitlines()) == ["rank 0 of 2 done", "rank 1 of 2 done"]

    reference = torch.load(under_torchrun / "model.pt", weights_only=True)
    model = torch.load(under_phalanx / "model.pt", weights_only=True)
    assert set(model) == set(reference)
    for name in reference:  # same data, same shards, same gloo allreduce, float64: bitwise equal
        assert torch.equal(model[name], reference[name]), name
    for theirs, ours in zip(_records(under_torchrun), _records(under_phalanx)):
        assert not ours["initialised_before"] and not theirs["initialised_before"]
        assert ours["local_rank"] == theirs["local_rank"]
        assert {k: ours["env"][k] for k in RANK_VARS} == {k: theirs["env"][k] for k in RANK_VARS}
        assert ours["env"]["MASTER_ADDR"] == "127.0.0.1" and int(ours["env"]["MASTER_PORT"]) > 0
        assert ours["env"]["TORCHELASTIC_RUN_ID"]


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_phalanx_init_adopts_the_group_the_script_opened(tmp_path):
    script = _script(tmp_path, """
        import torch, torch.distributed as dist, phalanx
        dist.init_process_group("gloo")
        world = phalanx.init()  # joins nothing twice
        total = phalanx.allreduce(torch.tensor([float(world.rank + 1)]), world=world)
        print(world.rank, world.world_size, world.backend, int(total.item()), flush=True)
    """)
    ran = _phalanx_run("--devices", "cpu:2", str(script))
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert sorted(ran.stdout.splitlines()) == ["0 2 gloo 3", "1 2 gloo 3"]


def test_torch_s_ddp_tutorial_start_with_mp_spawn_is_adopted_and_without_a_group_is_said(tmp_path):
    """The DDP tutorial's way: torch.multiprocessing.spawn, then init_process_group with the child's
    own rank; before 2026-11-29 phalanx.init() there made each child a world of one, silently."""
    script = _script(tmp_path, """
        import os, socket, sys, warnings
        import torch, torch.distributed as dist, torch.multiprocessing as mp, torch.nn.functional as F
        import phalanx

        def demo(rank, world_size, port, open_group):
            if open_group:
                os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
                dist.init_process_group("gloo", rank=rank, world_size=world_size)
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                world = phalanx.init()
            torch.manual_seed(0)
            with phalanx.prepare(torch.nn.Linear(3, 1).double(), world=world) as dp:
                X = torch.arange(12.0, dtype=torch.float64).reshape(4, 3)[rank::world_size]
                phalanx.shard_loss(dp(X).sum(), 4).backward()
                dp.finish_gradient_sync()
                grad = dp.module.weight.grad.sum().item()
            alone = [str(w.message).split(",")[0] for w in said if issubclass(w.category, phalanx.PhalanxWarning)]
            # One write per line: with PYTHONUNBUFFERED, print writes text and newline apart, and the
            # two children's lines tore into each other on the shared pipe.
            fields = (open_group, world.rank, world.world_size, world.local_rank, world.local_world_size, grad, alone)
            sys.stdout.write(" ".join(map(str, fields)) + "\\n")
            sys.stdout.flush()
            if open_group:
                dist.destroy_process_group()

        if __name__ == "__main__":
            sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]; sock.close()
            for open_group in (True, False):
                mp.spawn(demo, args=(2, port, open_group), nprocs=2, join=True)
    """)
    ran = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=_env())
    assert ran.returncode == 0, ran.stderr[-3000:]
    whole = sum(range(12)) / 4  # the 1-device gradient's sum: every row, summed over both ranks
    assert sorted(ran.stdout.splitlines()) == sorted([
        f"False 0 1 0 1 {sum(range(0, 3)) / 4 + sum(range(6, 9)) / 4} "
        "['phalanx.init() in a child process found no RANK/WORLD_SIZE and no process group']",
        f"False 0 1 0 1 {sum(range(3, 6)) / 4 + sum(range(9, 12)) / 4} "
        "['phalanx.init() in a child process found no RANK/WORLD_SIZE and no process group']",
        f"True 0 2 0 2 {whole} []", f"True 1 2 1 2 {whole} []"])


@pytest.mark.parametrize("devices, starter", [("cpu:2", "mp.spawn"), ("cpu:1", "start_processes")])
def test_a_script_that_spawns_its_own_workers_under_phalanx_run_is_refused_not_left_hanging(tmp_path, devices,
                                                                                          starter):
    """The DDP tutorial under `phalanx run`: its children inherit torchrun's agent-store environment
    and wait for a store no one hosts (torch's 30 minutes); before 2026-11-29 the run hung."""
    script = _script(tmp_path, f"""
        import os, torch.distributed as dist, torch.multiprocessing as mp
        from torch.multiprocessing.spawn import start_processes

        def demo(rank, world_size):
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", "29431"
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
            dist.destroy_process_group()

        if __name__ == "__main__":
            {starter}(demo, args=(3,), nprocs=3, join=True)
    """)
    proc = subprocess.Popen([sys.executable, "-m", "phalanx", "run", "--devices", devices, "--timeout", "20",
                             str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True, cwd=tmp_path)
    try:
        _, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)  # the hung children share the launcher's session
    name = "spawn" if starter == "mp.spawn" else "start_processes"
    line = 1 + next(i for i, text in enumerate(script.read_text().splitlines()) if f"{starter}(demo" in text)
    assert proc.returncode == 2, stderr[-3000:]
    assert stderr.splitlines()[-1] == (
        f"phalanx: error: script.py:{line}: torch.multiprocessing.{name} would start 3 workers of the script's own "
        "under phalanx run, which starts the workers itself (its children would wait forever for a rendezvous): "
        "run it as `python script.py` (phalanx.init() in each child joins the group it opens), or drop the spawn "
        "and run `phalanx run --devices cpu:3 script.py`"), stderr[-3000:]


def test_a_failing_torchrun_script_is_one_line_naming_the_rank(tmp_path):
    script = _script(tmp_path, """
        import torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            raise ValueError("rank 1 found bad data")
        dist.barrier()
    """)
    ran = _phalanx_run("--devices", "cpu:2", "--quiet", str(script))
    assert ran.returncode == 1
    assert ran.stderr.splitlines()[0] == "phalanx: worker rank 1 failed: ValueError: rank 1 found bad data"
    # Rank 1's traceback from the script down, as `python script.py` prints it; rank 0, whose
    # barrier lost its peer, is one line at most, not a second traceback.
    lines = ran.stderr.splitlines()
    assert lines[1:5] == ["--- rank 1 ---", "Traceback (most recent call last):",
                          f'  File "{script}", line 5, in <module>', '    raise ValueError("rank 1 found bad data")']
    rest = lines[lines.index("ValueError: rank 1 found bad data") + 1:]
    assert rest == [] or (len(rest) == 1 and rest[0].startswith("rank 0 stopped too: ")), ran.stderr


def test_the_scripts_own_group_waits_at_most_the_timeout(tmp_path):
    # torch's default for a gloo group is 30 minutes; under `phalanx run --timeout 5` a collective
    # whose peer never comes fails the run instead (the test's own bound is far below 30 minutes).
    script = _script(tmp_path, """
        import time, torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            time.sleep(3600)
        dist.barrier()
    """)
    ran = _phalanx_run("--devices", "cpu:2", "--timeout", "5", "--quiet", str(script), timeout=120)
    assert ran.returncode == 1
    assert ran.stderr.splitlines()[0].startswith("phalanx: run stopped: rank 0 waited 5 s in a collective of the "
                                                 "script's own process group for another rank"), ran.stderr[-2000:]
    assert "a save on one rank alone?" in ran.stderr  # rank 1 was the busy one: no rank named that is not known


def test_the_first_line_names_workers_threads_and_rendezvous_and_quiet_drops_it(tmp_path):
    script = _script(tmp_path, """
        import torch
        print(torch.get_num_threads())
    """)
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    ran = _phalanx_run("--devices", "cpu:2", str(script))
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.split() == [str(threads)] * 2  # what the line says is what each worker got
    first = ran.stderr.splitlines()[0]
    assert re.fullmatch(rf"phalanx run: 2 workers on cpu, {threads} threads? each; rendezvous env:// through "
                        r"phalanx's store at 127\.0\.0\.1:\d+", first), first
    quiet = _phalanx_run("--devices", "cpu:2", "--quiet", str(script))
    assert quiet.returncode == 0 and not quiet.stderr.startswith("phalanx run:"), quiet.stderr[-2000:]


def _on_one_core() -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def test_more_workers_than_cores_is_one_warning_line(tmp_path):
    # Oversubscription is named: on 2 cores --devices cpu:16 runs an epoch in 56 s against 6 s on cpu:2.
    script = _script(tmp_path, "")
    ran = subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--quiet", str(script)],
                         capture_output=True, text=True, timeout=300, env=_env(), preexec_fn=_on_one_core)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stderr.splitlines() == [
        "phalanx: warning: 2 CPU workers on this host, 1 thread each, on 1 core: they take turns and training "
        "can be many times slower; use at most 1 CPU device here"]
