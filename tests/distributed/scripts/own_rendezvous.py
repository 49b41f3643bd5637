"""A script that names its own rendezvous, for tests: torch's DDP tutorial's setup() lines
(MASTER_ADDR=localhost, MASTER_PORT=12355) before init_process_group ("env"), an
init_method="tcp://localhost:23456" ("tcp"), MASTER_PORT set before phalanx.init() ("init"), or a
world_size=4 on 2 workers, as an argument ("size") or set in os.environ before phalanx.init()
("environ"); then one summed collective, printed by each rank. Under torchrun each rank waits for a
store no one hosts (or for ranks that never come); under `phalanx run` the first three join the
launcher's store, and the last two are refused in one line.

    phalanx run --devices cpu:2 own_rendezvous.py env|tcp|init|size|environ
"""

import os
import sys

import torch
import torch.distributed as dist


def main(mode: str) -> None:
    if mode in ("env", "init"):
        os.environ["MASTER_ADDR"] = "localhost"
        os.environ["MASTER_PORT"] = "12355"
    if mode == "env":
        dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))  # env
    elif mode == "tcp":
        dist.init_process_group("gloo", init_method="tcp://localhost:23456", rank=int(os.environ["RANK"]),  # tcp
                                world_size=int(os.environ["WORLD_SIZE"]))
    elif mode == "size":  # a config's world size, not the workers started
        dist.init_process_group("gloo", world_size=4)  # size
    elif mode == "environ":
        import phalanx

        os.environ["WORLD_SIZE"] = "4"
        phalanx.init()  # environ
    else:
        import phalanx

        phalanx.init()  # init
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} sum {total.item():g} MASTER_PORT {os.environ['MASTER_PORT']}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
