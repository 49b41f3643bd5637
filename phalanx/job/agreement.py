"""The nodes of one torchrun job agree on the run before it starts: the same flags, the same code.

Under torchrun every node parses its own command line. Two nodes given different flags trained
before this check as far as the flags' own consequences let them (an outside-user trial,
2 nodes x 1 worker, digits, float64): a different `--lr`, `--momentum`, `--weight-decay`,
`--warmup-epochs` or `--optimizer` trained the whole run on replicas that drifted apart, rank 0
wrote its results, and only `close()` said so after the last step (a long run: at the 100th
step, `--check-every`); a different `--clip-grad-norm` trained silently to exit 0; a different
`--epochs`, `--dtype` or `--check-every` ended in gloo aborting a process (SIGABRT, "Received
data size doesn't match expected size"); a different `--allreduce` waited out `--timeout`
(120 s) with a line naming no flag; a different `--model` was named as its memory format.

Both run only where the ranks span torchrun's nodes (`World.node_sizes` set, as for
guards/nodes.py): the ranks of one host share its files and its argv (phalanx's own launcher
parses one command line for all), so there the gathers and the hashes would be start-up spent
on a difference that cannot arise.

`check_same_run` is the first thing such a worker does: one `all_gather_object`
of the flags that decide the run (a few hundred bytes; paths and per-host settings left out) and
of the code (phalanx's version and a SHA-256 of its sources, ~13 ms to hash; torch's version).
Every rank sees the same gathered table, so every rank raises the same one-line UsageError,
naming the first differing flag, its values and the ranks and nodes that hold each.

`check_same_start` (resume.py, before a checkpoint is applied) compares what each node found on
its own disk: the data set's identity (a `--data-dir` holding other files of the same size
trained silently on two data sets) and the checkpoint it resumes from. A node whose `--out` is
not the shared one found none and started from scratch beside a node that resumed; the run
stopped at the first step's replica check with a cause meant for scripts ("a checkpoint loaded
on some ranks only after phalanx.prepare"). Now both are one line naming the nodes' findings.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from phalanx.comm import Tag, gather_objects
from phalanx.errors import UsageError
from phalanx.job.config import TrainConfig
from phalanx.options import flags
from phalanx.runtime.world import World

# Flags a node may set for itself: where its files are, how its own cores and waits are set up,
# what its own terminal shows. Rank 0 writes the outputs and holds the run's directories, so
# the others' paths need not even be spelled alike (a shared filesystem mounted elsewhere).
PER_NODE = frozenset({"--devices", "--threads-per-device", "--bind-cores", "--timeout", "--data-dir", "--out",
                      "--checkpoint-dir", "--trace", "--no-progress", "--overwrite", "--max-restarts", "--elastic"})


def spans_nodes(world: World) -> bool:
    """True where the ranks span torchrun's nodes: each node parsed its own flags, on its own disk."""
    return world.distributed and world.node_sizes is not None


def run_flags(config: TrainConfig) -> dict[str, Any]:
    """The flags every node must give alike, by name, as the run resolved them (`--lr` left out
    and `--lr 0.2` are one value for SGD). `--resume` counts by kind only: each node names the
    shared checkpoint by its own path."""
    values: dict[str, Any] = {}
    for flag in flags(TrainConfig):
        if flag.name in PER_NODE:
            continue
        value: Any = config
        for attribute in flag.path:
            value = getattr(value, attribute)
        if flag.name == "--resume" and value not in (None, "auto"):
            value = "DIR"
        values[flag.name] = value
    return values


@functools.cache
def code_identity() -> dict[str, str]:
    """phalanx's version and a digest of its sources (a node with an edited or older copy differs), torch's version."""
    from phalanx import __version__

    root = Path(__file__).resolve().parents[1]
    return {"phalanx": f"{__version__} (sources {source_digest(root)}, at {root})", "torch": torch.__version__}


def source_digest(root: Path) -> str:
    """12 hex digits of a SHA-256 over the package's sources under `root` (names and bytes)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c") and "__pycache__" not in p.parts):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def check_same_run(world: World, config: TrainConfig) -> None:
    """Refuse, on every rank alike, a run whose nodes were given different flags or run different code."""
    if not spans_nodes(world):
        return
    mine = {"node": world.node_rank, "code": code_identity(), "flags": run_flags(config)}
    rows: list[dict[str, Any]] = gather_objects(world, mine, Tag("pre-flight check"))
    nodes = [row["node"] for row in rows]
    code = [(row["code"]["phalanx"].split(", at ")[0], row["code"]["torch"]) for row in rows]
    if len(set(code)) > 1:
        what = "phalanx" if len({c[0] for c in code}) > 1 else "torch"
        values = [f"{what} {row['code'][what]}" for row in rows]
        raise UsageError(f"the nodes run different code: {_spread(values, nodes)}; install the same phalanx and "
                         "torch on every node")
    differing = [name for name in rows[0]["flags"] if len({repr(row["flags"].get(name)) for row in rows}) > 1]
    if differing:
        name = differing[0]
        values = [_shown(row["flags"].get(name)) for row in rows]
        more = f" (and {', '.join(differing[1:])})" if len(differing) > 1 else ""
        raise UsageError(f"the nodes were started with different flags: {name} is {_spread(values, nodes)}{more}; "
                         "give every node the same phalanx train command (only torchrun's --node-rank differs)")


def check_same_start(world: World, *, data: Callable[[], dict], start: tuple[int, int, str] | None,
                     looked_in: str | None) -> None:
    """Refuse, on every rank alike, ranks that would train on different data (`data()`: this rank's
    `dataset_identity`, ~0.03 s for Fashion-MNIST, hashed only where ranks are compared) or start
    from different places (`start`: the checkpoint this rank read, as (epoch, step, path), None:
    from scratch, having `looked_in` that directory, if any)."""
    if not spans_nodes(world):
        return
    mine = {"node": world.node_rank, "data": data(), "start": start, "looked_in": looked_in}
    rows: list[dict[str, Any]] = gather_objects(world, mine, Tag("pre-flight check"))
    nodes = [row["node"] for row in rows]
    if len({repr(row["data"]) for row in rows}) > 1:
        values = [f"{d['name']} ({d['num_train']} train / {d['num_test']} test images, sha256 {d['train_sha256'][:12]})"
                  for d in (row["data"] for row in rows)]
        raise UsageError(f"the nodes read different data: {_spread(values, nodes)}; give every node the same data "
                         "set (the same files under --data-dir, or the same --dataset)")
    if len({None if row["start"] is None else tuple(row["start"][:2]) for row in rows}) > 1:
        values = [_start_text(row["start"], row["looked_in"]) for row in rows]
        raise UsageError(f"the nodes would start from different places: {_spread(values, nodes)}; every node must "
                         "read the same checkpoint: put --out (or --checkpoint-dir) on a filesystem every node sees")


def _start_text(start: tuple[int, int, str] | None, looked_in: str | None) -> str:
    if start is not None:
        return f"from epoch {start[0] + 1}, step {start[1]} ({start[2]})"
    return f"from scratch (no checkpoint in {looked_in})" if looked_in else "from scratch"


def _shown(value: Any) -> str:
    return "not given" if value is None else str(value)


def _spread(values: Sequence[str], nodes: Sequence[int]) -> str:
    """"0.2 on ranks 0-1 (node 0) and 0.1 on ranks 2-3 (node 1)": each value with the ranks that hold it."""
    by_value: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        by_value.setdefault(value, []).append(rank)
    parts = []
    for value, ranks in by_value.items():
        on = sorted({nodes[r] for r in ranks})
        where = f"node{'s' * (len(on) > 1)} {', '.join(map(str, on))}"
        parts.append(f"{value} on {_ranks(ranks)} ({where})")
    return " and ".join(parts)


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))
