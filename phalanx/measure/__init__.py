"""The measuring kit that `bench`, `predict`, `sweep` and `verify` stand on.

`timing` (warm-up, interleaved rounds, medians with spreads, paired ratios, output helpers),
`procs` (contenders that are not phalanx in fresh processes), `mlp` (the benchmark models).
"""
