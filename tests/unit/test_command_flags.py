"""Every flag `bench`, `verify`, `predict` and `sweep` had before their parsers were generated from their
configs still works and means what it meant: the same settings from the same words, the same defaults.

tests/unit/data/command_flags_before.jsonl holds, per flag, a sample (and the companions it needs),
and what the hand-written parser and its hand mapping made of it and of nothing: each setting that
the sample changed, with its value and its default - recorded by running the old code (9e76603)
with the measurement itself replaced by a catch of its config. Where a setting's place moved, the
settings below say where it is now.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from phalanx.autopar.trace import every_thread
from phalanx.bench.cli import BENCHMARKS, BenchOutput
from phalanx.bench.memory import FSDP2_ON_CPU
from phalanx.cli import build_parser
from phalanx.options import build
from phalanx.predict.config import PredictConfig
from phalanx.sweep.grid import SweepConfig
from phalanx.verify.cli import VerifyCommand

ROWS = [json.loads(line) for line in (Path(__file__).parent / "data" / "command_flags_before.jsonl").read_text()
        .splitlines()]


def _json(value):
    return json.loads(json.dumps(value))


def _settings(command: str, argv: list[str]) -> dict:
    """What the command makes of `argv`, keyed as the old code's settings were."""
    words = command.split()
    args = build_parser(words[:1]).parse_args([*words, *argv])
    if words[0] == "bench":
        benchmark = BENCHMARKS[words[1]]
        config = benchmark.prepare(build(benchmark.config, args))  # run_bench's own order
        return _json({**dataclasses.asdict(config), "out": build(BenchOutput, args).out_dir or f"runs/bench-{words[1]}"})
    if command == "verify":
        verify = build(VerifyCommand, args)
        return _json({**dataclasses.asdict(verify.verify_config()), "model": verify.model, "dataset": verify.dataset,
                      "data_dir": verify.data_dir, "out": verify.out, "split": verify.split.kind,
                      "micro_batches": verify.split.micro_batches, "schedule": verify.split.schedule})
    if command == "predict":
        config = build(PredictConfig, args)
        return _json({**dataclasses.asdict(config), "out": config.out_dir})
    config = build(SweepConfig, args)
    return _json({**dataclasses.asdict(config), "dataset": config.data.dataset, "data_dir": config.data.directory})


# Settings whose flag means something else since the record, and what the recorded words make now.
# bench scaling --devices lists the device counts phalanx runs on (3: phalanx/1 and phalanx/3,
# where it ran every count from 1 to 3): on a 16-core host --devices 8 ran 8 phalanx contenders
# per batch size and one round did not finish in 150 s.
# verify --no-overlap still turns overlap off; left out, overlap is now None (auto: off for the shm
# allreduce where the workers' threads fill the cores, as phalanx train's), where it was on.
# bench memory --steps defaults to 20 (was 5): a peak that grows with the steps showed only later.
NOW = {("bench memory", "--steps"): {"default": {"steps": 20}},
       ("bench scaling", "--devices"): {"value": {"device_counts": [3]}, "default": {"device_counts": [2]}},
       ("verify", "--no-overlap"): {"value": {"overlap": False}, "default": {"overlap": None}}}


def _for_this_torch(row: dict) -> dict:
    """`row` as this torch makes it: before 2.6 FSDP2 cannot run on CPU workers and `bench memory`
    leaves it out of its default contenders (bench/memory.py); before 2.7 `bench autopar --trace` is
    refused in one line (test_autopar.py checks it), so its settings are not made at all. Found on
    torch 2.4.1, which pyproject accepts: both rows failed there."""
    if (row["command"], row["flag"]) == ("bench autopar", "--trace"):
        try:
            every_thread()
        except ValueError as refused:
            pytest.skip(str(refused))
    if row["command"] == "bench memory" and "contenders" in row["default"] and not FSDP2_ON_CPU:
        row = {**row, "default": {**row["default"], "contenders": [name for name in row["default"]["contenders"]
                                                                   if name != "fsdp2"]}}
    return row


@pytest.fixture(autouse=True)
def _gpu_less(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # --device auto resolves to cpu, as recorded


# Benchmarks that came after the record: their flags were generated from their configs from the start.
ADDED_SINCE = {"bench hosts", "bench step", "bench gpu"}


def test_the_record_covers_every_command_and_benchmark():
    assert {row["command"] for row in ROWS} == \
        {*(f"bench {name}" for name in BENCHMARKS), "verify", "predict", "sweep"} - ADDED_SINCE


@pytest.mark.parametrize("row", ROWS, ids=[f"{row['command']} {row['flag']}" for row in ROWS])
def test_an_old_flag_makes_the_same_settings_as_before(row):
    row = _for_this_torch({**row, **NOW.get((row["command"], row["flag"]), {})})
    given = _settings(row["command"], row["argv"] + row["companions"])
    assert {key: given[key] for key in row["value"]} == row["value"]
    default = _settings(row["command"], row["companions"])
    assert {key: default[key] for key in row["default"]} == row["default"]  # and its default is the same
