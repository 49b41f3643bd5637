"""`phalanx predict` without processes: the α–β cost models against hand-computed values, the
link fit, the overlap/exposure arithmetic on synthetic gradient-ready timelines, lockstep and
time-slicing, the presets, config and flag validation, and the table and PNG."""

from __future__ import annotations

import dataclasses
import math

import pytest

from phalanx.measure.load import others_busy_cores
from phalanx.measure.outputs import prepare_out_dir, write_outputs
from phalanx.errors import UsageError
from phalanx.telemetry.bandwidth import busbw_factor
from phalanx.cli import build_parser
from phalanx.options import build
from phalanx.predict.config import INTERCONNECTS, Interconnect, PredictConfig, resolve_interconnect
from phalanx.predict.costmodel import allreduce_time_s, cost_terms, fit_link
from phalanx.predict.link import overlap_efficiency
from phalanx.predict.profile import Phase, phase_for
from phalanx.predict.report import plot_prediction, report_prediction
from phalanx.predict.run import PREDICTION_KEYS, _prediction_row, summarize, validated_world_sizes
from phalanx.predict.timeline import (DeviceProfile, expected_max, others_threads, overlap, predict_step,
                                      schedule_buckets, timeslice_factor)

A, B, N = 1e-5, 1e9, 1e6  # α = 10 µs, β = 1 GB/s, a 1 MB message


# --- cost models -------------------------------------------------------------------------------
def test_ring_is_2_k_minus_1_alphas_plus_2_k_minus_1_over_k_n_over_beta():
    for k in (2, 3, 4, 8):
        expected = 2 * (k - 1) * A + 2 * (k - 1) / k * N / B
        assert allreduce_time_s("ring", N, k, alpha_s=A, beta_Bps=B) == pytest.approx(expected)
    assert allreduce_time_s("ring", N, 4, alpha_s=A, beta_Bps=B) == pytest.approx(6e-5 + 1.5e-3)
    assert allreduce_time_s("native", N, 4, alpha_s=A, beta_Bps=B) == allreduce_time_s("ring", N, 4, alpha_s=A,
                                                                                       beta_Bps=B)


def test_tree_is_log2_steps_of_whole_messages_plus_a_fold_for_non_powers_of_two():
    step = A + N / B
    assert allreduce_time_s("tree", N, 2, alpha_s=A, beta_Bps=B) == pytest.approx(1 * step)
    assert allreduce_time_s("tree", N, 4, alpha_s=A, beta_Bps=B) == pytest.approx(2 * step)
    assert allreduce_time_s("tree", N, 8, alpha_s=A, beta_Bps=B) == pytest.approx(3 * step)
    assert allreduce_time_s("tree", N, 3, alpha_s=A, beta_Bps=B) == pytest.approx(3 * step)  # 1 + fold in, out
    assert allreduce_time_s("tree", N, 6, alpha_s=A, beta_Bps=B) == pytest.approx(4 * step)


def test_naive_serialises_2_k_minus_1_whole_messages_at_rank_0():
    assert allreduce_time_s("naive", N, 3, alpha_s=A, beta_Bps=B) == pytest.approx(4 * (A + N / B))
    assert allreduce_time_s("naive", N, 8, alpha_s=A, beta_Bps=B) == pytest.approx(14 * (A + N / B))


def test_shm_is_two_flag_waits_growing_as_log2_k_plus_memory_traffic():
    # Copy in, sum one chunk of every slot (read n, write n/k), copy out: 3 + 1/k bytes per byte.
    assert cost_terms("shm", 2) == (2.0, 3.5)
    assert cost_terms("shm", 8) == (6.0, 3.125)
    assert allreduce_time_s("shm", N, 4, alpha_s=A, beta_Bps=B) == pytest.approx(4 * A + 3.25 * N / B)


def test_auto_prices_what_training_would_pick():
    from phalanx.comm.shm import shm_supported

    loopback = PredictConfig()
    assert loopback.algorithm == ("shm" if shm_supported() is None else "native")
    assert PredictConfig(interconnect=INTERCONNECTS["nvlink"]).algorithm == "native"
    with pytest.raises(ValueError, match="one host"):
        PredictConfig(algorithm="shm", interconnect=INTERCONNECTS["nvlink"])


def test_nothing_to_send_costs_nothing_and_bad_inputs_are_refused():
    assert allreduce_time_s("ring", N, 1, alpha_s=A, beta_Bps=B) == 0.0
    assert allreduce_time_s("tree", 0, 4, alpha_s=A, beta_Bps=B) == 0.0
    assert cost_terms("naive", 1) == (0.0, 0.0)
    for bad in (lambda: cost_terms("bcube", 2), lambda: cost_terms("ring", 0),
                lambda: allreduce_time_s("ring", -1, 2, alpha_s=A, beta_Bps=B),
                lambda: allreduce_time_s("ring", N, 2, alpha_s=A, beta_Bps=0)):
        with pytest.raises(ValueError):
            bad()


def test_a_rings_modelled_busbw_approaches_beta():
    big = 1e12
    for k in (2, 4, 8):
        t = allreduce_time_s("ring", big, k, alpha_s=A, beta_Bps=B)
        assert big / t * busbw_factor(k) == pytest.approx(B, rel=1e-6)


def test_fit_link_recovers_alpha_and_beta_and_keeps_alpha_non_negative():
    sizes = [4096, 65536, 1 << 20, 16 << 20]
    for algorithm in ("ring", "tree", "naive"):
        times = [allreduce_time_s(algorithm, n, 2, alpha_s=4e-4, beta_Bps=1.2e9) for n in sizes]
        fit = fit_link(algorithm, sizes, times)
        assert fit.alpha_s == pytest.approx(4e-4, rel=1e-6) and fit.beta_Bps == pytest.approx(1.2e9, rel=1e-6)
        assert fit.max_rel_error < 1e-9
    noisy = [t * f for t, f in zip([allreduce_time_s("ring", n, 2, alpha_s=4e-4, beta_Bps=1.2e9) for n in sizes],
                                   (1.1, 0.9, 1.05, 0.97))]
    fit = fit_link("ring", sizes, noisy)
    assert 3e-4 < fit.alpha_s < 5e-4 and 1.0e9 < fit.beta_Bps < 1.4e9 and 0.03 < fit.max_rel_error < 0.2
    pure_bandwidth = [n / 1e9 * f for n, f in zip(sizes, (0.5, 1, 1, 1))]  # would need alpha < 0
    assert fit_link("ring", sizes, pure_bandwidth).alpha_s == 0.0
    with pytest.raises(ValueError):
        fit_link("ring", [4096], [1e-3])


# --- the timeline ------------------------------------------------------------------------------
def test_buckets_run_in_order_on_one_channel():
    assert schedule_buckets([1, 2, 10], [3, 1, 2]) == [(1, 4), (4, 5), (10, 12)]
    assert schedule_buckets([5, 1], [1, 1]) == [(5, 6), (6, 7)]  # bucket 1 ready first still waits
    with pytest.raises(ValueError):
        schedule_buckets([1], [1, 2])


def test_hidden_and_exposed_split_the_allreduce_time_at_the_end_of_backward():
    split = overlap([1, 2, 10], [3, 1, 2], backward_s=10)
    assert (split.comm_s, split.hidden_s, split.exposed_s) == (6, 4, 2)
    spill = overlap([0, 8], [5, 6], backward_s=10)  # bucket 1 runs 8..14: 2 hidden, 4 exposed
    assert (spill.hidden_s, spill.exposed_s) == (7, 4)
    queued = overlap([0, 1], [9, 3], backward_s=10)  # bucket 1 waits behind bucket 0 until 9
    assert (queued.hidden_s, queued.exposed_s) == (10, 2)
    for s in (split, spill, queued):
        assert s.hidden_s + s.exposed_s == pytest.approx(s.comm_s)
    assert overlap([], [], backward_s=5).exposed_s == 0


def test_expected_max_is_the_order_statistic_of_the_samples():
    assert expected_max([1, 2, 3, 4], 1) == pytest.approx(2.5)
    assert expected_max([1, 2, 3, 4], 2) == pytest.approx(50 / 16)
    assert expected_max([4, 1, 3, 2], 200) == pytest.approx(4, rel=1e-6)
    assert expected_max([7.0] * 5, 8) == pytest.approx(7.0)
    with pytest.raises(ValueError):
        expected_max([], 2)


def _profile(**changes) -> DeviceProfile:
    base = dict(batch_size_per_device=128, threads=1, co_runners=2, forward_s=0.03, backward_s=0.06,
                optimizer_s=0.01, other_s=0.0, step_samples_s=(0.1,) * 4, bucket_ready_s=(0.001, 0.06),
                bucket_bytes=(1_000_000, 1_000_000))
    return DeviceProfile(**{**base, **changes})


def test_predict_step_adds_the_exposed_wait_and_the_cost_of_hiding():
    # ring at k=2: each bucket 2α + n/β = 2 ms + 1 ms; bucket 0 hides (0.001-0.004), bucket 1 is exposed.
    p = predict_step(_profile(), world_size=2, global_batch_size=256, algorithm="ring", alpha_s=1e-3,
                     beta_Bps=1e9, overlap_efficiency=0.5)
    assert (p.compute_s, p.comm_s, p.hidden_s, p.exposed_s) == pytest.approx((0.1, 0.006, 0.003, 0.003))
    assert p.overlap_penalty_s == pytest.approx(0.0015)
    assert p.step_s == pytest.approx(0.1045)
    assert p.images_per_s == pytest.approx(256 / 0.1045)
    assert p.hidden_fraction == pytest.approx(0.25)
    free = predict_step(_profile(), world_size=2, global_batch_size=256, algorithm="ring", alpha_s=1e-3,
                        beta_Bps=1e9, overlap_efficiency=1.0)
    assert free.step_s == pytest.approx(0.103)
    one = predict_step(_profile(), world_size=1, global_batch_size=128, algorithm="ring", alpha_s=1e-3,
                       beta_Bps=1e9, overlap_efficiency=0.0)
    assert (one.comm_s, one.step_s, one.hidden_fraction) == (0.0, pytest.approx(0.1), 1.0)


def test_a_replica_that_does_not_overlap_exposes_every_bucket_after_backward():
    # The same buckets exchanged after backward: both 3 ms allreduces exposed, nothing hidden, no penalty.
    after = predict_step(_profile(overlapped=False), world_size=2, global_batch_size=256, algorithm="ring",
                         alpha_s=1e-3, beta_Bps=1e9, overlap_efficiency=0.5)
    assert (after.comm_s, after.hidden_s, after.exposed_s, after.overlap_penalty_s) == pytest.approx(
        (0.006, 0.0, 0.006, 0.0))
    assert after.step_s == pytest.approx(0.106) and after.hidden_fraction == pytest.approx(0.0)
    one_bucket = predict_step(_profile(overlapped=False, bucket_ready_s=(0.002,), bucket_bytes=(2_000_000,)),
                              world_size=2, global_batch_size=256, algorithm="ring", alpha_s=1e-3, beta_Bps=1e9,
                              overlap_efficiency=0.5)
    assert one_bucket.exposed_s == pytest.approx(0.004)  # one call: one latency term fewer


def test_lockstep_waits_for_the_slowest_rank_and_time_slicing_stretches_compute():
    jittery = _profile(step_samples_s=(0.09, 0.1, 0.1, 0.11))
    p = predict_step(jittery, world_size=4, global_batch_size=256, algorithm="ring", alpha_s=0, beta_Bps=1e12,
                     overlap_efficiency=1.0)
    assert p.compute_s == pytest.approx(expected_max([0.09, 0.1, 0.1, 0.11], 4)) and p.compute_s > 0.1
    sliced = predict_step(_profile(), world_size=4, global_batch_size=256, algorithm="ring", alpha_s=1e-3,
                          beta_Bps=1e9, overlap_efficiency=1.0, timeslice=2.0)
    # compute 0.2; backward 0.12, bucket 1 ready at 0.12: its 7.5 ms (ring at k=4: 6α + 1.5 n/β) is exposed
    assert sliced.compute_s == pytest.approx(0.2) and sliced.exposed_s == pytest.approx(0.0075)


def test_timeslice_factor_is_fair_share_with_the_hosts_other_load():
    assert timeslice_factor(8, 1, 2, shares_host=False) == 1.0
    assert timeslice_factor(2, 1, 2, shares_host=True, co_runners=2) == 1.0
    assert timeslice_factor(3, 1, 2, shares_host=True, co_runners=2) == pytest.approx(1.5)
    assert timeslice_factor(4, 1, 2, shares_host=True, co_runners=2) == pytest.approx(2.0)
    assert timeslice_factor(1, 2, 2, shares_host=True, co_runners=1, others_busy_cores=1.5) == 1.0
    # others kept 1 of 2 cores busy beside our 2 threads: they are 2 runnable threads (1 = L*2/(2+L)).
    assert others_threads(1.0, 2, 2) == pytest.approx(2.0)
    assert others_threads(0.5, 1, 2) == 0.5  # it all fitted: they used what they wanted
    assert timeslice_factor(4, 1, 2, shares_host=True, co_runners=2, others_busy_cores=1.0) == pytest.approx(1.5)
    # profiled beside 2 busy other threads, measured on an idle host: 2 of ours ran at half speed then.
    assert timeslice_factor(2, 1, 2, shares_host=True, co_runners=2, others_busy_cores=1.0,
                            target_others_busy_cores=0.0) == pytest.approx(0.5)
    assert timeslice_factor(2, 1, 2, shares_host=True, co_runners=2, others_busy_cores=1.0,
                            target_others_busy_cores=1.0) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        timeslice_factor(0, 1, 2, shares_host=True)


def test_overlap_efficiency_and_other_programs_load():
    assert overlap_efficiency(0.3) == pytest.approx(0.7)
    assert (overlap_efficiency(1.4), overlap_efficiency(-0.1)) == (0.0, 1.0)
    windows = [{"wall_s": 2.0, "cpu_s": 1.5, "host_busy_s": 4.0}, {"wall_s": 2.0, "cpu_s": 1.5, "host_busy_s": None}]
    assert others_busy_cores(windows) == pytest.approx(0.5)
    assert others_busy_cores([{"wall_s": 1.0, "cpu_s": 1.0, "host_busy_s": None}]) == 0.0


def test_validation_measures_bench_scalings_own_phalanx_contender(monkeypatch):
    # predict --validate's number is bench scaling's phalanx/k line: the same Variant, run by the
    # same worker (measure/step.py); its load from the kit's windows (rank 0's host time).
    from phalanx.bench.scaling import variants
    from phalanx.measure.job_steps import StepJob
    from phalanx.predict import validate

    ran = []

    def fake_run_variant(variant, job, *, timeout_s, deadline_s):
        ran.append(variant)
        return [{"wall_s": 0.5, "cpu_s": 0.4, "host_busy_s": 1.4}, {"wall_s": 1.0, "cpu_s": 0.5, "host_busy_s": None}]

    monkeypatch.setattr(validate, "run_variant", fake_run_variant)
    cores, job = 4, StepJob(model="lenet", global_batch_size=64, warmup_steps=1, steps=4, lr=0.2, seed=0)
    for k in (1, 2, 4):
        threads = phase_for(k, 64, cores, shares_host=True, algorithm="shm").threads
        found = validate.measure_phalanx(job, world_size=k, threads_per_device=threads, algorithm="auto",
                                         timeout_s=1.0, deadline_s=1.0)
        assert ran[-1] == {v.name: v for v in variants((1, 2, 4), cores)}[f"phalanx/{k}"]
        assert found.images_per_s == pytest.approx(64 * 4 / 1.0)  # the slowest rank's wall time
        assert found.others_busy_cores == pytest.approx((1.4 - 0.9) / 0.5)


def test_each_device_is_profiled_with_its_shard_threads_co_runners_and_exchange():
    def phase(k, batch, cores, *, shares_host=True, algorithm="shm", overlap=None):
        return phase_for(k, batch, cores, shares_host=shares_host, algorithm=algorithm, overlap=overlap)

    # shm on one host, cores // k threads each: the workers fill the cores, so auto exchanges after backward.
    assert phase(1, 256, 2) == Phase(batch_size_per_device=256, threads=2, co_runners=1, overlap=False)
    assert phase(2, 256, 2) == Phase(batch_size_per_device=128, threads=1, co_runners=2, overlap=False)
    # Past the cores every copy runs, up to twice the cores (time-slicing costs more than arithmetic).
    assert phase(3, 256, 2) == Phase(batch_size_per_device=86, threads=1, co_runners=3, overlap=False)
    assert phase(8, 256, 2) == Phase(batch_size_per_device=32, threads=1, co_runners=4, overlap=False)
    assert phase(2, 256, 16) == Phase(batch_size_per_device=128, threads=8, co_runners=2, overlap=False)
    # The network algorithms' waits cost no core: auto overlaps; a given overlap is kept.
    assert phase(2, 256, 2, algorithm="native") == Phase(batch_size_per_device=128, threads=1, co_runners=2)
    assert phase(2, 256, 2, overlap=True).overlap is True
    assert phase(2, 256, 2, algorithm="native", overlap=False).overlap is False
    assert phase(4, 256, 2, shares_host=False, algorithm="native") == Phase(batch_size_per_device=64, threads=2,
                                                                           co_runners=1)


# --- presets, config, flags --------------------------------------------------------------------
def test_presets():
    assert set(INTERCONNECTS) == {"loopback", "pcie", "nvlink", "25gbe", "100gbe"}
    assert INTERCONNECTS["loopback"].measured and INTERCONNECTS["loopback"].shares_host
    for name in ("pcie", "nvlink", "25gbe", "100gbe"):
        link = INTERCONNECTS[name]
        assert not link.measured and not link.shares_host and link.overlap_efficiency == 1.0
    assert INTERCONNECTS["nvlink"].beta_Bps > INTERCONNECTS["pcie"].beta_Bps > INTERCONNECTS["100gbe"].beta_Bps \
        > INTERCONNECTS["25gbe"].beta_Bps
    link = resolve_interconnect("pcie", alpha_us=3, beta_gbps=7.5)
    assert (link.alpha_s, link.beta_Bps, link.shares_host) == (pytest.approx(3e-6), 7.5e9, False)
    assert not resolve_interconnect("loopback", alpha_us=100, beta_gbps=1, overlap_efficiency=0.5).measured
    for bad in (lambda: resolve_interconnect("infiniband"), lambda: resolve_interconnect("pcie", alpha_us=-1),
                lambda: resolve_interconnect("pcie", beta_gbps=0), lambda: resolve_interconnect("pcie", overlap_efficiency=2),
                lambda: Interconnect(name="x", alpha_s=math.inf, beta_Bps=1, overlap_efficiency=1, shares_host=False, note="")):
        with pytest.raises(ValueError):
            bad()


@pytest.mark.parametrize("changes, words", [
    ({"model": "vgg"}, "--model 'vgg' is unknown"), ({"algorithm": "bcube"}, "--allreduce 'bcube' is unknown"),
    ({"world_sizes": (0, 2)}, "--world-sizes 0,2: 0 must be at least 1"),
    ({"world_sizes": (2, 2)}, "--world-sizes 2,2 names a count twice"), ({"world_sizes": ()}, "--world-sizes is empty"),
    ({"global_batch_sizes": (4,), "world_sizes": (1, 8)}, "one example per device"),
    ({"bucket_cap_mb": 0.0}, "--bucket-cap-mb 0.0 must be a positive number of MB"),
    ({"bucket_cap_mb": math.nan}, "--bucket-cap-mb nan must be a positive number of MB"),
    ({"rounds": 0}, "--rounds 0"), ({"steps": 1}, "--steps 1 must be at least 2"), ({"warmup_steps": -1}, "--warmup-steps -1"),
    ({"validate": True, "interconnect": INTERCONNECTS["nvlink"]}, "loopback"),
    ({"hosts": (2,), "link_gbit": 10.0, "overlap": False}, "drop --no-overlap"),
])
def test_config_validates_itself(changes, words):
    with pytest.raises(ValueError, match=words):
        PredictConfig(**changes)


def build_config(*argv: str) -> PredictConfig:
    return build(PredictConfig, build_parser(["predict"]).parse_args(["predict", *argv]))


def test_flags_map_onto_the_config():
    config = build_config("--model", "mlp", "--batch-size", "256,1024", "--world-sizes", "2,3,4", "--allreduce", "ring",
                          "--bucket-cap-mb", "none", "--interconnect", "100gbe", "--alpha-us", "5", "--rounds", "3")
    assert (config.model, config.global_batch_sizes, config.world_sizes, config.algorithm) == (
        "mlp", (256, 1024), (2, 3, 4), "ring")
    assert config.bucket_cap_mb is None and config.rounds == 3
    assert config.interconnect.name == "100gbe" and config.interconnect.alpha_s == pytest.approx(5e-6)
    default = build_config()
    assert default == PredictConfig()


@pytest.mark.parametrize("argv", [
    ("--alpha-us", "fast"), ("--beta-gbps", "inf"), ("--world-sizes", "two"), ("--world-sizes", "0,2"),
    ("--batch-size", "2", "--world-sizes", "1,4"), ("--interconnect", "carrier-pigeon"), ("--model", "gpt"),
    ("--bucket-cap-mb", "-1"), ("--validate", "--interconnect", "pcie"), ("--overlap-efficiency", "1.5"),
])
def test_bad_flags_are_one_line_usage_errors(argv):
    with pytest.raises(UsageError) as info:
        build_config(*argv)
    assert "\n" not in str(info.value)


# --- summary, table, chart -----------------------------------------------------------------------
def _payload(validate: bool, profile_for=lambda k, scale: {"step_samples_s": (0.1 * scale / k,) * 4},
             overlap_at: dict[int, bool] | None = None) -> dict:
    overlap_at = overlap_at or {}
    config = PredictConfig(global_batch_sizes=(256,), world_sizes=(1, 2, 4), validate=validate, rounds=2)
    rounds = []
    for scale in (1.0, 1.1):
        preds = []
        for k in (1, 2, 4):
            phase = phase_for(k, 256, 2, shares_host=True, algorithm="shm", overlap=overlap_at.get(k))
            profile = _profile(**profile_for(k, scale), overlapped=phase.overlap)
            row = _prediction_row(predict_step(profile, world_size=k, global_batch_size=256, algorithm="native",
                                               alpha_s=3e-4, beta_Bps=1e9, overlap_efficiency=0.5))
            row.update(batch_size_per_device=phase.batch_size_per_device, threads=phase.threads,
                       co_runners=phase.co_runners, overlap=phase.overlap, profile=dataclasses.asdict(profile))
            preds.append(row)
        measured = {str(k): {"images_per_s": ips, "others_busy_cores": 0.5, "predicted_images_per_s_at_its_load": ips * 1.05}
                    for k, ips in ((1, 2000.0), (2, 4000.0 * scale))} if validate else {}
        rounds.append({"link": {"alpha_s": 3e-4, "beta_Bps": 1e9, "overlap_efficiency": 0.5, "source": "given"},
                       "batches": [{"global_batch_size": 256, "predictions": preds, "measured": measured}]})
    return {"predict": dataclasses.asdict(config), "cores": 2, "rounds": rounds,
            "validated_world_sizes": [1, 2] if validate else [], "summary": summarize(config, rounds)}


def test_summary_takes_spreads_over_rounds_and_per_round_errors():
    payload = _payload(validate=True)
    rows = {r["world_size"]: r for r in payload["summary"]}
    assert set(rows) == {1, 2, 4}
    assert all(len(rows[2][key]["samples"]) == 2 for key in PREDICTION_KEYS)
    two = rows[2]
    for predicted, measured, error in zip(two["images_per_s"]["samples"], two["measured_images_per_s"]["samples"],
                                          two["error"]["samples"]):
        assert error == pytest.approx(predicted / measured - 1)
    assert two["error_at_its_load"]["samples"] == pytest.approx([0.05, 0.05])
    assert "error" not in rows[4]
    assert validated_world_sizes(PredictConfig(world_sizes=(1, 2, 4, 8), validate=True), cores=2) == (1, 2, 4)
    assert validated_world_sizes(PredictConfig(world_sizes=(1, 2)), cores=2) == ()


def test_table_and_png(tmp_path):
    for validate in (False, True):
        payload = _payload(validate)
        text = report_prediction(payload)
        assert "global batch 256" in text and "images/s" in text and "speedup" in text
        assert ("error" in text) == validate and "link loopback (given)" in text
        assert "exchange: after backward, one flat bucket (overlap auto, as training picks it)" in text
        out = prepare_out_dir(tmp_path / f"v{validate}")
        json_path, png_path = write_outputs(out, "predict", payload, plot_prediction(payload))
        assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and json_path.stat().st_size > 100


def test_a_disturbed_profile_and_an_efficiency_above_100_percent_are_each_said_in_a_line():
    quiet = report_prediction(_payload(False))
    assert "profile disturbed" not in quiet and "above 100%" not in quiet and "%*" not in quiet
    # k = 1 profiled beside another program's load (1.2 of 2 cores), k = 2 alone.
    busy_one = report_prediction(_payload(False, lambda k, scale: {
        "step_samples_s": (0.2 if k == 1 else 0.04,) * 4, "others_busy_cores": 1.2 if k == 1 else 0.05}))
    lines = busy_one.splitlines()
    assert ("profile disturbed: other programs kept cores busy while it ran (k = 1: 1.2, k = 2: 0.1, k = 4: 0.1 of "
            "2 cores, the worst round); the figures built on it are not this machine's alone - rerun when it is "
            "quieter") in lines
    assert next(line for line in lines if line.lstrip().startswith("2 ")).rstrip().endswith("%*")
    assert ("* eff above 100% at k = 2: one device's profile met more of other programs' load (1.2 cores) than "
            "k = 2's (0.1), so k = 1 looks slower than it is") in lines
    # Quiet, but each device's shard computes faster per image than one device's whole batch.
    faster = report_prediction(_payload(False, lambda k, scale: {"step_samples_s": (0.1 if k == 1 else 0.03,) * 4}))
    assert "profile disturbed" not in faster
    (note,) = [line for line in faster.splitlines() if line.startswith("* eff above 100% at k = ")]
    assert note.startswith("* eff above 100% at k = 2: each device computes its 128 images in 30.0 ms, one device "
                           "its 256 in 100.0 ms: 1.67x faster per image")


def test_oversubscribed_hosts_stretch_communication_and_the_sweep_includes_the_buckets():
    from phalanx.predict.link import DEFAULT_SWEEP_BYTES, sweep_sizes
    from phalanx.predict.timeline import oversubscription

    assert [oversubscription(k, 1, 2, shares_host=True) for k in (1, 2, 3, 4)] == [1.0, 1.0, 1.5, 2.0]
    assert oversubscription(8, 1, 2, shares_host=False) == 1.0
    base = dict(world_size=2, global_batch_size=256, algorithm="ring", alpha_s=1e-3, beta_Bps=1e9,
                overlap_efficiency=1.0)
    plain, stretched = predict_step(_profile(), **base), predict_step(_profile(), **base, comm_stretch=2.0)
    # each bucket: 2α + n/β = 3 ms; latency doubled: 4 + 1 = 5 ms
    assert (plain.comm_s, stretched.comm_s, stretched.exposed_s) == pytest.approx((0.006, 0.010, 0.005))
    with pytest.raises(ValueError):
        predict_step(_profile(), **base, comm_stretch=0.5)
    sizes = sweep_sizes((5672, 409601, 101000))
    assert set(DEFAULT_SWEEP_BYTES) <= set(sizes) and {5672, 409600, 101000} <= set(sizes)
    assert list(sizes) == sorted(sizes) and all(n % 4 == 0 for n in sizes)


def test_the_report_says_where_each_k_exchanges():
    mixed = report_prediction(_payload(False, overlap_at={1: False, 2: True, 4: True}))
    assert ("exchange: beside backward, bucket by bucket at k = 2, 4; after backward, one flat bucket at k = 1 "
            "(overlap auto, as training picks it)") in mixed.splitlines()
    payload = _payload(False, overlap_at={1: True, 2: True, 4: True})
    payload["predict"]["overlap"] = True
    assert "exchange: beside backward, bucket by bucket (as given)" in report_prediction(payload).splitlines()


def test_the_overlap_flag_reaches_the_prediction_and_its_validation(monkeypatch):
    from phalanx.predict import run as predict_run
    from phalanx.predict.validate import Measurement

    profiled, measured = [], []

    def fake_profile(job, *, deadline_s):
        profiled.extend(job.phases)
        return {p: _profile(batch_size_per_device=p.batch_size_per_device, threads=p.threads,
                            co_runners=p.co_runners, overlapped=p.overlap) for p in job.phases}

    def fake_measure(job, *, world_size, overlap, **kwargs):
        measured.append(overlap)
        return Measurement(images_per_s=1000.0, others_busy_cores=0.0)

    monkeypatch.setattr(predict_run, "profile_devices", fake_profile)
    monkeypatch.setattr(predict_run, "measure_phalanx", fake_measure)
    for flags, expected in (((), False), (("--overlap",), True), (("--no-overlap",), False)):
        profiled.clear(), measured.clear()
        config = build_config("--world-sizes", "1,2", "--validate", "--alpha-us", "10", "--beta-gbps", "5",
                              "--overlap-efficiency", "1", *flags)
        found = predict_run.run_round(config, 2, on_progress=lambda _: None)
        assert {p.overlap for p in profiled} == {expected}
        assert measured == [config.overlap] * 2  # None: the measured run's own auto, as training
        assert [row["overlap"] for row in found["batches"][0]["predictions"]] == [expected] * 2
