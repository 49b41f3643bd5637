"""`phalanx predict` end to end through the real spawn path, at toy sizes: a profile in co-running
fresh processes, the 2-process loopback link measurement, the prediction for k = 1, 2 and the
validation run at both; checks the schema, that the numbers hang together (step = compute +
exposed + the cost of hiding; the link fit is a real fit), the table and the PNG. Machinery,
not accuracy: accuracy needs full-size runs on a quiet machine (`phalanx predict --validate`).
Every spawned run is bounded by the config's deadline, so a hang fails in about a minute.
"""

from __future__ import annotations

import pytest

from phalanx.measure.outputs import prepare_out_dir, write_outputs
from phalanx.predict.config import INTERCONNECTS, PredictConfig, resolve_interconnect
from phalanx.predict.report import plot_prediction, report_prediction
from phalanx.predict.run import run_prediction

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _tiny(**changes) -> PredictConfig:
    base = dict(model="lenet", global_batch_sizes=(32,), world_sizes=(1, 2), steps=2, warmup_steps=1,
                timeout_s=30.0, deadline_s=45.0)
    return PredictConfig(**{**base, **changes})


@pytest.mark.distributed
def test_predict_measures_the_link_predicts_and_validates(tmp_path):
    progress: list[str] = []
    payload = run_prediction(_tiny(validate=True), on_progress=progress.append)
    assert any("profiling" in m for m in progress) and any("loopback link" in m for m in progress)
    assert payload["validated_world_sizes"] == [1, 2]
    (round_,) = payload["rounds"]
    link = round_["link"]
    assert link["source"] == "measured" and link["alpha_s"] >= 0 and link["beta_Bps"] > 0
    assert 0.0 <= link["overlap_efficiency"] <= 1.0 and 0.0 <= link["comm_cpu_share"]
    assert [s["size_bytes"] for s in link["sweep"]] == sorted(s["size_bytes"] for s in link["sweep"])
    assert all(s["time_s"] > 0 for s in link["sweep"])
    (batch,) = round_["batches"]
    one, two = batch["predictions"]
    assert (one["world_size"], one["batch_size_per_device"], one["comm_s"]) == (1, 32, 0.0)
    assert (two["world_size"], two["batch_size_per_device"], two["threads"]) == (2, 16, 1)
    for row in (one, two):
        profile = row["profile"]
        assert len(profile["step_samples_s"]) == 2 * profile["co_runners"]  # every co-runner's steps
        assert profile["bucket_bytes"] and len(profile["bucket_ready_s"]) == len(profile["bucket_bytes"])
        # LeNet's 504 KB of float32 gradients, and one usage flag per parameter tensor (8) riding with them
        assert sum(profile["bucket_bytes"]) == 129_068 * 4 + 8 * 4
        assert all(0 <= r <= profile["backward_s"] * 1.5 for r in profile["bucket_ready_s"])
        assert row["step_s"] == pytest.approx(row["compute_s"] + row["exposed_s"] + row["overlap_penalty_s"])
        assert row["hidden_s"] + row["exposed_s"] == pytest.approx(row["comm_s"])
        assert row["images_per_s"] == pytest.approx(32 / row["step_s"])
    assert two["comm_s"] > 0 and set(batch["measured"]) == {"1", "2"}
    for measured in batch["measured"].values():
        assert measured["images_per_s"] > 0 and measured["others_busy_cores"] >= 0
        assert measured["predicted_images_per_s_at_its_load"] > 0
    summary = {r["world_size"]: r for r in payload["summary"]}
    assert summary[2]["error"]["median"] == pytest.approx(
        two["images_per_s"] / batch["measured"]["2"]["images_per_s"] - 1)
    text = report_prediction(payload)
    assert "measured images/s" in text and "loopback (measured" in text
    json_path, png_path = write_outputs(prepare_out_dir(tmp_path), "predict", payload, plot_prediction(payload))
    assert png_path.read_bytes()[:8] == PNG_MAGIC and json_path.exists()


@pytest.mark.distributed
def test_a_preset_link_is_taken_as_given_and_devices_get_the_whole_host():
    config = _tiny(world_sizes=(1, 2, 8), interconnect=INTERCONNECTS["nvlink"])
    payload = run_prediction(config)
    (round_,) = payload["rounds"]
    assert round_["link"]["source"] == "given" and round_["link"]["beta_Bps"] == INTERCONNECTS["nvlink"].beta_Bps
    rows = {r["world_size"]: r for r in round_["batches"][0]["predictions"]}
    cores = payload["cores"]
    assert all(r["threads"] == cores and r["co_runners"] == 1 and r["timeslice"] == 1.0 for r in rows.values())
    assert rows[8]["batch_size_per_device"] == 4
    # On NVLink the 504 KB of LeNet gradients cost microseconds, not gloo's milliseconds.
    assert rows[8]["comm_s"] < 1e-3
    loopback_given = resolve_interconnect("loopback", alpha_us=500, beta_gbps=1, overlap_efficiency=0.5)
    assert not run_prediction(_tiny(world_sizes=(2,), interconnect=loopback_given))["rounds"][0]["link"].get("sweep")
