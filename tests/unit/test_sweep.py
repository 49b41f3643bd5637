"""`phalanx sweep` without training: the lr rules, the grid, the config's validation, time to
target, the flags' one-line errors, resume matching, and the table / CSV / JSON / PNG written
from made-up results."""

from __future__ import annotations

import argparse
import csv
import io
import json
import math

import pytest

from phalanx.errors import UsageError
from phalanx.cli import build_parser
from phalanx.data.config import DataConfig
from phalanx.options import build
from phalanx.sweep.cli import run_sweep
from phalanx.sweep.grid import SCALED, SweepConfig, expand_grid, parse_lr_rule, scaled_lr
from phalanx.measure.outputs import write_outputs
from phalanx.sweep.report import csv_bytes, format_table, oversubscription_note, plot_sweep
from phalanx.sweep.run import load_stored, point_settings, summarize, time_to_target, train_config, with_target

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _args(*argv: str) -> argparse.Namespace:
    return build_parser(["sweep"]).parse_args(["sweep", *argv])


def _history(accs, epoch_s=1.5):
    return [{"epoch": i + 1, "train_loss": 1.0 / (i + 1), "train_acc": a, "test_acc": a, "epoch_s": epoch_s,
             "images_per_s": 100.0} for i, a in enumerate(accs)]


def _rows(config: SweepConfig, target=0.7):
    """One fake result per grid point: accuracy falls with the global batch, except when scaled."""
    rows = []
    for point in expand_grid(config):
        top = 0.78 if point.lr_rule == SCALED else 0.78 - 0.05 * math.log2(point.global_batch_size / 32)
        curve = [top * (e + 1) / config.epochs for e in range(config.epochs)]
        history = _history(curve, epoch_s=0.5 * point.num_devices)
        train = train_config(config, point, data=DataConfig(dataset="fashion-mnist"))
        rows.append({**summarize(point, history, target_acc=target, settings=point_settings(train, point),
                                 dataset="fashion-mnist"), "num_classes": 10})
    return rows


def test_lr_rules_parse_numbers_and_the_word_scaled():
    assert parse_lr_rule(" 0.2 ") == 0.2
    assert parse_lr_rule("Scaled") == SCALED
    with pytest.raises(ValueError, match="'fast' is neither a number nor 'scaled'"):
        parse_lr_rule("fast")


def test_linear_scaling_rule():
    assert scaled_lr(base_lr=0.1, base_batch=32, global_batch_size=128) == pytest.approx(0.4)
    assert scaled_lr(base_lr=0.2, base_batch=256, global_batch_size=64) == pytest.approx(0.05)


def test_grid_is_devices_by_batch_by_rule_with_global_batch_k_times_b():
    config = SweepConfig(num_devices=(1, 2, 4), batch_sizes_per_device=(32, 128), lr_rules=(0.1, SCALED),
                         base_lr=0.1, base_batch=32, warmup_epochs=1.0)
    points = expand_grid(config)
    assert [(p.num_devices, p.batch_size_per_device, p.lr_rule) for p in points] == [
        (k, b, r) for k in (1, 2, 4) for b in (32, 128) for r in ("0.1", SCALED)]
    assert [p.global_batch_size for p in points[::2]] == [32, 128, 64, 256, 128, 512]
    fixed = [p for p in points if p.lr_rule == "0.1"]
    assert all(p.lr == 0.1 and p.warmup_epochs == 0 for p in fixed)
    scaled = {p.global_batch_size: p for p in points if p.lr_rule == SCALED}
    assert {b: p.lr for b, p in scaled.items()} == pytest.approx({32: 0.1, 64: 0.2, 128: 0.4, 256: 0.8, 512: 1.6})
    # Warmup only where the rule raises the lr above the anchor's.
    assert scaled[32].warmup_epochs == 0 and all(scaled[b].warmup_epochs == 1.0 for b in (64, 128, 256, 512))
    assert len({p.key for p in points}) == len(points)


def test_default_grid_is_the_documented_one():
    points = expand_grid(build(SweepConfig, _args()))
    assert len(points) == 18  # 3 device counts x 2 per-device batches x 3 lr rules
    assert sorted({p.global_batch_size for p in points}) == [32, 64, 128, 256, 512]


@pytest.mark.parametrize("kwargs, message", [
    ({"num_devices": ()}, "--devices is empty"),
    ({"num_devices": (1, 0)}, "--devices 1,0 holds 0"),
    ({"num_devices": (2, 2)}, "--devices 2,2 repeats"),
    ({"batch_sizes_per_device": (0,)}, "--per-device-batch 0 holds 0"),
    ({"lr_rules": ()}, "--lr is empty"),
    ({"lr_rules": (-0.1,)}, "--lr -0.1 must be a positive finite number"),
    ({"lr_rules": (float("nan"),)}, "--lr nan"),
    ({"lr_rules": (float("inf"),)}, "--lr inf"),
    ({"lr_rules": (0.2, 0.2)}, "repeats a rule"),
    ({"base_lr": 0.0}, "--base-lr 0.0"),
    ({"base_batch": 0}, "--base-batch 0"),
    ({"epochs": 0}, "--epochs 0"),
    ({"warmup_epochs": -1.0}, "--warmup-epochs -1 must be at least 0"),
    ({"epochs": 3, "warmup_epochs": 3.0}, "below --epochs 3, so the scaled lr is reached; use e.g. --warmup-epochs 1.5"),
    ({"target_acc": 0.0}, "--target 0.0"),
    ({"target_acc": 70.0}, "--target 70.0 is not an accuracy"),
    ({"model": "vgg"}, "--model 'vgg' is unknown"),
    ({"threads_per_device": 0}, "--threads-per-device 0"),
    ({"timeout_s": 0.0}, "--timeout 0.0"),
])
def test_config_rejects_bad_values_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        SweepConfig(**kwargs)


def test_a_grid_with_no_warming_point_takes_any_warmup():
    # Fixed lrs (or a 'scaled' lr that stays at base-lr) never warm up: --epochs 1 needs no
    # --warmup-epochs 0 (it was refused for a warmup no point had).
    SweepConfig(num_devices=(1,), batch_sizes_per_device=(64,), lr_rules=(0.2,), epochs=1)
    SweepConfig(num_devices=(1,), batch_sizes_per_device=(32,), lr_rules=("scaled",), epochs=1)  # 32 = base batch
    with pytest.raises(ValueError, match="below --epochs 1"):
        SweepConfig(num_devices=(2,), batch_sizes_per_device=(32,), lr_rules=("scaled",), epochs=1)


def test_devices_take_train_s_cpu_form_too():
    assert build(SweepConfig, _args("--devices", "cpu:1,cpu:2")).num_devices == (1, 2)


def test_the_data_options_are_train_s_own():
    with pytest.raises(ValueError, match="--dataset 'cifar' is unknown"):
        SweepConfig(data=DataConfig(dataset="cifar"))
    assert build(SweepConfig, _args("--dataset", "fashion-mnist", "--data-dir", "d")).data == DataConfig(
        dataset="fashion-mnist", directory="d")
    with pytest.raises(UsageError, match="--data-dir holds fashion-mnist's files, which --dataset digits does not read; "
                                         "drop --data-dir, or drop --dataset to train on fashion-mnist"):
        build(SweepConfig, _args("--dataset", "digits", "--data-dir", "d"))


def test_time_to_target_is_cumulative_training_time_to_the_first_epoch_reaching_it():
    history = _history([0.5, 0.69, 0.7, 0.65, 0.8])
    history[1]["epoch_s"] = 4.0
    assert time_to_target(history, 0.7) == (pytest.approx(1.5 + 4.0 + 1.5), 3)  # reaching exactly counts
    assert time_to_target(history, 0.5) == (1.5, 1)
    assert time_to_target(history, 0.81) == (None, None)
    assert time_to_target([], 0.5) == (None, None)


def test_summarize_and_retarget():
    config = SweepConfig(num_devices=(2,), batch_sizes_per_device=(64,), lr_rules=(0.2,), epochs=3)
    point = expand_grid(config)[0]
    row = summarize(point, _history([0.6, 0.75, 0.72]), target_acc=0.7, settings={}, dataset="digits")
    assert (row["final_test_acc"], row["best_test_acc"], row["epochs_to_target"]) == (0.72, 0.75, 2)
    assert row["time_to_target_s"] == pytest.approx(3.0) and row["sec_per_epoch"] == pytest.approx(1.5)
    assert (row["global_batch_size"], row["key"], row["dataset"]) == (128, "k2-b64-lr0.2", "digits")
    assert set(row["history"][0]) == {"epoch", "train_loss", "train_acc", "test_acc", "epoch_s"}
    again = with_target([row], 0.74)[0]
    assert (again["epochs_to_target"], again["time_to_target_s"]) == (2, pytest.approx(3.0))
    assert with_target([row], 0.9)[0]["time_to_target_s"] is None
    with pytest.raises(ValueError, match="trained no epoch"):
        summarize(point, [], target_acc=0.7, settings={}, dataset="digits")


def test_each_point_is_a_train_config_with_its_batch_lr_and_warmup():
    config = SweepConfig(num_devices=(4,), batch_sizes_per_device=(32,), lr_rules=(SCALED,), threads_per_device=1,
                         seed=3, epochs=5, warmup_epochs=0.5)
    point = expand_grid(config)[0]
    train = train_config(config, point, data=DataConfig(dataset="digits"))
    assert (train.global_batch_size, train.optim.lr, train.optim.warmup_epochs) == (128, pytest.approx(0.4), 0.5)
    assert (train.epochs, train.seed, train.launch.threads_per_device, train.progress, train.out_dir) == (5, 3, 1, False, None)
    train.check_devices(point.num_devices)  # every device gets a share of each batch


def test_resume_reuses_only_a_stored_point_with_the_same_settings(tmp_path):
    config = SweepConfig(num_devices=(1,), batch_sizes_per_device=(32,), lr_rules=(0.2,), epochs=2)
    row = _rows(config)[0]
    (tmp_path / f"{row['key']}.json").write_text(json.dumps(row))
    assert load_stored(tmp_path, row["key"], row["settings"]) == row
    assert load_stored(tmp_path, row["key"], {**row["settings"], "epochs": 3}) is None
    assert load_stored(tmp_path, "k9-b1-lr1", row["settings"]) is None
    (tmp_path / "broken.json").write_text('{"settings": ')  # half a file from elsewhere
    assert load_stored(tmp_path, "broken", row["settings"]) is None


def test_a_point_trained_on_part_of_the_data_is_not_the_same_point():
    config = SweepConfig(num_devices=(1,), batch_sizes_per_device=(32,), lr_rules=(0.2,), epochs=2)
    point = expand_grid(config)[0]
    whole = point_settings(train_config(config, point, data=DataConfig(dataset="digits")), point)
    cut = point_settings(train_config(config, point, data=DataConfig(dataset="digits", train_examples=500)), point)
    assert cut == {**whole, "train_examples": 500}  # and a stored whole-data point keeps its settings as they were


@pytest.mark.parametrize("argv, message", [
    (["--devices", "1,two"], "--devices item 'two' is not a device count"),
    (["--per-device-batch", ","], "--per-device-batch is empty"),
    (["--lr", "0.1,fast"], "--lr item 'fast' is neither a number nor 'scaled'"),
    (["--lr", "0.1,-1"], "--lr -1.0 must be a positive finite number"),
    (["--epochs", "0"], "--epochs 0 must be at least 1"),
])
def test_bad_flags_are_one_line_usage_errors_before_anything_is_written(tmp_path, argv, message):
    out = tmp_path / "out"
    with pytest.raises(UsageError) as info:
        run_sweep(_args(*argv, "--out", str(out)))
    assert message in str(info.value) and "\n" not in str(info.value)
    assert not out.exists()


def test_an_earlier_sweeps_outputs_are_kept_unless_reused_or_overwritten(tmp_path):
    from phalanx.sweep.cli import _keep_earlier_outputs
    out = tmp_path / "out"
    (out / "points").mkdir(parents=True)
    for name in ("sweep.csv", "sweep.json", "points/k1-b32-lr0.2.json", "points/k2-b32-lr0.2.json", "notes.txt"):
        (out / name).write_text("earlier")
    with pytest.raises(UsageError) as info:
        run_sweep(_args("--dataset", "synthetic", "--out", str(out)))  # refused before any point trains
    assert str(info.value) == (f"--out {out} holds an earlier sweep's outputs (sweep.json, sweep.csv, 2 points); "
                               "reuse its finished points with --resume, or replace them with --overwrite")
    assert (out / "sweep.csv").read_text() == "earlier"
    _keep_earlier_outputs(build(SweepConfig, _args("--out", str(out), "--resume")))  # reuses: keeps them
    assert len(list((out / "points").iterdir())) == 2
    _keep_earlier_outputs(build(SweepConfig, _args("--out", str(out), "--overwrite")))
    assert sorted(p.name for p in out.rglob("*")) == ["notes.txt", "points"]  # not ours: never touched


def test_out_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "taken"
    path.write_text("x")
    with pytest.raises(UsageError, match="is an existing file; name a directory"):
        run_sweep(_args("--dataset", "synthetic", "--out", str(path)))


def test_table_marks_oversubscribed_device_counts_and_unreached_targets():
    config = SweepConfig(num_devices=(1, 4), batch_sizes_per_device=(32,), lr_rules=(0.1, SCALED), epochs=4)
    rows = _rows(config, target=0.75)
    text = format_table(rows, target_acc=0.75, cores=2)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["k", "b/device", "global", "lr"] and "time to 0.75" in lines[0]
    assert len(lines) == 2 + len(rows) + 1
    assert lines[2].split()[0] == "1" and lines[4].split()[0] == "4*"
    assert "not reached" in text  # lr 0.1 at global 128 tops out at 0.68
    assert "1 ep" in text and "(ep 4)" in text
    assert lines[-1].startswith("* k = 4: more worker processes than the 2 CPU cores")
    assert oversubscription_note(rows, cores=4) is None
    assert "*" not in format_table(rows, target_acc=0.75, cores=4)


def test_csv_has_one_row_per_point_and_blank_for_not_reached():
    config = SweepConfig(num_devices=(1, 2), batch_sizes_per_device=(32,), lr_rules=(0.1,), epochs=3)
    rows = _rows(config, target=0.75)
    parsed = list(csv.DictReader(io.StringIO(csv_bytes(rows).decode())))
    assert [(r["num_devices"], r["global_batch_size"]) for r in parsed] == [("1", "32"), ("2", "64")]
    assert parsed[0]["time_to_target_s"] != "" and parsed[1]["time_to_target_s"] == ""
    assert float(parsed[0]["final_test_acc"]) == pytest.approx(rows[0]["final_test_acc"])


def test_outputs_are_written_whole(tmp_path):
    config = SweepConfig(num_devices=(1, 2, 4), batch_sizes_per_device=(32, 128), lr_rules=(0.1, 0.2, SCALED))
    rows = _rows(config)
    payload = {"config": config.to_dict(), "results": rows}
    fig = plot_sweep(rows, target_acc=0.7, epochs=config.epochs, title="fake")
    json_path, csv_path, png_path = write_outputs(tmp_path, "sweep", payload, fig, also={"csv": csv_bytes(rows)})
    assert png_path.read_bytes()[:8] == PNG_MAGIC and png_path.stat().st_size > 10_000
    assert json.loads(json_path.read_text())["results"][5]["key"] == rows[5]["key"]
    assert len(csv_path.read_text().splitlines()) == 1 + 18
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.csv", "sweep.json", "sweep.png"]  # no temp files


def test_time_panel_says_so_when_no_point_reached_the_target():
    config = SweepConfig(num_devices=(1, 2), batch_sizes_per_device=(32,), lr_rules=(0.1,), epochs=3)
    rows = _rows(config, target=0.99)
    assert all(r["time_to_target_s"] is None for r in rows)
    fig = plot_sweep(rows, target_acc=0.99, epochs=3)
    texts = [t.get_text() for t in fig.axes[1].texts]
    assert texts == ["no point reached test acc 0.99\nin 3 epochs"]
    reached = plot_sweep(_rows(config, target=0.1), target_acc=0.1, epochs=3)
    assert len(reached.axes[1].texts) == 0
