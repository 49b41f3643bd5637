"""A script whose rank 1 is busy elsewhere (a sleep in a helper, as a slow preprocessing or a save on
one rank would be) while rank 0 waits in a collective (tests/distributed/test_crash_site.py): through
phalanx.init's world ("phalanx"), or a group the script opens itself ("torch"). Each rank says it is
ready just before."""

import sys
import time

import torch.distributed as dist


def slow_data():
    time.sleep(3600)  # sleeping


if sys.argv[1] == "phalanx":
    import phalanx

    world = phalanx.init()
    rank, barrier = world.rank, lambda: phalanx.barrier(world=world)
else:
    dist.init_process_group("gloo")
    rank, barrier = dist.get_rank(), dist.barrier
print(f"rank {rank} ready", flush=True)
if rank == 1:
    slow_data()  # rank 1
barrier()
