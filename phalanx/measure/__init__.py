"""The measuring kit that `bench`, `predict`, `sweep` and `verify` stand on: one method, written once.

`timing` (the method: warm-up, calibrated batches, interleaved rounds, the slowest rank, median and
min-max, paired ratios), `step` (the scaling and memory worker: phalanx's training step timed on
synthetic data, and the plain-loop, DDP, ZeRO, FSDP2 and no-communication contenders, in fresh
processes), `job_steps` (a measured job and the step each contender takes on it), `side_by_side`
(the contenders of phalanx's set-up taking turns in one start), `memory` (what a worker holds: its
tensors' bytes, its resident set and peak), `collective` (the allreduce timing method: calibrate,
agree on a count, barrier, interleave), `load` (the host's busy time and ours: what other programs
took meanwhile), `procs` (fresh processes for the contenders that are not phalanx), `mlp` (the
benchmark models), `flags` (list and size flag values) and `outputs` (the --out directory, tables,
figures, JSON + PNG).
"""
