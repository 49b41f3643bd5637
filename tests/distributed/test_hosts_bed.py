"""Several hosts, simulated on this machine: network namespaces joined by veth links, each with its
own /dev/shm and its own torchrun agent (phalanx/measure/hosts_bed.py), as real machines run.

2 hosts x 2 workers: `phalanx train` in float64 (LeNet and the MLP, 2 epochs) ends within 1e-12
of 1 device with every replica checked bitwise at every step, and so does LeNet sharded to ZeRO-3;
the first line names the hierarchy; a user's script's 4 ranks end bitwise equal and within 1e-12
of 1 device, also when every other step leaves a head out; a host that dies mid-epoch ends the run
on the other host within --timeout, named in one line, nothing left in any host's /dev/shm; and
under `--max-restarts` a worker killed after a checkpoint is resumed on every host to the same
bits as an uninterrupted run. Needs root and iproute2: elsewhere every test skips with the
reason. Every namespace and mount the bed makes is removed however a test ends.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from phalanx.measure.hosts_bed import HostsBed, bed_unavailable, remove_stale
from phalanx.measure.hosts_run import agent_argv, bed_env, run_agents
from tests.conftest import write_digits_idx

REASON = bed_unavailable()
pytestmark = [pytest.mark.distributed, pytest.mark.skipif(REASON is not None, reason=f"no simulated hosts: {REASON}")]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "distributed" / "ddp_habits_script.py"
DEADLINE_S = 300
RTOL = 1e-12
HIERARCHY = ("allreduce hierarchical: shm within each of 2 hosts x 2 workers, gloo between hosts, "
             "1/2 of each bucket per link (auto: 4 ranks span hosts, and memory is shared within a host only)")


@pytest.fixture(scope="module")
def small_idx(tmp_path_factory) -> Path:
    return write_digits_idx(tmp_path_factory.mktemp("idx") / "fashion-mnist-like", num_train=600, num_test=200)


def common(small_idx: Path, model: str = "lenet", epochs: int = 2) -> list[str]:
    return ["--model", model, "--data-dir", str(small_idx), "--epochs", str(epochs), "--batch-size", "128",
            "--dtype", "float64", "--no-progress", "--threads-per-device", "1"]


def one_device(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "phalanx", *args], capture_output=True, text=True,
                          timeout=DEADLINE_S, env=bed_env())
    assert done.returncode == 0, done.stderr[-3000:]


def on_two_hosts(bed: HostsBed, tmp_path: Path, *module_args: str, max_restarts: int = 0) -> list[str]:
    return run_agents(bed, lambda h: agent_argv(hosts=2, host=h, per_host=2, module_args=list(module_args),
                                                max_restarts=max_restarts),
                      logs=tmp_path, deadline_s=DEADLINE_S, env=bed_env())


def max_rel(a: dict, b: dict) -> float:
    return max(((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp_min(1e-30)).item()
               for k in b)


def left_in_shm(bed: HostsBed) -> list[str]:
    return [f"host {h}: {name}" for h in range(bed.hosts) for name in os.listdir(bed.shm_dir(h))]


def test_the_bed_removes_every_namespace_and_mount_it_made():
    with HostsBed(hosts=2, link_gbit=1.0) as bed:
        names = [bed.namespace(0), bed.namespace(1), f"{bed.prefix}-sw"]
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert all(name in listed for name in names), listed
        assert all(bed.shm_dir(h).is_mount() for h in range(2))
        qdisc = subprocess.run(["tc", "-n", bed.namespace(0), "qdisc", "show", "dev", "eth0"], capture_output=True,
                               text=True).stdout
        assert "tbf" in qdisc and "rate 1Gbit" in qdisc, qdisc
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names), listed
    assert not any(bed.shm_dir(h).exists() for h in range(2))
    # What a bed of a dead process left is removed by the next one (pid 2**22 + 1 cannot run).
    stale = "phxbed-4194305-0-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    assert stale in remove_stale()
    assert stale not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout



def test_the_sweep_follows_no_link_and_a_planted_name_stops_no_bed(tmp_path):
    # On a shared host /tmp is everyone's. Before: another user's link at a dead bed's name had
    # `umount -l` follow it (to /dev/shm, every job's), and a file at a bed's next name ended the
    # bed in FileExistsError.
    target = tmp_path / "a-mount-of-this-machine"
    target.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(target)], check=True)
    link = Path("/tmp") / "phxbed-4194305-0-h0-shm"  # pid 2**22 + 1 cannot run: a dead bed's name
    try:
        link.symlink_to(target)
        remove_stale()
        assert target.is_mount(), "the sweep unmounted what a link at a dead bed's name pointed to"
        bed = HostsBed(hosts=1)
        planted = Path("/tmp") / f"{bed.namespace(0)}-shm"  # the name the bed's /dev/shm had
        planted.write_text("planted")
        try:
            with bed:
                assert bed.shm_dir(0).is_mount()
        finally:
            planted.unlink()
    finally:
        link.unlink(missing_ok=True)
        subprocess.run(["umount", "-l", str(target)], capture_output=True)

# (model, extra flags): the MLP and LeNet with every replica compared bitwise at every step, and
# LeNet sharded to ZeRO-3 (the hierarchical reduce-scatter and all-gather). SGD throughout: Adam's
# division by the root of its second moment magnifies any sum order's rounding (1.4e-12 after 2
# epochs with ZeRO-3 on 4 ranks of one host through shm as on 2 hosts), past this test's 1e-12.
RUNS = [("lenet", ("--check-every", "1")), ("mlp", ("--check-every", "1")), ("lenet", ("--shard", "parameters"))]


@pytest.mark.parametrize("model, extra", RUNS, ids=["lenet", "mlp", "lenet-zero3"])
def test_train_on_two_hosts_of_two_workers_equals_one_device_and_names_the_hierarchy(model, extra, small_idx,
                                                                                      tmp_path):
    one_device("train", "--devices", "cpu:1", *common(small_idx, model), *extra, "--out", str(tmp_path / "one"))
    with HostsBed(hosts=2) as bed:
        node0, node1 = on_two_hosts(bed, tmp_path, "-m", "phalanx", "train", *common(small_idx, model), *extra,
                                    "--out", str(tmp_path / "two"))
        assert left_in_shm(bed) == []
    first = node0.splitlines()[0]
    assert first.startswith(f"training {model} on fashion-mnist"), first
    assert HIERARCHY in first, first
    assert node1 == ""  # rank 0 reports; host 1 prints nothing
    reference = torch.load(tmp_path / "one" / "model.pt", weights_only=True)
    state = torch.load(tmp_path / "two" / "model.pt", weights_only=True)
    assert list(state) == list(reference)
    assert max_rel(state, reference) < RTOL


@pytest.mark.parametrize("extra", [[], ["--two-heads"]], ids=["one head", "a head every other step"])
def test_a_user_script_on_two_hosts_ends_bitwise_equal_on_every_rank(tmp_path, extra):
    """With --two-heads every other step leaves a head out: the usage flags that drop its gradient
    ride in the last bucket through the hierarchical exchange (else SGD's momentum would move it)."""
    one_device("run", "--devices", "cpu:1", "--timeout", "60", str(SCRIPT), "--out", str(tmp_path / "one"), *extra)
    with HostsBed(hosts=2) as bed:
        node0, _ = on_two_hosts(bed, tmp_path, str(SCRIPT), "--out", str(tmp_path / "two"), *extra)
    assert node0.splitlines()[0].startswith(f"replica: {HIERARCHY}, overlapped gradient exchange"), node0[:400]
    ranks = [torch.load(tmp_path / "two" / f"rank{r}.pt", weights_only=True) for r in range(4)]
    for rank in ranks[1:]:
        for key in ranks[0]:
            assert torch.equal(rank[key], ranks[0][key]), key
    assert max_rel(ranks[0], torch.load(tmp_path / "one" / "rank0.pt", weights_only=True)) < RTOL


def _wait_for(predicate, what: str, deadline_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _host_pids(bed: HostsBed, host: int) -> list[int]:
    listed = subprocess.run(["ip", "netns", "pids", bed.namespace(host)], capture_output=True, text=True).stdout
    return [int(pid) for pid in listed.split()]


def test_a_host_that_dies_mid_epoch_ends_the_run_on_the_other_within_the_timeout(small_idx, tmp_path):
    timeout_s = 30
    args = [*common(small_idx, epochs=40), "--timeout", str(timeout_s), "--out", str(tmp_path / "run")]
    with HostsBed(hosts=2) as bed:
        outs = [(tmp_path / f"host{h}.out", tmp_path / f"host{h}.err") for h in range(2)]
        agents = []
        for h in range(2):
            with open(outs[h][0], "w") as out, open(outs[h][1], "w") as err:
                agents.append(bed.popen(h, agent_argv(hosts=2, host=h, per_host=2, module_args=["-m", "phalanx",
                                                                                              "train", *args]),
                                        env=bed_env(), stdout=out, stderr=err))
        _wait_for(lambda: "epoch   2" in outs[0][0].read_text() or agents[0].poll() is not None, "epoch 2")
        assert agents[0].poll() is None, outs[0][1].read_text()[-3000:]
        _kill(_host_pids(bed, 1))  # host 1 goes down: its agent and both workers
        killed = time.monotonic()
        _wait_for(lambda: agents[0].poll() is not None, "host 0's agent to end", deadline_s=2 * timeout_s)
        ended_s = time.monotonic() - killed
        shm = left_in_shm(bed)
    stderr = outs[0][1].read_text()
    assert agents[0].returncode != 0
    assert ended_s < timeout_s, f"host 0 ran on {ended_s:.0f} s after host 1 died"
    said = [line for line in stderr.splitlines() if line.startswith("phalanx: run stopped:")]
    assert said, stderr[-3000:]
    assert re.match(r"phalanx: run stopped: rank [01] \(host 0\) lost its exchange with rank [23] \(host 1\) in a "
                    r"hierarchical allreduce: .* \(that host stopped, or the link to it failed\)$", said[0]), said[0]
    assert shm == []


def test_max_restarts_resumes_every_host_to_the_bits_of_an_uninterrupted_run(small_idx, tmp_path):
    args = [*common(small_idx, epochs=4), "--checkpoint-every", "5", "--timeout", "30"]
    with HostsBed(hosts=2) as bed:
        on_two_hosts(bed, tmp_path, "-m", "phalanx", "train", *args, "--out", str(tmp_path / "whole"))
    out = tmp_path / "restarted"
    with HostsBed(hosts=2) as bed:
        agents = []
        for h in range(2):
            with open(tmp_path / f"r{h}.out", "w") as stdout, open(tmp_path / f"r{h}.err", "w") as stderr:
                agents.append(bed.popen(h, agent_argv(hosts=2, host=h, per_host=2, max_restarts=1,
                                                      module_args=["-m", "phalanx", "train", *args, "--out", str(out)]),
                                        env=bed_env(), stdout=stdout, stderr=stderr))
        _wait_for(lambda: (out / "checkpoints" / "checkpoint.pt").exists() or agents[0].poll() is not None,
                  "the first checkpoint")
        workers = [pid for pid in _host_pids(bed, 1) if pid != agents[1].pid]
        assert workers, "no worker found on host 1"
        _kill(workers[-1:])
        _wait_for(lambda: all(agent.poll() is not None for agent in agents), "both agents to end")
        shm = left_in_shm(bed)
    stdout, stderr = (tmp_path / "r0.out").read_text(), (tmp_path / "r0.err").read_text()
    assert [agent.returncode for agent in agents] == [0, 0], stderr[-3000:]
    assert "resumed from" in stdout, stdout[-2000:]
    whole = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    state = torch.load(out / "model.pt", weights_only=True)
    for key in whole:
        assert torch.equal(state[key], whole[key]), key
    assert shm == []
