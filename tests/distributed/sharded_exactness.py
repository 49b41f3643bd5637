"""Every sharding stage equals `--shard none` and 1 device through `phalanx train`, on real data.

The long form of tests/distributed/test_sharded_equals_one_device.py (which the suite runs on random batches): for
each model and optimizer, `phalanx train` in float64 on 1 device and on `--devices cpu:3` with each
`--shard` stage, 2 epochs with an uneven last batch, weight decay and gradient clipping on; then
the final parameters (model.pt) and the optimizer state (the last checkpoint: a whole one's
state dict, or a sharded one's shares reassembled) compared, each tensor relative to its state's
largest value (a bias right before BatchNorm aside: see ZERO_GRADIENT). Not collected by pytest (minutes of training); run it as

    python -m tests.distributed.sharded_exactness --data-dir DIR [--models lenet,lenet-bn,mlp] [--out DIR]

with DIR holding Fashion-MNIST's four IDX files (the development sample does). Prints one row per
case and exits 1 if any is above 1e-9.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from phalanx.data_parallel.sharding.flat_layout import Slot
from phalanx.data_parallel.sharding.state import whole_state
from phalanx.models import build_model
from phalanx.train.sharded_checkpoint import FORMAT_SHARDED, reader_of

OPTIMIZERS = {"sgd": ["--optimizer", "sgd"], "sgd-momentum": ["--optimizer", "sgd", "--momentum", "0.9"],
              "adam": ["--optimizer", "adam"], "adamw": ["--optimizer", "adamw"]}
RUNS = (("1", "none"), ("cpu:3", "none"), ("cpu:3", "optimizer"), ("cpu:3", "gradients"), ("cpu:3", "parameters"))
BOUND = 1e-9
# A bias right before BatchNorm has an exactly zero gradient; what it gets is rounding noise, which
# Adam's normalisation turns into steps of its own, and the running mean after it follows. These
# tensors differ as much between 1 device and 3 unsharded devices (1.9e-7 for LeNet-BN's conv1.bias
# under AdamW) as with sharding: they are reported in a column of their own, outside the bound.
ZERO_GRADIENT = {"lenet-bn": ("conv1.bias", "conv2.bias", "fc1.bias", "bn1.running_mean", "bn2.running_mean",
                              "bn3.running_mean")}


def _train(out: Path, model: str, optimizer: list[str], devices: str, shard: str, data_dir: str) -> None:
    args = [sys.executable, "-m", "phalanx", "train", "--model", model, "--dtype", "float64", "--epochs", "2",
            "--data-dir", data_dir, "--dataset", "fashion-mnist", "--devices", devices, "--shard", shard,
            "--weight-decay", "0.001", "--clip-grad-norm", "1.0", "--checkpoint-every", "epoch", "--no-progress",
            "--threads-per-device", "1", "--out", str(out), *optimizer]
    done = subprocess.run(args, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stderr[-3000:]}")


def _state(out: Path, model_name: str) -> tuple[dict, dict]:
    """(parameters by name, the optimizer state by parameter index) a finished run ends with."""
    params = torch.load(out / "model.pt", weights_only=True)
    manifest = out / "checkpoints" / "checkpoint.pt"
    state = torch.load(manifest, weights_only=True)
    if state["format"] != FORMAT_SHARDED:
        return params, state["optimizer"]["state"]
    names = [name for name, _ in build_model(model_name).named_parameters()]
    _, optimizer = whole_state(reader_of(manifest, state), slots=[Slot.of(s) for s in state["layout"]], names=names)
    return params, optimizer["state"]


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-300)).item()


def _worst(got: tuple[dict, dict], want: tuple[dict, dict], skip: tuple[str, ...]) -> tuple[float, float, float]:
    """(parameters, optimizer state, the `skip`ped zero-gradient tensors): the largest relative gaps."""
    params = max(_relative(got[0][k], want[0][k]) for k in want[0] if want[0][k].is_floating_point() and k not in skip)
    degenerate = max((_relative(got[0][k], want[0][k]) for k in skip), default=0.0)
    scale: dict[str, float] = {}
    for entry in want[1].values():
        for key, value in entry.items():
            if torch.is_tensor(value) and value.dim():
                scale[key] = max(scale.get(key, 0.0), value.abs().max().item())
    state = 0.0
    for index, entry in want[1].items():
        for key, value in entry.items():
            mine = got[1][index][key]
            if key in scale:
                state = max(state, (mine.double() - value.double()).abs().max().item() / max(scale[key], 1e-300))
            elif float(mine) != float(value):
                state = float("inf")
    return params, state, degenerate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--models", default="lenet,lenet-bn,mlp")
    parser.add_argument("--out", default=None, help="where the runs go (default: a temporary directory)")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    args = parser.parse_args(argv)
    root = Path(args.out or tempfile.mkdtemp(prefix="phalanx-sharded-exactness-"))
    failed = False
    print(f"{'model':9} {'optimizer':13} {'devices':7} {'shard':10} {'params vs 1':>12} {'vs none':>9} "
          f"{'state vs 1':>11} {'vs none':>9} {'zero-grad vs 1':>15} {'vs none':>9}")
    for model in args.models.split(","):
        for opt_name in args.optimizers.split(","):
            optimizer = OPTIMIZERS[opt_name]
            states = {}
            for devices, shard in RUNS:
                out = root / f"{model}-{opt_name}-{devices.replace(':', '')}-{shard}"
                _train(out, model, optimizer, devices, shard, args.data_dir)
                states[(devices, shard)] = _state(out, model)
            skip = ZERO_GRADIENT.get(model, ())
            for devices, shard in RUNS[1:]:
                got = states[(devices, shard)]
                vs_one, vs_none = _worst(got, states[RUNS[0]], skip), _worst(got, states[RUNS[1]], skip)
                failed |= max(*vs_one[:2], *vs_none[:2]) > BOUND
                print(f"{model:9} {opt_name:13} {devices:7} {shard:10} {vs_one[0]:12.2e} {vs_none[0]:9.2e} "
                      f"{vs_one[1]:11.2e} {vs_none[1]:9.2e} {vs_one[2]:15.2e} {vs_none[2]:9.2e}", flush=True)
    print(f"runs in {root}; bound {BOUND:g}: {'FAILED' if failed else 'all within'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
