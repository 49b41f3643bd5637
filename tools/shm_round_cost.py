"""One rank's CPU per shm allreduce round, its peers already arrived: what a round costs the
rank itself, compiled against in Python, with no waiting and no other process in the way.

    .venv/bin/python tools/shm_round_cost.py [--sizes 4096,65536] [--ranks 2,4,8] [--calls 5000] [--rounds 5]

A real round at k ranks also waits for the slowest of k processes (`phalanx bench allreduce`
times that, wall clock, slowest rank); this isolates the part each rank spends on its own: the
copy in, the flag, the spin that finds every peer there, the sum of the k slots. The group is a
ShmGroup over a private mapping whose peers' flags are set far ahead, so each wait returns at
once. Contenders run interleaved round by round; thread CPU time, which a busy host moves less
than wall time. Prints the median per round and the median of per-round ratios.
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import time

import torch

from phalanx.comm.shm import ShmGroup
from phalanx.comm.shm_flags import ARRIVED, LINE, REDUCED
from phalanx.runtime.world import World

_FAR_AHEAD = 1 << 60


class PeersArrived(ShmGroup):
    """A group of k whose rank 0 is this process and whose k - 1 peers have arrived in every round."""

    def _share(self, size: int) -> mmap.mmap:
        return mmap.mmap(-1, size)  # this process's alone: no peer to share it with

    def _opened(self) -> None:
        for r in range(1, self.k):
            for field in (ARRIVED, REDUCED):
                self._flags.words[r * (LINE // 8) + field] = _FAR_AHEAD


def group_of(k: int, *, compiled: bool) -> ShmGroup:
    world = World(rank=0, world_size=k, local_rank=0, local_world_size=k, device=torch.device("cpu"),
                  backend="gloo", timeout_s=30.0)
    return PeersArrived(world=world, slot_bytes=1 << 20, compiled=compiled)


def measure(sizes: list[int], ranks: list[int], calls: int, rounds: int) -> list[dict]:
    torch.set_num_threads(1)  # a worker's communication thread runs single-threaded
    rows = []
    for size in sizes:
        for k in ranks:
            groups = {"python": group_of(k, compiled=False), "compiled": group_of(k, compiled=True)}
            piece = torch.ones(size // 4)
            per_call: dict[str, list[float]] = {name: [] for name in groups}
            for _ in range(rounds):
                for name, group in groups.items():
                    for _ in range(max(1, calls // 10)):
                        group.allreduce(piece)
                    start = time.thread_time()
                    for _ in range(calls):
                        group.allreduce(piece)
                    per_call[name].append((time.thread_time() - start) / calls)
            rows.append({"size_bytes": size, "ranks": k, "compiled_rounds": groups["compiled"].rounds,
                         **{f"{name}_us": statistics.median(v) * 1e6 for name, v in per_call.items()},
                         "python_over_compiled": statistics.median(
                             p / c for p, c in zip(per_call["python"], per_call["compiled"]))})
            for group in groups.values():
                group.close()
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4096,65536", help="piece sizes in bytes (float32)")
    parser.add_argument("--ranks", default="2,4,8", help="group sizes k")
    parser.add_argument("--calls", type=int, default=5000, help="timed calls per contender per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    args = parser.parse_args(argv)
    rows = measure([int(s) for s in args.sizes.split(",")], [int(k) for k in args.ranks.split(",")], args.calls,
                   args.rounds)
    for row in rows:
        print(f"{row['size_bytes'] // 1024} KB, k = {row['ranks']}: Python {row['python_us']:.1f} µs, "
              f"{row['compiled_rounds']} {row['compiled_us']:.1f} µs, Python / compiled {row['python_over_compiled']:.2f}")
    return rows


if __name__ == "__main__":
    main()
