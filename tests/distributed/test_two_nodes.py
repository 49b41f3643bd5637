"""Several machines, tested on one: a 2-node torchrun job on this host.

Two torchrun agents, as two machines would start them (`--nnodes 2 --node-rank 0|1
--nproc-per-node 1`, static rendezvous at 127.0.0.1 on a free port: loopback only), run
`phalanx train` and then a user's script written with phalanx's API
(tests/distributed/ddp_habits_script.py: phalanx.init, prepare, ShardedLoader, a BatchNorm model).
Each node has one local worker, so phalanx sees `local_world_size` (1) != `world_size` (2): ranks
span hosts, shared memory cannot reach between them, and `auto` resolves to the backend's own
allreduce (gloo's) - which the first log line must say, with the reason. Both end within 1e-9
relative of 1 device in float64. Every process is bounded: the agents get a deadline and are
killed with everything they started when it passes.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import write_digits_idx

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "distributed" / "ddp_habits_script.py"
DEADLINE_S = 240
RTOL = 1e-9
ACROSS_HOSTS = ("allreduce native = gloo's own allreduce (auto: the shm allreduce serves the workers of one host; "
                "2 ranks span hosts (1 per host))")


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_and_read(agents: list[subprocess.Popen], files: list) -> list[str]:
    """Kill each agent still running with everything it started (nothing outlives a test), then
    the texts of the `files` their output went to, closed."""
    for agent in agents:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    texts = []
    for f in files:
        f.seek(0)
        texts.append(f.read())
        f.close()
    return texts


def two_nodes(*command: str, nproc: tuple[int, int] = (1, 1)) -> list[subprocess.CompletedProcess]:
    """Run `command` (what follows torchrun's own flags) as node 0 and node 1 of one job, with
    `nproc` workers on each.

    Both agents are watched together: when one fails, the other (whose agent would wait out
    torchrun's 300 s exit barrier for it) is killed at once and the failing node's output shown."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    assert torchrun, "torchrun ships with torch and must be on PATH"
    port = _free_port()
    with tempfile.TemporaryDirectory() as logs:
        outs = [open(Path(logs) / f"node{node}.{stream}", "w+") for node in (0, 1) for stream in ("out", "err")]
        agents = [subprocess.Popen([torchrun, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", str(nproc[node]),
                                    "--master-addr", "127.0.0.1", "--master-port", str(port), *command],
                                   stdout=outs[2 * node], stderr=outs[2 * node + 1], text=True, env=_env(),
                                   start_new_session=True)
                  for node in (0, 1)]
        deadline = time.monotonic() + DEADLINE_S
        try:
            while any(agent.poll() is None for agent in agents) and time.monotonic() < deadline \
                    and all(agent.poll() in (None, 0) for agent in agents):
                time.sleep(0.1)
        finally:
            texts = stop_and_read(agents, outs)
    finished = [subprocess.CompletedProcess(agent.args, agent.returncode, texts[2 * node], texts[2 * node + 1])
                for node, agent in enumerate(agents)]
    failed = [node for node, proc in enumerate(finished) if proc.returncode not in (0, -signal.SIGKILL)]
    for node in failed + [n for n in (0, 1) if n not in failed]:
        proc = finished[node]
        killed = (" (killed: the deadline passed, or the other node failed)"
                  if proc.returncode == -signal.SIGKILL else "")
        assert proc.returncode == 0, \
            f"node {node} exited {proc.returncode}{killed}:\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
    return finished


def max_rel(a: dict, b: dict) -> float:
    return max(((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp_min(1e-30)).item()
               for k in b)


@pytest.fixture(scope="module")
def small_idx(tmp_path_factory) -> Path:
    return write_digits_idx(tmp_path_factory.mktemp("idx") / "fashion-mnist-like", num_train=600, num_test=200)


def _train_on_one_device(small_idx: Path, out: Path) -> list[str]:
    """Train the reference on one device into `out`; the flags the nodes then share."""
    common = ["--data-dir", str(small_idx), "--epochs", "1", "--batch-size", "128", "--dtype", "float64",
              "--no-progress", "--threads-per-device", "1"]
    one = subprocess.run([sys.executable, "-m", "phalanx", "train", "--devices", "cpu:1", *common, "--out", str(out)],
                         capture_output=True, text=True, timeout=DEADLINE_S, env=_env())
    assert one.returncode == 0, one.stderr[-3000:]
    return common


def test_phalanx_train_on_two_nodes_equals_one_device_and_names_the_allreduce(small_idx, tmp_path):
    common = _train_on_one_device(small_idx, tmp_path / "one")
    node0, node1 = two_nodes("-m", "phalanx", "train", *common, "--out", str(tmp_path / "two"))
    first = node0.stdout.splitlines()[0]
    assert first.startswith("training lenet on fashion-mnist (600 train / 200 test images)"), first
    assert ACROSS_HOSTS in first, first
    assert node1.stdout == ""  # rank 0 reports; rank 1's node prints nothing
    reference = torch.load(tmp_path / "one" / "model.pt", weights_only=True)
    state = torch.load(tmp_path / "two" / "model.pt", weights_only=True)
    assert list(state) == list(reference)
    assert max_rel(state, reference) < RTOL


def test_a_user_script_on_two_nodes_equals_one_device(tmp_path):
    one = subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:1", "--timeout", "60",
                          str(SCRIPT), "--out", str(tmp_path / "one")], capture_output=True, text=True,
                         timeout=DEADLINE_S, env=_env())
    assert one.returncode == 0, one.stderr[-3000:]
    node0, _ = two_nodes(str(SCRIPT), "--out", str(tmp_path / "two"))
    assert node0.stdout.splitlines()[0].startswith(f"replica: {ACROSS_HOSTS}, overlapped gradient exchange")
    ranks = [torch.load(tmp_path / "two" / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for key in ranks[0]:  # one model on two machines: every buffer too
        assert torch.equal(ranks[0][key], ranks[1][key]), key
    assert max_rel(ranks[0], torch.load(tmp_path / "one" / "rank0.pt", weights_only=True)) < RTOL


def test_nodes_of_unequal_sizes_fall_back_to_gloo_named_and_equal_one_device(small_idx, tmp_path):
    """docs/many-hosts.md: hosts of unequal sizes fall back to gloo's own allreduce, named in the
    first line. Before, each node described the fallback by its own size ("2 per host", "1 per
    host") and the pre-flight check stopped the run on the two descriptions."""
    common = _train_on_one_device(small_idx, tmp_path / "one")
    node0, _ = two_nodes("-m", "phalanx", "train", *common, "--out", str(tmp_path / "three"), nproc=(2, 1))
    first = node0.stdout.splitlines()[0]
    assert ("allreduce native = gloo's own allreduce (auto: the shm allreduce serves the workers of one host; 3 ranks "
            "span hosts (2, 1 per host: unequal, so not the hierarchical allreduce either))") in first, first
    reference = torch.load(tmp_path / "one" / "model.pt", weights_only=True)
    assert max_rel(torch.load(tmp_path / "three" / "model.pt", weights_only=True), reference) < RTOL
