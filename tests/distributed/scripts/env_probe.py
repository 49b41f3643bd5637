"""What a worker sees of its launcher, for the test that holds `phalanx run` to torchrun's contract:
this rank's `__file__`, sys.argv, sys.path[0], `__name__`, `__spec__`, threads, environment, what its
stdin is and whether its forks wait for its native threads (phalanx/runtime/fork_guard.py), as JSON in
OUT/<rank>.json (OUT: the PROBE_OUT variable). Then it changes directory and reads its own file
through `__file__`, as a script that chdirs and then finds its data beside itself does.

    phalanx run --devices cpu:2 env_probe.py        torchrun --nproc-per-node 2 env_probe.py
    phalanx run --devices cpu:2 -m env_probe        torchrun --nproc-per-node 2 -m env_probe
"""

import json
import os
import sys

import torch

from phalanx.runtime import fork_guard

seen = {"file": __file__, "argv0": sys.argv[0], "args": sys.argv[1:], "path0": sys.path[0], "name": __name__,
        "spec": None if __spec__ is None else __spec__.name, "threads": torch.get_num_threads(),
        "env": dict(os.environ), "hash": hash("phalanx"), "stdin": os.readlink(f"/proc/self/fd/{sys.stdin.fileno()}"),
        "fork_guard": fork_guard.installed()}
os.chdir("/")
with open(__file__) as handle:  # found from anywhere: __file__ is absolute
    seen["reads_itself"] = "What a worker sees" in handle.read()
with open(os.path.join(os.environ["PROBE_OUT"], f"{os.environ['RANK']}.json"), "w") as handle:
    json.dump(seen, handle)
