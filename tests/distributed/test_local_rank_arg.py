"""`phalanx run` of a script written for torch.distributed.launch, whose parser takes `--local_rank`:
each worker gets its LOCAL_RANK as that launcher passed it, and rank 0 says once at the script's
parse_args line what runs under torchrun too (runtime/local_rank_arg.py). Before 2026-12-07 a
required `--local_rank` stopped every rank at argparse's error ("phalanx: run stopped: ... exited
with code 2 on rank 0"), as under torchrun."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.distributed


def test_a_scripts_required_local_rank_argument_is_each_workers_local_rank_said_once(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        import argparse, os, torch, torch.distributed as dist
        parser = argparse.ArgumentParser()
        parser.add_argument("--local_rank", type=int, required=True)
        parser.add_argument("--lr", type=float, default=0.1)
        args = parser.parse_args()  # parse
        dist.init_process_group("gloo")
        total = torch.tensor([float(args.local_rank)])
        dist.all_reduce(total)
        print(f"rank {dist.get_rank()} local_rank {args.local_rank} lr {args.lr} sum {total.item():g}", flush=True)
        """))
    done = subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", "cpu:2", "--timeout", "20",
                           str(script), "--lr", "0.5"], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(done.stdout.split("\n")[:2]) == ["rank 0 local_rank 0 lr 0.5 sum 1", "rank 1 local_rank 1 lr 0.5 sum 1"]
    said = [line for line in done.stderr.splitlines() if "PhalanxWarning" in line]
    assert len(said) == 1 and said[0].startswith(f"{script}:5: PhalanxWarning: the script's parser takes --local_rank, "
                                                 "which torch.distributed.launch appended"), done.stderr[-3000:]
    assert said[0].endswith("read int(os.environ[\"LOCAL_RANK\"]) instead and the script runs under torchrun too")
