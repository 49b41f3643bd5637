"""Draw random combinations of `phalanx train`'s flags and check k devices = 1 device for each:
the tests prove each setting alone and a few pairs, this hunts for the pair nobody wrote down.

    .venv/bin/python tools/combo_fuzz.py --runs 60 --out /tmp/fuzz --seed 1

Each draw trains the same small float64 job (synthetic data, an uneven global batch, 1-2
epochs) on k in {2, 3} CPU workers with the drawn exchange (allreduce, overlap, buckets,
sharding, accumulation, optimizer, clipping, warm-up, memory format, checkpoints; or, in 15%, a
model split, `--split layers` or `channels`) and on 1 device with the same model, data and update
rule, and compares the saved models tensor by tensor and the per-epoch losses: a tensor fails when
max|a - b| exceeds 1e-9 of the largest |b| of the model (float64 rounding of a different summation
order stays near 1e-15). Where it does, 1 device is trained again with the other memory format
(other conv kernels, other rounding): a difference within 10x of what that alone makes is rounding
amplified by training (Adam divides a BatchNorm-preceded bias's ~0 gradient by its own ~0 scale)
and is recorded as "noise". A combination refused at the start (exit 2) must say why in one line;
it is recorded, not failed. A third of the draws are stopped by SIGTERM up to a second after the
k-device run's first checkpoint (every rank then saves the same step and exits 143) and resumed from that step with
`--resume auto` on 1, 2 or 3 workers: the resumed run must end where the uninterrupted 1-device
run ends. A sixth have one worker SIGKILLed instead, under `--max-restarts 1`: the launcher's
restart from the checkpoint must end there too. Every draw's command lines, verdict and output go to `<out>/draws.jsonl` and a failure's
logs to `<out>/<n>/`. Exit 1 when any draw failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from state_diff import worst_difference  # tools/, beside this script

PHALANX = [sys.executable, "-m", "phalanx", "train"]

# The job's shape: drawn per run, the same on k devices and on 1.
SHAPE = {
    "--model": ["lenet", "lenet", "lenet-bn", "mlp"],
    "--optimizer": ["sgd", "sgd", "adam", "adamw"],
    "--batch-size": ["29", "37", "61", "64"],
    "--train-examples": ["150", "211", "300"],
    "--epochs": ["1", "2"],
    "--clip-grad-norm": [None, None, "0.5"],
    "--warmup-epochs": [None, None, "1"],
    "--weight-decay": [None, "0.001"],
    "--grad-accum": ["1", "1", "2", "3"],
    "--memory-format": [None, "contiguous"],
}
# The exchange: drawn for the k-device run only, since 1 device has none.
EXCHANGE = {
    "--allreduce": [None, "shm", "ring", "tree", "naive", "native"],
    "--overlap": [None, "--overlap", "--no-overlap"],
    "--bucket-cap-mb": [None, "0.01", "0.25", "none"],
    "--shard": [None, None, "optimizer", "gradients", "parameters"],
    "--checkpoint-every": [None, None, "2", "epoch"],
}


def _draw(rng: random.Random) -> tuple[list[str], list[str], int]:
    if rng.random() < 0.15:  # a model split instead of replicas: LeNet and plain SGD, as the splits train
        shape = ["--model", "lenet", "--batch-size", rng.choice(SHAPE["--batch-size"]),
                 "--train-examples", rng.choice(SHAPE["--train-examples"]), "--epochs", rng.choice(["1", "2"]),
                 "--lr", "0.05"]
        split = rng.choice(["layers", "channels"])
        exchange = ["--split", split]
        if split == "layers":
            exchange += ["--schedule", rng.choice(["gpipe", "1f1b"]), "--micro-batches", rng.choice(["1", "3", "8"])]
        return shape, exchange, rng.choice([2, 3])
    shape, exchange = [], []
    for table, into in ((SHAPE, shape), (EXCHANGE, exchange)):
        for flag, values in table.items():
            value = rng.choice(values)
            if value is None:
                continue
            into += [value] if value.startswith("--") else [flag, value]
    if "sgd" in shape and rng.random() < 0.5:
        shape += ["--momentum", "0.9"]
    lr = "0.05" if "sgd" in shape else "0.002"
    return shape + ["--lr", lr], exchange, rng.choice([2, 3])


def _common(out: Path) -> list[str]:
    return ["--dataset", "synthetic", "--dtype", "float64", "--no-progress", "--threads-per-device", "1",
            "--timeout", "60", "--out", str(out)]


def _train(args: list[str], out: Path, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(PHALANX + args + _common(out), capture_output=True, text=True, timeout=timeout_s)


def _stopped_and_resumed(args: list[str], out: Path, checkpoints: Path, stop_after_s: float, resume_devices: str,
                         timeout_s: float, row: dict) -> subprocess.CompletedProcess:
    """Run `args`, SIGTERM it `stop_after_s` after its first checkpoint appears in `checkpoints` (it
    saves a step and exits 143; one that ended before is left alone), then resume it from its
    checkpoint on `resume_devices`. `row` records the first run's exit and its stop line."""
    run = subprocess.Popen(PHALANX + args + _common(out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    while run.poll() is None and not (checkpoints / "checkpoint.pt").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(stop_after_s)
    if run.poll() is None:
        run.send_signal(signal.SIGTERM)
    stdout, stderr = run.communicate(timeout=timeout_s)
    row["first_exit"] = run.returncode
    row["stop_line"] = next((line for line in stderr.splitlines() if "stopped by SIGTERM" in line), None)
    if run.returncode not in (0, 128 + signal.SIGTERM):
        return subprocess.CompletedProcess(run.args, run.returncode, stdout, stderr)
    devices = args.index("--devices")
    resumed = args[:devices] + ["--devices", resume_devices] + args[devices + 2:] + ["--resume", "auto"]
    again = _train(resumed, out, timeout_s)
    return subprocess.CompletedProcess(again.args, again.returncode, stdout + again.stdout,
                                       stderr + "\n--- resumed\n" + again.stderr)


def _worker_killed(args: list[str], out: Path, checkpoints: Path, kill_after_s: float, timeout_s: float,
                   row: dict, rng: random.Random) -> subprocess.CompletedProcess:
    """Run `args` (with --max-restarts), SIGKILL one of its workers `kill_after_s` after its first
    checkpoint, and let the launcher restart the workers from it. `row` records whom it killed."""
    run = subprocess.Popen(PHALANX + args + _common(out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    while run.poll() is None and not (checkpoints / "checkpoint.pt").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(kill_after_s)
    workers = [pid for server in _children(run.pid) for pid in _children(server)]  # the fork server's children
    if run.poll() is None and workers:
        row["killed"] = rng.choice(workers)
        with contextlib.suppress(ProcessLookupError):
            os.kill(row["killed"], signal.SIGKILL)
    stdout, stderr = run.communicate(timeout=timeout_s)
    row["restart_line"] = next((line for line in stderr.splitlines() if "restart" in line), None)
    return subprocess.CompletedProcess(run.args, run.returncode, stdout, stderr)


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


def _losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row["train_loss"] for row in rows if "train_loss" in row]


def _compare(k_out: Path, one_out: Path) -> tuple[float, str]:
    """The largest difference of any saved tensor, relative to that tensor's largest |value| (floored
    at 0.1 of the model's largest), and the tensor's name."""
    worst, name = worst_difference(torch.load(k_out / "model.pt"), torch.load(one_out / "model.pt"))
    if worst == float("inf"):
        return worst, name
    la, lb = _losses(k_out), _losses(one_out)
    if len(la) != len(lb):
        return float("inf"), f"{len(la)} epochs of losses against {len(lb)}"
    for x, y in zip(la, lb):
        diff = abs(x - y) / max(abs(y), 1e-300)
        if diff > worst:
            worst, name = diff, "train_loss"
    return worst, name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=1e-9)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one training run may take")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    references: dict[tuple[str, ...], Path] = {}
    failed = 0
    with (args.out / "draws.jsonl").open("a") as log:
        for n in range(args.runs):
            shape, exchange, k = _draw(rng)
            where = args.out / str(n)
            shutil.rmtree(where, ignore_errors=True)
            k_args = shape + exchange + ["--devices", f"cpu:{k}"]
            if "--checkpoint-every" in exchange:
                k_args += ["--checkpoint-dir", str(where / "ckpt")]
            row = {"n": n, "k": k, "shape": shape, "exchange": exchange}
            mode = rng.random()
            if mode < 1 / 2 and "--checkpoint-every" not in exchange:
                k_args += ["--checkpoint-every", "3", "--checkpoint-dir", str(where / "ckpt")]
            if mode < 1 / 3:
                row["stop_after_s"], row["resume_on"] = round(rng.uniform(0.0, 1.0), 2), rng.choice(["1", "cpu:2", "cpu:3"])
                run = _stopped_and_resumed(k_args, where / "k", where / "ckpt", row["stop_after_s"], row["resume_on"],
                                           args.timeout, row)
            elif mode < 1 / 2:
                row["kill_after_s"] = round(rng.uniform(0.0, 1.0), 2)
                run = _worker_killed(k_args + ["--max-restarts", "1"], where / "k", where / "ckpt", row["kill_after_s"],
                                     args.timeout, row, rng)
            else:
                run = _train(k_args, where / "k", args.timeout)
            errors = [line for line in run.stderr.splitlines() if line.startswith("phalanx: error:")]
            if run.returncode == 2 and len(errors) == 1 and run.stderr.rstrip().endswith(errors[0]):
                row.update(verdict="refused", said=errors[0])
            elif run.returncode != 0:
                row.update(verdict="FAIL", said=f"k-device run exit {run.returncode}: {run.stderr.strip()[-400:]}")
            else:
                key = tuple(shape)
                if key not in references:
                    ref = _train(shape + ["--devices", "1"], where / "one", args.timeout)
                    if ref.returncode != 0:
                        row.update(verdict="FAIL", said=f"1-device run exit {ref.returncode}: {ref.stderr[-400:]}")
                    references[key] = where / "one"
                if "verdict" not in row:
                    worst, name = _compare(where / "k", references[key])
                    row.update(worst_rel=worst, worst=name,
                               verdict="pass" if worst <= args.tolerance else "FAIL")
                if row["verdict"] == "FAIL" and "worst_rel" in row and row["worst_rel"] < 1e-3:
                    other = [a for a in shape if a not in ("--memory-format", "contiguous")]
                    other += [] if "contiguous" in shape else ["--memory-format", "contiguous"]
                    again = _train(other + ["--devices", "1"], where / "one-other-format", args.timeout)
                    if again.returncode == 0:
                        floor, _ = _compare(where / "one-other-format", references[key])
                        row["rounding_rel"] = floor
                        if row["worst_rel"] <= 10 * floor:
                            row["verdict"] = "noise"
            if row["verdict"] == "FAIL":
                failed += 1
                (where / "stdout.txt").parent.mkdir(parents=True, exist_ok=True)
                (where / "stdout.txt").write_text(run.stdout + "\n--- stderr\n" + run.stderr)
            log.write(json.dumps(row) + "\n")
            log.flush()
            worst = format(row["worst_rel"], "9.2e") if "worst_rel" in row else ""
            rounding = f" (rounding {row['rounding_rel']:.1e})" if "rounding_rel" in row else ""
            print(f"{n:3d} k={k} {row['verdict']:7s} {worst:>9s}{rounding} {row.get('worst', '')}  "
                  f"{' '.join(shape + exchange)}"
                  + (f"\n     [{row.get('stop_line') or 'not stopped: it ended first'}; resumed on {row['resume_on']}]"
                     if "resume_on" in row else "")
                  + (f"\n     [killed worker pid {row.get('killed')}: {row.get('restart_line')}]" if "kill_after_s" in row else "")
                  + (f"\n     {row['said']}" if "said" in row else ""), flush=True)
    print(f"{failed} of {args.runs} draws failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
