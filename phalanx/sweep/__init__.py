"""`phalanx sweep`: the chapter's exercises 1 and 2 - devices × per-device batch × learning rate.

Trains `phalanx train`'s job over a grid of device counts k, per-device batches b (global batch
k·b) and lr rules (numbers, or `scaled`: the linear-scaling rule with warmup), then prints a
table and writes sweep.json, sweep.csv and sweep.png (final test accuracy and time to a target
accuracy over the global batch) into `--out` (default runs/sweep), plus each point's row under
`points/` as it finishes (what `--resume` reuses). grid.py holds the config (its flags declared on
its fields) and the grid, run.py the training, report.py the outputs, cli.py the command.
"""
