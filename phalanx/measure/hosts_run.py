"""Run a job on simulated hosts: a bed of H hosts (hosts_bed.py), one torchrun agent on each as
on real machines (`--nnodes H --node-rank h --nproc-per-node m`, static rendezvous on host 0's
address), every worker running `hosts_worker` with the job; rank 0's records come back.

gloo is told the interface to use (GLOO_SOCKET_IFNAME=eth0): inside a namespace the machine's
hostname resolves to an address the namespace does not have. Every agent is bounded by
`deadline_s`; when one fails, the others are killed at once (an agent whose peer is gone would
otherwise wait out torchrun's own timeouts) and the failing host's output is named.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from phalanx.measure.hosts_bed import HostsBed, host_address
from phalanx.measure.hosts_worker import BedJob, job_json

MASTER_PORT = 29500  # inside the bed's namespaces: no other program listens there


class BedRunFailed(RuntimeError):
    """An agent on a simulated host failed or passed the deadline; the message holds its output."""


def torchrun_path() -> str:
    found = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if found is None:
        raise BedRunFailed("torchrun is not on PATH (it ships with torch)")
    return found


def agent_argv(*, hosts: int, host: int, per_host: int, module_args: list[str], max_restarts: int = 0) -> list[str]:
    """torchrun's line for host `host` of `hosts`, as on real machines (docs/many-hosts.md)."""
    return [torchrun_path(), "--nnodes", str(hosts), "--node-rank", str(host), "--nproc-per-node", str(per_host),
            "--master-addr", host_address(0), "--master-port", str(MASTER_PORT), "--max-restarts", str(max_restarts),
            *module_args]


def bed_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a bed's agents: gloo on the host's interface, one thread per worker,
    this phalanx importable."""
    package_root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **(extra or {})}


def run_agents(bed: HostsBed, argv_of_host, *, logs: Path, deadline_s: float, env: dict[str, str]) -> list[str]:
    """Start `argv_of_host(h)` on every host of `bed`, wait for all (killing all once one fails
    or the deadline passes); return each host's stdout. BedRunFailed names the failing host."""
    outs = [(logs / f"host{h}.out", logs / f"host{h}.err") for h in range(bed.hosts)]
    procs = []
    for h in range(bed.hosts):
        with open(outs[h][0], "w") as out, open(outs[h][1], "w") as err:
            procs.append(bed.popen(h, argv_of_host(h), env=env, stdout=out, stderr=err))
    deadline = time.monotonic() + deadline_s
    while any(p.poll() is None for p in procs) and all(p.poll() in (None, 0) for p in procs):
        if time.monotonic() > deadline:
            bed.close()
            raise BedRunFailed(f"the agents on {bed.hosts} simulated hosts passed the {deadline_s:g} s deadline; "
                               f"host 0's output:\n{outs[0][1].read_text()[-3000:]}")
        time.sleep(0.2)
    failed = [h for h, p in enumerate(procs) if p.poll() not in (None, 0)]
    if failed:
        bed.close()  # the others' agents would wait for the failed one
        h = failed[0]
        raise BedRunFailed(f"host {h}'s agent exited {procs[h].returncode}:\n{outs[h][1].read_text()[-3000:]}")
    return [out.read_text() for out, _ in outs]


def run_on_bed(job: BedJob, *, hosts: int, per_host: int, link_gbit: float | None, deadline_s: float) -> dict:
    """`job` on `hosts` simulated hosts of `per_host` workers, links of `link_gbit` Gbit/s: the
    records rank 0 gathered (hosts_worker.py), with the bed's facts."""
    with tempfile.TemporaryDirectory(prefix="phalanx-bed-") as tmp, HostsBed(hosts=hosts, link_gbit=link_gbit) as bed:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(job_json(job))
        module = ["-m", "phalanx.measure.hosts_worker", str(job_path), str(out_path)]
        run_agents(bed, lambda h: agent_argv(hosts=hosts, host=h, per_host=per_host, module_args=module),
                   logs=Path(tmp), deadline_s=deadline_s, env=bed_env())
        result = json.loads(out_path.read_text())
    return {**result, "hosts": hosts, "link_gbit": link_gbit}
