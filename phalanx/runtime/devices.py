"""Turn a `--devices` spec into the list of devices one run drives, one worker process each.

Specs: `N` (N GPUs when CUDA is present, else N CPU workers), `cpu:N`, `cuda:0,1` (explicit GPU
ids), `cuda:N` only as an id list (`cuda:1` is GPU 1), `auto` (every GPU where CUDA is present;
on a CPU host `phalanx train` chooses the workers and threads from a probe of its model,
job/auto_devices.py, and any other command asks for cpu:N), `cpu:auto` (that probe's CPU workers
on any host, a GPU host too: phalanx train's only). CPU workers are named
cpu:0..cpu:N-1 for display; they all compute on `torch.device("cpu")`, each in its own process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phalanx.errors import UsageError

AUTO = "auto"  # --devices auto: every GPU, or on a CPU host what phalanx train's probe chooses
CPU_AUTO = "cpu:auto"  # --devices cpu:auto: what phalanx train's probe chooses, GPUs present or not


@dataclass(frozen=True, kw_only=True)
class DevicePlan:
    names: tuple[str, ...]  # "cpu:0", "cuda:1", ...

    @property
    def num_devices(self) -> int:
        return len(self.names)

    @property
    def kind(self) -> str:
        return self.names[0].split(":")[0]

    def torch_device(self, index: int) -> torch.device:
        return torch.device("cpu") if self.kind == "cpu" else torch.device(self.names[index])

    def __str__(self) -> str:
        return "[" + ", ".join(self.names) + "]"


def parse_devices(spec: str | int, *, cuda_count: int | None = None) -> DevicePlan:
    """Parse a spec; `cuda_count` defaults to what torch sees (passed explicitly in tests)."""
    if cuda_count is None:
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    text = str(spec).strip().lower()
    fix = "use --devices N, cpu:N or cuda:0,1"
    if text == AUTO:
        if cuda_count == 0:
            raise UsageError("--devices auto on a CPU host is phalanx train's (it measures the model's step): "
                             "give --devices cpu:N here")
        return DevicePlan(names=tuple(f"cuda:{i}" for i in range(cuda_count)))
    if text == CPU_AUTO:
        raise UsageError("--devices cpu:auto is phalanx train's (it measures the model's step): give --devices cpu:N "
                         "here")
    if text.isdigit():
        count = int(text)
        if count < 1:
            raise UsageError(f"--devices {spec} asks for no device; {fix} with N >= 1")
        if cuda_count == 0:
            return DevicePlan(names=tuple(f"cpu:{i}" for i in range(count)))
        if count > cuda_count:
            raise UsageError(
                f"--devices {count} asks for {count} GPUs but {cuda_count} are present; "
                f"use --devices {cuda_count} or --devices cpu:{count}"
            )
        return DevicePlan(names=tuple(f"cuda:{i}" for i in range(count)))
    kind, _, rest = text.partition(":")
    if kind == "cpu":
        if not rest.isdigit() or int(rest) < 1:
            raise UsageError(f"--devices {spec!r} is not a CPU worker count; write cpu:N with N >= 1")
        return DevicePlan(names=tuple(f"cpu:{i}" for i in range(int(rest))))
    if kind == "cuda":
        parts = [p.strip() for p in rest.split(",")] if rest else []
        if not parts or not all(p.isdigit() for p in parts):
            raise UsageError(f"--devices {spec!r} names no GPU ids; write cuda:0 or cuda:0,1")
        ids = [int(p) for p in parts]
        if len(set(ids)) != len(ids):
            raise UsageError(f"--devices {spec!r} repeats a GPU id; list each GPU once")
        missing = [i for i in ids if i >= cuda_count]
        if missing and cuda_count == 0:
            raise UsageError(
                f"--devices {spec!r} asks for GPU {missing[0]} but 0 GPUs are present (torch sees no CUDA device); "
                f"use --devices cpu:{len(ids)} to run {len(ids)} CPU worker{'s' if len(ids) > 1 else ''} instead"
            )
        if missing:
            present = "0" if cuda_count == 1 else f"0..{cuda_count - 1}"
            raise UsageError(
                f"--devices {spec!r} asks for GPU {missing[0]} but {cuda_count} GPUs are present (ids {present}); "
                f"list present ids only, e.g. --devices cuda:{','.join(map(str, range(min(len(ids), cuda_count))))}"
            )
        return DevicePlan(names=tuple(f"cuda:{i}" for i in ids))
    raise UsageError(f"--devices {spec!r} is not understood; {fix}")
