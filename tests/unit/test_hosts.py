"""The arithmetic of many hosts, without processes: the hosts' layout and its words, how a host's
ranks share a bucket and reorder a sharded one, the one-line error of a lost exchange, the link
formulas of bench hosts and predict, and the bed's own checks."""

from __future__ import annotations

import pytest
import torch

from phalanx.bench.hosts import formula_bytes, report_hosts, speedups, summarize
from phalanx.comm.counts import own_range
from phalanx.comm.hierarchical import HostOrder, bucket_shares
from phalanx.comm.hosts import HostLayout, LayoutError, exchange_failed, layout_text
from phalanx.measure.hosts_bed import HostsBed, tbf_args
from phalanx.measure.hosts_worker import BedJob, job_json
from phalanx.predict.costmodel import allreduce_time_s, cost_terms
from phalanx.predict.hosts import host_phase

TWO_BY_TWO = ((0, 1), (2, 3))  # torchrun's numbering: host 0 runs ranks 0, 1


def test_a_layout_names_each_ranks_host_place_and_peers():
    layout = HostLayout(hosts=TWO_BY_TWO, rank=3)
    assert (layout.num_hosts, layout.per_host, layout.host, layout.local) == (2, 2, 1, 1)
    assert layout.members == (2, 3) and layout.peers == (1, 3) and layout.peers_of(0) == (0, 2)
    assert layout.where(1) == "rank 1 (host 0)"
    interleaved = HostLayout(hosts=((0, 2), (1, 3)), rank=2)
    assert (interleaved.host, interleaved.local, interleaved.peers) == (0, 1, (2, 3))


@pytest.mark.parametrize("hosts, message", [(((0, 1), (2,)), "unequal numbers of workers"),
                                            (((0, 1), (1, 2)), "not 0..3, each once")])
def test_a_layout_that_does_not_fit_is_refused(hosts, message):
    with pytest.raises(LayoutError, match=message):
        HostLayout(hosts=hosts, rank=0)


def test_the_layout_in_words():
    assert layout_text(2, 2) == "shm within each of 2 hosts x 2 workers, gloo between hosts, 1/2 of each bucket per link"
    assert layout_text(4, 8, "leader").endswith("gloo between hosts, the whole bucket from one leader per host")


def test_a_lost_exchange_is_one_line_naming_both_ends():
    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                        "[10.77.0.2]:8838: Connection reset by peer. This is typically caused by a remote worker "
                        "hanging or bugs in the application. GLHF!\nmore")
    error = exchange_failed(HostLayout(hosts=TWO_BY_TWO, rank=1), "allreduce", gloo)
    assert str(error) == ("rank 1 (host 0) lost its exchange with rank 3 (host 1) in a hierarchical allreduce: Read "
                          "error [10.77.0.2]:8838: Connection reset by peer (that host stopped, or the link to it "
                          "failed)")
    assert error.restartable and error.culprit == 3


@pytest.mark.parametrize("numel, element_size", [(0, 4), (7, 4), (4099, 8), (65537, 2)])
def test_a_hosts_ranks_share_a_bucket_in_lines_or_through_one_leader(numel, element_size):
    for per_host in (1, 2, 3):
        slices = bucket_shares(numel, element_size, per_host=per_host)
        assert len(slices) == per_host and sum(slices) == numel
        line = 64 // element_size
        assert all(own_range(slices, i)[0] % line == 0 for i in range(per_host) if slices[i])
        assert max(slices) - min(slices) <= 2 * line  # a line apart, and the last one cut short
        assert bucket_shares(numel, element_size, per_host=per_host, variant="leader") == [numel] + [0] * (per_host - 1)


def test_a_sharded_bucket_is_reordered_by_local_rank_then_host_and_back():
    layout = HostLayout(hosts=TWO_BY_TWO, rank=2)
    counts = [1, 2, 3, 4]  # ranks 0..3's ranges of one flat bucket
    order = HostOrder(layout, counts)
    assert not order.identity and order.ranks == [0, 2, 1, 3]
    assert order.shares == [1 + 3, 2 + 4]  # local rank 0: ranks 0 and 2; local rank 1: ranks 1 and 3
    assert order.pieces == [1, 3]  # rank 2's peers (local rank 0 of each host), in host order
    flat = torch.arange(10.0)
    buf = order.gather(flat)
    assert buf.tolist() == [0.0, 3.0, 4.0, 5.0, 1.0, 2.0, 6.0, 7.0, 8.0, 9.0]
    back = torch.zeros(10)
    order.scatter(buf, back)
    assert torch.equal(back, flat)
    assert HostOrder(HostLayout(hosts=((0,), (1,)), rank=0), [3, 4]).identity  # one worker per host: as is


def test_link_terms_across_hosts():
    assert cost_terms("hierarchical", 4, hosts=2) == (2.0, 1.0)
    assert cost_terms("native", 4, hosts=2) == (6.0, 1.5)  # gloo's flat ring: a rank's share crosses each link
    assert cost_terms("hierarchical", 128, hosts=64) == (126.0, 2 * 63 / 64)
    with pytest.raises(ValueError, match="split evenly"):
        cost_terms("hierarchical", 5, hosts=2)
    flat = allreduce_time_s("native", 23.3e6, 4, alpha_s=0.0, beta_Bps=125e6, hosts=2)
    hier = allreduce_time_s("hierarchical", 23.3e6, 4, alpha_s=0.0, beta_Bps=125e6, hosts=2)
    assert flat / hier == pytest.approx(1.5)


def test_bench_hosts_formulas_and_summary():
    assert formula_bytes("allreduce flat", 1000, hosts=2, world_size=4) == 1500
    assert formula_bytes("step hierarchical", 1000, hosts=4, world_size=8) == 1500
    records = [{"round": r, "contender": c, "rank": rank, "local_rank": rank % 2, "time_s": t + 0.01 * rank,
                "sent_bytes": sent} for r in range(2) for rank in range(4)
               for c, t, sent in (("allreduce flat", 0.3, 1.5e6), ("allreduce hierarchical/slices", 0.2, 1.0e6))]
    rows = summarize(records, gradient_bytes=1_000_000, hosts=2, world_size=4, link_gbit=1.0)
    flat, hier = rows
    assert flat["time_s"]["median"] == pytest.approx(0.33) and flat["bytes_error"] == pytest.approx(0.0)
    assert hier["busbw_Bps"] == pytest.approx(1e6 / 0.23 * 1.5)
    assert hier["link_utilization"] == pytest.approx(1e6 / 0.23 / 125e6)
    payload = {"config": {"hosts": 2, "workers_per_host": 2, "link_gbit": 1.0, "model": "mlp",
                          "global_batch_size": 128, "rounds": 2},
               "gradient_bytes": 1_000_000, "rows": rows, "first_line": "allreduce hierarchical: ..."}
    assert speedups(payload) == {"allreduce": pytest.approx(0.33 / 0.23)}
    assert "allreduce 1.43x (bytes per link bound it at 1.50x)" in report_hosts(payload)


def test_predicted_hosts_run_as_the_bed_or_as_machines_like_this_one():
    bed = host_phase(2, 2, 128, 2, simulated=True)  # 4 workers on this machine's 2 cores
    assert (bed.batch_size_per_device, bed.threads, bed.co_runners) == (32, 1, 4)
    real = host_phase(64, 2, 128, 2, simulated=False)  # 2 workers on each host's own 2 cores
    assert (real.batch_size_per_device, real.threads, real.co_runners) == (1, 1, 2)


def test_the_beds_own_checks():
    assert BedJob.from_json(job_json(BedJob(model="mlp", global_batch_size=8))).contenders[0] == "allreduce flat"
    with pytest.raises(ValueError, match="unknown contenders"):
        BedJob(model="mlp", global_batch_size=8, contenders=("step ring",))
    with pytest.raises(ValueError, match="1 to 200 hosts"):
        HostsBed(hosts=0)
    with pytest.raises(ValueError, match="positive number of Gbit/s"):
        HostsBed(hosts=2, link_gbit=0)
    assert tbf_args(1.0) == ["tbf", "rate", "1000mbit", "burst", "250000", "latency", "50ms"]


def test_the_first_line_names_the_hierarchy_and_why():
    from phalanx.data_parallel.choices import Choices

    facts = dict(dtype="float64", batchnorm="local", has_batchnorm=False, num_devices=4, memory_format="contiguous",
                 algorithm="hierarchical", fallback_reason=None, exchanging=True, overlap=True, bucket_kb=(88.0,),
                 grad_dtype=None, backend="gloo", hierarchy=layout_text(2, 2))
    assert Choices(requested_algorithm="auto", **facts).describe().startswith(
        "allreduce hierarchical: shm within each of 2 hosts x 2 workers, gloo between hosts, 1/2 of each bucket per "
        "link (auto: 4 ranks span hosts, and memory is shared within a host only), overlapped gradient exchange")
    assert Choices(requested_algorithm="hierarchical", **facts).describe().startswith(
        "allreduce hierarchical: shm within each of 2 hosts x 2 workers, gloo between hosts, 1/2 of each bucket per "
        "link, overlapped")


def test_the_hierarchical_exchange_pays_its_latency_per_window():
    from phalanx.comm.shm import SLOT_BYTES

    two_and_a_bit = 2 * SLOT_BYTES + 1  # three windows, each a gloo allreduce of 2(H-1) messages
    assert allreduce_time_s("hierarchical", two_and_a_bit, 8, alpha_s=1.0, beta_Bps=1e30, hosts=4) == \
        pytest.approx(3 * 2 * 3)
    assert allreduce_time_s("native", two_and_a_bit, 8, alpha_s=1.0, beta_Bps=1e30, hosts=4) == pytest.approx(14)


def test_the_first_line_names_shm_rounds_that_run_in_python_and_why():
    from phalanx.data_parallel.choices import Choices

    facts = dict(dtype="float32", batchnorm="local", has_batchnorm=False, num_devices=2, memory_format="contiguous",
                 fallback_reason=None, exchanging=True, overlap=True, bucket_kb=(88.0,), grad_dtype=None,
                 backend="gloo")
    compiled = Choices(requested_algorithm="auto", algorithm="shm", shm_rounds="compiled", **facts).describe()
    assert compiled.startswith("allreduce shm (auto: CPU workers on one host share memory), overlapped")
    python = Choices(requested_algorithm="shm", algorithm="shm", shm_rounds="Python (no C compiler (cc) on PATH)",
                     **facts).describe()
    assert python.startswith("allreduce shm, rounds in Python (no C compiler (cc) on PATH), overlapped")


def test_a_bucket_under_a_tenth_of_a_kb_keeps_two_digits():
    from phalanx.data_parallel.choices import Choices

    line = Choices(dtype="float32", batchnorm="local", has_batchnorm=False, num_devices=2, memory_format="contiguous",
                   fallback_reason=None, exchanging=True, overlap=False, bucket_kb=(40 / 1024, 88.0), grad_dtype=None,
                   requested_algorithm="shm", algorithm="shm").describe()
    assert "2 bucket(s) of [0.039, 88.0] KB" in line, line  # was [0.0, 88.0]: a Linear(4, 2) read as empty


@pytest.mark.parametrize("sizes", [(2, 1), (2, 1, 1), (1, 2, 1)])
def test_nodes_of_unequal_sizes_pick_native_alike_and_say_so_alike(sizes):
    """Each node knows its own size only from torchrun; the sizes the world gathered make every
    rank take the same decision and words (before: nodes of 2, 1, 1 took hierarchical on node 0
    and native on the others)."""
    from phalanx.comm import resolve_algorithm, shm_applies
    from phalanx.comm.hosts import hierarchy_applies
    from phalanx.runtime.world import World

    k, worlds = sum(sizes), []
    for node, m in enumerate(sizes):
        first = sum(sizes[:node])
        worlds += [World(rank=first + local, world_size=k, local_rank=local, local_world_size=m,
                         device=torch.device("cpu"), backend="gloo", timeout_s=10.0, node_rank=node, node_sizes=sizes)
                   for local in range(m)]
    assert {resolve_algorithm("auto", w) for w in worlds} == {"native"}
    assert len({shm_applies(w) for w in worlds}) == 1 and len({hierarchy_applies(w) for w in worlds}) == 1
    named = ", ".join(map(str, sizes))
    assert shm_applies(worlds[-1]).endswith(f"{k} ranks span hosts ({named} per host: unequal, so not the "
                                            "hierarchical allreduce either)")
    assert hierarchy_applies(worlds[0]).startswith(f"the hosts run unequal numbers of workers ({named} per host)")


def test_nodes_of_equal_sizes_still_take_the_hierarchy():
    from phalanx.comm import resolve_algorithm
    from phalanx.runtime.segment import shm_supported
    from phalanx.runtime.world import World

    world = World(rank=3, world_size=4, local_rank=1, local_world_size=2, device=torch.device("cpu"), backend="gloo",
                  timeout_s=10.0, node_rank=1, node_sizes=(2, 2))
    assert resolve_algorithm("auto", world) == ("hierarchical" if shm_supported() is None else "native")
