"""A script one rank of which crashes in compiled code (tests/distributed/test_crash_site.py): a
segmentation fault in a helper, on a thread of its own, or os.abort(); "own" enables faulthandler
itself first. Rank 0 waits in a collective for it."""

import ctypes
import faulthandler
import os
import sys
import threading

import torch.distributed as dist


def read_address_zero():
    ctypes.string_at(0)  # segfault


def crash(mode):
    if mode == "abort":
        os.abort()  # abort
    elif mode == "thread":
        worker = threading.Thread(target=read_address_zero)
        worker.start()
        worker.join()
    else:
        if mode == "own":
            faulthandler.enable()
        read_address_zero()


dist.init_process_group("gloo")
if dist.get_rank() == 1:
    crash(sys.argv[1])  # rank 1
dist.barrier()
