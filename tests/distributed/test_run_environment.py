"""`phalanx run` workers see what torchrun's workers see, and a failing script is reported as it failed.

- A probe script (scripts/env_probe.py) started by path relative to its directory, under torchrun
  and under `phalanx run --devices cpu:2 --threads-per-device 1`: the same absolute `__file__`
  (it still reads itself after a chdir), sys.argv[0] as given, sys.path[0], OMP_NUM_THREADS=1 (and
  MKL_NUM_THREADS, with torch's thread count) and a TORCHELASTIC_ERROR_FILE of each worker's own;
  every variable torchrun's agent gives a worker, phalanx gives too.
- Their string hashes: every rank's alike (one salt per launcher; a PYTHONHASHSEED given is kept).
- Their sys.stdin: the launcher's, under both (multiprocessing gives a spawned worker's Python
  /dev/null), so `breakpoint()` on rank 0 takes pdb commands from it, as under torchrun, as does
  `torch.distributed.breakpoint()`.
- The same probe as a module (`-m env_probe --lr 0.1`), under both: the same `__file__`,
  sys.argv, sys.path[0] (the working directory), `__name__` and `__spec__`.
- A script that calls torch.set_num_threads(3) is named once, on rank 0, with the count it runs on.
- Two ranks that raise each on their own are both failures ("failed too"), not "stopped too".
- A script whose torch `@record` entry point wrote its error file and then exited with a code:
  the failure line carries what it recorded.
- A DDP script opening its group with backend "nccl" on CPU workers is told, in one line, to use gloo.
- torch.nn.SyncBatchNorm in an unchanged DDP script on CPU workers is refused in one line naming
  `phalanx.prepare(model, batchnorm="sync")`, and that fix, with the script's
  `convert_sync_batchnorm` kept, trains as one device on the full batch within 1e-12 (float64).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from phalanx.runtime import fork_guard

pytestmark = pytest.mark.distributed

SCRIPTS = Path(__file__).resolve().parent / "scripts"
TIMEOUT_S = 240


def _phalanx_run(script: Path | str, *args: str, cwd: Path | None = None, env: dict | None = None,
                 devices: str = "cpu:2") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", devices, "--threads-per-device", "1",
                           "--timeout", "60", "--quiet", str(script), *args], capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=cwd, env={**os.environ, **(env or {})})


def _script(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(text))
    return path


def _probe(out: Path, command: list[str], stdin: int | None = None) -> dict:
    out.mkdir()
    env = {key: value for key, value in os.environ.items() if key not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=SCRIPTS, stdin=stdin,
                          env={**env, "PROBE_OUT": str(out)})
    assert done.returncode == 0, done.stderr[-3000:]
    return {rank: json.loads((out / f"{rank}.json").read_text()) for rank in (0, 1)}


def test_a_phalanx_run_worker_sees_what_a_torchrun_worker_sees(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    assert torchrun, "torchrun ships with torch"
    given, keep = os.pipe()  # both launchers' stdin: their workers read the same pipe
    theirs = _probe(tmp_path / "torchrun", [torchrun, "--standalone", "--nproc-per-node", "2", "env_probe.py"], given)
    ours = _probe(tmp_path / "phalanx", [sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2",
                                         "--threads-per-device", "1", "--quiet", "env_probe.py"], given)
    os.close(given), os.close(keep)
    for rank in (0, 1):
        t, p = theirs[rank], ours[rank]
        assert p["stdin"] == t["stdin"] and t["stdin"].startswith("pipe:"), (p["stdin"], t["stdin"])  # not /dev/null
        assert p["file"] == t["file"] == str(SCRIPTS / "env_probe.py")  # absolute, as python's own
        assert p["argv0"] == t["argv0"] == "env_probe.py"  # as given
        assert p["path0"] == t["path0"] and p["reads_itself"] and t["reads_itself"]
        assert p["env"]["OMP_NUM_THREADS"] == t["env"]["OMP_NUM_THREADS"] == "1"
        assert p["env"]["MKL_NUM_THREADS"] == "1" and p["threads"] == 1
        assert p["fork_guard"] == fork_guard.needed() and not t["fork_guard"]  # a script's own group: no guard
        assert p["env"]["TORCHELASTIC_ERROR_FILE"].endswith(f"/{rank}/error.json")
        assert Path(p["env"]["TORCHELASTIC_ERROR_FILE"]).parent.parent.name.startswith("phalanx-errors-")
        agent_gives = {key for key in t["env"] if key not in os.environ or key == "OMP_NUM_THREADS"} - {"PROBE_OUT"}
        assert agent_gives - set(p["env"]) == set(), f"torchrun gives {agent_gives - set(p['env'])}, phalanx not"
    assert ours[0]["env"]["TORCHELASTIC_ERROR_FILE"] != ours[1]["env"]["TORCHELASTIC_ERROR_FILE"]
    assert not Path(ours[0]["env"]["TORCHELASTIC_ERROR_FILE"]).parents[1].exists()  # removed with the run


def test_every_rank_hashes_strings_alike_and_a_given_seed_is_kept(tmp_path, monkeypatch):
    """A set of strings iterates in one order on every rank (runtime/hash_seed.py): before, each
    spawned worker salted hash() on its own, so `list(set(words))` gave each rank other token ids."""
    command = [sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--threads-per-device", "1", "--quiet",
               "env_probe.py"]
    ours = _probe(tmp_path / "drawn", command)
    assert ours[0]["hash"] == ours[1]["hash"]
    assert "PYTHONHASHSEED" not in os.environ or os.environ["PYTHONHASHSEED"] == ours[0]["env"]["PYTHONHASHSEED"]
    given = subprocess.run([sys.executable, "-c", "print(hash('phalanx'))"], capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": "7"}, timeout=60).stdout.strip()
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    kept = _probe(tmp_path / "given", command)
    assert kept[0]["hash"] == kept[1]["hash"] == int(given)


def test_a_module_under_phalanx_run_sees_what_it_sees_under_torchrun(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    theirs = _probe(tmp_path / "torchrun", [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "env_probe",
                                            "--lr", "0.1"])
    ours = _probe(tmp_path / "phalanx", [sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--quiet", "-m",
                                         "env_probe", "--lr", "0.1"])
    for rank in (0, 1):
        t, p = theirs[rank], ours[rank]
        assert p["file"] == t["file"] == p["argv0"] == t["argv0"] == str(SCRIPTS / "env_probe.py")
        assert p["args"] == t["args"] == ["--lr", "0.1"]
        assert p["path0"] == t["path0"] == str(SCRIPTS)
        assert (p["name"], p["spec"]) == (t["name"], t["spec"]) == ("__main__", "env_probe")
        assert p["reads_itself"] and t["reads_itself"]


# breakpoint() on rank 0 alone, the others waiting in a barrier; dist.breakpoint() on every rank (it barriers itself)
@pytest.mark.parametrize("stop", ["if world.rank == 0:\n        breakpoint()\n    dist.barrier()",
                                  "dist.breakpoint(rank=0)"], ids=["breakpoint", "dist.breakpoint"])
def test_pdb_on_rank_0_reads_the_terminal_as_under_torchrun(tmp_path, stop):
    script = tmp_path / "script.py"
    script.write_text("import torch.distributed as dist\nimport phalanx\nif __name__ == '__main__':\n"
                      f"    world = phalanx.init()\n    x = 41 + world.rank\n    {stop}\n"
                      "    print('after', world.rank)\n")
    done = subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--quiet", str(script)],
                          input=("up\n" if "dist.breakpoint" in stop else "") + "p x\nc\n", capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(Pdb) 41\n" in done.stdout and sorted(done.stdout.split("(Pdb) ")[-1].split("\n")[:2]) == [
        "after 0", "after 1"], done.stdout


def test_a_script_that_sets_its_own_threads_is_named_once_with_its_count(tmp_path):
    script = _script(tmp_path, """
        import torch, torch.distributed as dist
        torch.set_num_threads(3)
        dist.init_process_group("gloo")
        dist.barrier()
        dist.destroy_process_group()
    """)
    done = _phalanx_run(script)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "set torch's threads" in line]
    assert said == ["phalanx run: the script set torch's threads to 3: rank 0 runs on 3 threads, not the 1 phalanx "
                    "gave each worker (torch.set_num_threads, in the script or a library it calls)"], done.stderr


def test_two_ranks_failing_each_on_their_own_are_both_named_as_failures(tmp_path):
    script = _script(tmp_path, """
        import torch.distributed as dist
        dist.init_process_group("gloo")
        dist.barrier()
        raise ValueError(f"comm hook refused (the same on every rank)")
    """)
    done = _phalanx_run(script)
    assert done.returncode == 1, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    first = next(line for line in lines if line.startswith("phalanx: worker rank"))
    failed = int(first.split()[3])
    assert first == f"phalanx: worker rank {failed} failed: ValueError: comm hook refused (the same on every rank)"
    assert f"rank {1 - failed} failed too: ValueError: comm hook refused (the same on every rank)" in lines, lines
    assert not any("stopped too" in line for line in lines), lines


def test_what_a_worker_recorded_with_torchs_record_is_in_the_failure_line(tmp_path):
    script = _script(tmp_path, """
        import os
        from torch.distributed.elastic.multiprocessing.errors import record

        @record
        def main():
            if os.environ["RANK"] == "1":
                raise ValueError("bad shard on rank 1")

        try:
            main()
        except ValueError:
            os._exit(3)  # the script's own way out: no exception reaches the launcher
    """)
    done = _phalanx_run(script)
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.splitlines()[0] == ("phalanx: worker rank 1 failed: exited with code 3 without a result: "
                                           "ValueError: bad shard on rank 1"), done.stderr[-3000:]


SYNC_BN_SCRIPT = """
    import sys
    import torch, torch.nn.functional as F
    from torch import nn
    import torch.distributed as dist

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3)).double()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(16, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (16,), generator=g)
    if sys.argv[1] == "ddp":  # the unchanged DDP script
        dist.init_process_group("gloo")
        ddp = nn.parallel.DistributedDataParallel(model)
    else:  # the fix the refusal names
        import phalanx
        world = phalanx.init()
        dp = phalanx.prepare(model, world=world, batchnorm="sync")
        optimizer = dp.optimizer(torch.optim.SGD, lr=0.1)
        lo, hi = 8 * world.rank, 8 * world.rank + 8
        for _ in range(3):
            dp.zero_grad()
            phalanx.shard_loss(F.cross_entropy(dp(X[lo:hi]), y[lo:hi], reduction="sum"), 16).backward()
            dp.finish_gradient_sync()
            optimizer.step()
        state = dp.full_state_dict()
        if world.is_main:
            torch.save(state, sys.argv[2])
        dp.close()
"""


def test_torch_sync_batchnorm_on_cpu_workers_is_refused_in_one_line_naming_prepare(tmp_path):
    script = _script(tmp_path, SYNC_BN_SCRIPT)
    refused = _phalanx_run(script, "ddp")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.splitlines() == [
        "phalanx: error: torch.nn.SyncBatchNorm runs on GPUs only (torch refuses it for CPU workers, under torchrun "
        "too); on CPU workers wrap the model with phalanx.prepare(model, batchnorm=\"sync\") instead of "
        "DistributedDataParallel: it normalizes with the whole global batch's statistics, torch's SyncBatchNorm "
        "layers included"], refused.stderr[-3000:]
    fixed = _phalanx_run(script, "phalanx", str(tmp_path / "state.pt"))
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    got = torch.load(tmp_path / "state.pt", weights_only=True)
    # One device, the full batch, plain BatchNorm: the update sync BatchNorm must reproduce.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3)).double()
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(16, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (16,), generator=g)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        F.cross_entropy(model(X), y).backward()
        optimizer.step()
    want = model.state_dict()
    assert set(got) == set(want)
    worst = max(((got[k].double() - want[k].double()).abs().max()
                 / want[k].double().abs().max().clamp_min(1e-300)).item() for k in want)
    assert worst <= 1e-12, f"{worst:.3g} (relative) from one device's full-batch BatchNorm"


def test_a_ddp_script_opening_nccl_on_cpu_workers_is_told_to_use_gloo(tmp_path):
    script = _script(tmp_path, """\
        import torch.distributed as dist
        if __name__ == "__main__":
            dist.init_process_group(backend="nccl")  # the DDP tutorials' line, on CPU workers
        """)
    refused = _phalanx_run(script)
    assert refused.returncode == 2, refused.stderr[-3000:]
    lines = [line for line in refused.stderr.splitlines() if line.startswith("phalanx")]
    assert lines == ["phalanx: error: the script's process group uses backend \"nccl\" at script.py:3 "
                     "(`dist.init_process_group(backend=\"nccl\")  # the DDP tutorials' line, on CPU wo...`), which "
                     "runs on GPUs only, and these workers are CPU workers (--devices cpu:N): open it with "
                     "init_process_group(\"gloo\") on CPU (a script that picks its backend from a device option of its "
                     "own, as timm's train.py from --device, takes that option's CPU value), or call phalanx.init(), "
                     "which picks gloo on CPU and NCCL on GPUs"], refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr


def test_a_script_group_collective_past_the_timeout_is_one_line_naming_the_timeout(tmp_path):
    # Rank 0 busy alone (an evaluation) past --timeout: gloo's own words were "worker rank 1 failed:
    # RuntimeError: [.../unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete".
    script = _script(tmp_path, """\
        import time
        import torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 0:
            time.sleep(15)
        dist.barrier()
        """)
    done = subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--timeout", "4", "--quiet",
                           str(script)], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 1, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    # then where rank 0 was (crash_site.py): its sleep, the script's line 5
    assert lines[-2:] == [f"rank 0 had not reported when the run stopped: it was at {script}:5 (<module>)",
                          f'  File "{script}", line 5, in <module>'], done.stderr[-3000:]
    assert lines[-3] == (
        "phalanx: run stopped: rank 1 waited 4 s in a collective of the script's own process group for another rank, "
        "the --timeout phalanx run gives a group opened without timeout= (torchrun leaves torch's 30 minutes): another "
        "rank was busy that long (a dataset's preprocessing, an evaluation or a save on one rank alone?) or never "
        "made the call; raise --timeout (--timeout 1800 waits as long as torchrun), or pass timeout= to "
        "init_process_group where the script opens the group"), done.stderr[-3000:]


def test_a_torch_distributed_call_on_one_rank_after_phalanx_init_names_both_ranks_calls(tmp_path):
    # DDP's logging habit, `if rank == 0: dist.all_reduce(t)`, beside phalanx's exchange: the line said
    # "the script's own process group ... pass timeout= to init_process_group" (a call the script never
    # made) and named neither rank nor where the other one waited.
    script = _script(tmp_path, """\
        import torch, torch.distributed as dist, phalanx
        world = phalanx.init()
        dp = phalanx.prepare(torch.nn.Linear(3, 2), world=world)
        for step in range(3):
            if step == 1 and world.rank == 0:
                dist.all_reduce(torch.ones(1))
            dp.zero_grad()
            phalanx.shard_loss(dp(torch.randn(4, 3)).sum(), 8).backward()
            dp.finish_gradient_sync()
        """)
    done = subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--timeout", "4", "--quiet",
                           str(script)], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("phalanx: run stopped: rank ") and "waited 4 s in a " in last, done.stderr[-3000:]
    # Whichever rank's deadline the launcher heard first: both name the other's call.
    assert last in (
        "phalanx: run stopped: rank 0 waited 4 s in a torch.distributed collective of the script's own for another "
        "rank, the --timeout of the process group phalanx.init() opened, while rank 1 waited in step 2's gradient "
        "bucket 0 (40 B), a collective of phalanx's: the ranks made different collective calls (a torch.distributed "
        "call on some ranks only?); every rank must make the same collective calls in the same order",
        "phalanx: run stopped: worker rank 0 was outside any collective (state: sleeping) after step 1 while rank 1 "
        "waited 4 s in step 2's gradient bucket 0 (40 B), past the 4 s timeout: work on rank 0 alone (sampling, an "
        "evaluation or a save on rank 0 only?) took that long, or it never made the call; raise --timeout, or have "
        "every rank take part in that work"), done.stderr[-3000:]
