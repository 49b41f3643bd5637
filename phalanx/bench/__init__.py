"""`phalanx bench allreduce|scaling|memory|overlap|splits|autopar|hosts`: the measurements behind "phalanx
beats DDP", the "Automatic Parallelism" chapter's experiments (phalanx/autopar/: `overlap`, `autopar`),
and flat vs hierarchical allreduce on simulated hosts (`hosts`).

Each benchmark lives in its own module (allreduce.py, scaling.py, memory.py, splits.py, hosts.py; autopar/chapter.py,
autopar/exercises.py) with its config dataclass (its flags, declared once), its run, its terminal
table and its chart; the measuring kit (phalanx/measure/) holds the method they share (warm-up,
calibration, interleaved rounds in fresh processes, median and min-max, the --out check, JSON and
PNG output). cli.py is the command: the table of benchmarks, their generated parsers, one way to run.
"""
