"""Every flag of every subcommand has a bad-input entry: one line, exit 2, nothing written.

`FLAG_CASES` holds, per flag, a value a user could plausibly mistype and what the one line must
name. `test_every_flag_has_a_case` walks the real parser (nested subcommands included), so a new
flag without an entry fails here. Each case runs `phalanx.cli.main` in this process from an
empty working directory, which must still be empty afterwards (a refused run writes nothing,
not even the default `runs/...` output folder). No case starts a worker process.
"""

from __future__ import annotations

import argparse
import re

import pytest

from phalanx.autopar.trace import records_every_thread
from phalanx.runtime.launcher_flags import launcher_flags
from phalanx.runtime.binding import allowed_cores
from phalanx.cli import build_parser, main

_PROFILES_EVERY_THREAD = records_every_thread()  # torch 2.7 and later (2.4.1 refuses --trace by its version)
NOWHERE = "/nonexistent-phalanx-12"
PROC = "/proc/phalanx-12"
TOO_MANY = f"cpu:{len(allowed_cores()) + 1}"  # more workers than this host has cores  # a virtual filesystem: "writable" by mode bits, yet no mkdir succeeds

# (argv, pattern the one line must match)
FLAG_CASES = [
    (["train", "--devices", "0"], r"--devices 0 asks for no device; use --devices N, cpu:N"),
    (["train", "--model", "vgg"], r"--model 'vgg' is unknown; choose one of"),
    (["train", "--dataset", "cifar"], r"--dataset 'cifar' is unknown; choose one of"),
    (["train", "--data-dir", NOWHERE], r"data dir .* does not exist; create it"),
    (["train", "--train-examples", "0"], r"--train-examples 0 must be at least 1"),
    (["train", "--dataset", "synthetic", "--train-examples", "6001", "--devices", "cpu:2"],
     r"--train-examples 6001 is more than the 6000 training images synthetic has; use at most 6000, or leave it out"),
    (["train", "--epochs", "0"], r"--epochs 0 must be at least 1"),
    (["train", "--batch-size", "0"], r"--batch-size 0 must be at least 1"),
    (["train", "--lr", "-1"], r"--lr -1\.0 must be a positive finite number"),
    (["train", "--momentum", "1"], r"--momentum 1\.0 must be at least 0 and below 1; use e\.g\. --momentum 0\.9"),
    (["train", "--optimizer", "lamb"], r"--optimizer 'lamb' is unknown; choose one of sgd, adam, adamw"),
    (["train", "--optimizer", "adam", "--momentum", "0.9"], r"--momentum is SGD's; --optimizer adam has its own moments"),
    (["train", "--weight-decay", "-0.1"], r"--weight-decay -0\.1 must be 0 \(none\) or more"),
    (["train", "--clip-grad-norm", "0"], r"--clip-grad-norm 0\.0 must be a positive finite number"),
    (["train", "--shard", "zero3"], r"--shard 'zero3' is ZeRO's stage 3, which phalanx names 'parameters' \(stage 0 is 'none'"),
    (["train", "--shard", "parameters", "--allreduce", "tree"],
     r"--shard parameters reduce-scatters and all-gathers, which --allreduce tree cannot; use --allreduce auto"),
    (["train", "--shard", "optimizer", "--split", "layers"], r"--shard is a data-parallel option; drop it with --split layers"),
    (["train", "--warmup-epochs", "-1"], r"--warmup-epochs -1\.0 must be 0 \(none\) or a positive number"),
    (["train", "--warmup-epochs", "3", "--epochs", "3"],  # trained silently before 2026-12-06
     r"--warmup-epochs 3 must be below --epochs 3, so the lr reaches --lr 0\.2 before the run ends; use e\.g\. "
     r"--warmup-epochs 1\.5"),
    (["train", "--allreduce", "butterfly"], r"--allreduce 'butterfly' is unknown; choose one of"),
    (["train", "--seed", "-5"], r"--seed -5 must be 0 or more; use e\.g\. --seed 0"),
    (["train", "--init", "xavier"], r"--init 'xavier' is unknown; choose one of"),
    (["train", "--dtype", "float16"], r"--dtype 'float16' is unknown; choose one of"),
    (["train", "--out", f"{PROC}/run"], r"--out .* cannot be created .*; pick a directory on a writable filesystem"),
    (["train", "--threads-per-device", "0"], r"--threads-per-device 0 must be at least 1"),
    (["train", "--bind-cores", "--devices", TOO_MANY, "--dataset", "synthetic"],
     r"--bind-cores needs a core per worker: \d+ workers on this host, \d+ cores available; use at most"),
    (["train", "--timeout", "0"], r"--timeout 0\.0 must be a finite number of seconds, at least 1"),
    (["train", "--timeout", "inf"], r"--timeout inf must be a finite number of seconds"),  # was an OverflowError
    (["run", "--timeout", "0.001", "train.py"], r"--timeout 0\.001 must be a finite number of seconds, at least 1"),
    (["train", "--no-progress=yes"], r"argument --no-progress: ignored explicit argument 'yes'"),
    (["train", "--overlap=yes"], r"argument --overlap/--no-overlap: ignored explicit argument 'yes'"),
    (["train", "--no-overlap=yes"], r"argument --overlap/--no-overlap: ignored explicit argument 'yes'"),
    (["train", "--bucket-cap-mb", "0"], r"--bucket-cap-mb 0\.0 must be a positive number of MB"),
    (["train", "--grad-dtype", "int8"], r"--grad-dtype 'int8' is unknown; choose one of"),
    (["train", "--grad-accum", "0"], r"--grad-accum 0 must be at least 1"),
    (["train", "--memory-format", "nhwc"], r"--memory-format 'nhwc' is unknown; choose one of"),
    (["train", "--batchnorm", "global"], r"--batchnorm 'global' is unknown; choose one of"),
    (["train", "--trace", PROC], r"--trace .* cannot be created"),
    (["train", "--trace-steps", "0"], r"--trace-steps 0 must be at least 1"),
    (["train", "--cuda-graphs", "always"], r"--cuda-graphs 'always' is unknown; choose one of auto, on, off"),
    (["train", "--cuda-graphs", "on"],
     r"--cuda-graphs on: CUDA graphs need CUDA devices; this run is on cpu; use --cuda-graphs auto"),
    (["train", "--checkpoint-every", "-3"], r"--checkpoint-every -3 is neither 'epoch' nor a positive number"),
    (["train", "--checkpoint-dir", PROC, "--checkpoint-every", "5"], r"--checkpoint-dir .* cannot be created"),
    (["train", "--resume", f"{NOWHERE}/ckpt", "--dataset", "synthetic"], r"no checkpoint at .*; pass --resume"),
    (["train", "--check-every", "-1"], r"--check-every -1 must be 0 \(off\) or a number of steps"),
    (["train", "--overwrite", "--resume", f"{NOWHERE}/ckpt"],
     r"--overwrite starts afresh and --resume \S+ continues; pass one of them"),
    (["train", "--max-restarts", "-1"], r"--max-restarts -1 must be 0 \(no restarts\) or more"),
    (["train", "--max-restarts", "2"], r"--max-restarts 2 restarts from the last checkpoint; add --checkpoint-every"),
    (["train", "--elastic"], r"--elastic goes on without a device .*; add --max-restarts N"),
    (["train", "--split", "pipeline"], r"--split 'pipeline' is unknown; choose one of data, layers, channels"),
    (["train", "--split", "layers", "--micro-batches", "0"], r"--micro-batches 0 must be between 1 and the global batch"),
    (["train", "--split", "layers", "--schedule", "zigzag"], r"--schedule 'zigzag' is unknown; choose one of gpipe, 1f1b"),
    (["bench", "splits", "--devices", "1"], r"--devices 1 must be at least 2"),
    (["bench", "splits", "--batch-size", "0"], r"--batch-size 0 is smaller than 4 devices"),
    (["bench", "splits", "--micro-batches", "0"], r"--micro-batches 0 must be between 1 and the global batch"),
    (["bench", "splits", "--schedule", "zigzag"], r"--schedule 'zigzag' is unknown; choose one of gpipe, 1f1b"),
    (["bench", "splits", "--steps", "0"], r"--steps 0 must be at least 1"),
    (["bench", "splits", "--rounds", "0"], r"--rounds 0 must be at least 1"),
    (["bench", "splits", "--dtype", "float16"], r"--dtype 'float16' is unknown; choose one of float32, float64"),
    (["bench", "splits", "--out", PROC], r"--out .* cannot be created"),
    (["verify", "--split", "pipeline"], r"--split 'pipeline' is unknown; choose one of data, layers, channels"),
    (["verify", "--split", "layers", "--micro-batches", "0"], r"--micro-batches 0 must be between 1 and the global batch"),
    (["verify", "--split", "layers", "--schedule", "zigzag"], r"--schedule 'zigzag' is unknown; choose one of gpipe, 1f1b"),
    (["bench", "allreduce", "--sizes", "0KB"], r"--sizes 0 bytes is not a positive multiple of 4 bytes"),
    (["bench", "allreduce", "--world-sizes", "1"], r"--world-sizes 1 must be at least 2"),
    (["bench", "allreduce", "--algorithms", "butterfly"], r"--algorithms 'butterfly' is unknown; choose one of native, shm"),
    (["bench", "allreduce", "--rounds", "0"], r"--rounds 0 must be at least 1"),
    (["bench", "allreduce", "--shm-rounds", "cython"], r"--shm-rounds 'cython' is unknown; choose one of compiled, python"),
    (["bench", "allreduce", "--shm-rounds", "python", "--algorithms", "ring"],
     r"--shm-rounds python times shm's rounds, and --algorithms ring has no shm; add shm to --algorithms"),
    (["bench", "allreduce", "--collectives", "allgather"], r"--collectives 'allgather' is unknown; choose one of allreduce"),
    (["bench", "allreduce", "--out", PROC], r"--out .* cannot be created"),
    (["bench", "scaling", "--model", "vgg"], r"--model 'vgg' is unknown; choose one of lenet, mlp"),
    (["bench", "scaling", "--batch-sizes", "0"], r"--batch-sizes 0: every global batch size must be at least --devices 2"),
    (["bench", "scaling", "--devices", "1"], r"--devices 1: the largest count must be at least 2 to compare scaling"),
    (["bench", "scaling", "--devices", "2,x"], r"--devices item 'x' is not a device count; give counts, e\.g\. "
                                               r"--devices 2,4 \(or cpu:2,cpu:4\)"),
    (["bench", "scaling", "--steps", "0"], r"--steps 0 must be at least 1"),
    (["bench", "scaling", "--warmup-steps", "-1"], r"--warmup-steps -1 must be at least 0"),
    (["bench", "scaling", "--rounds", "0"], r"--rounds 0 must be at least 1"),
    (["bench", "scaling", "--grad-dtype", "int8"], r"--grad-dtype 'int8' is unknown"),
    (["bench", "scaling", "--finite-check-cost=yes"], r"argument --finite-check-cost: ignored explicit argument"),
    (["bench", "scaling", "--side-by-side", "--finite-check-cost"],
     r"--side-by-side times the contenders with phalanx's set-up only; run --grad-dtype and --finite-check-cost"),
    (["bench", "scaling", "--blocks", "0"], r"--blocks 0 must be at least 1"),
    (["bench", "scaling", "--out", PROC], r"--out .* cannot be created"),
    (["bench", "overlap", "--device", "tpu"], r"--device 'tpu' is unknown; choose one of auto, cpu, cuda"),
    (["bench", "overlap", "--matrix-size", "0"], r"--matrix-size 0 must be at least 1"),
    (["bench", "overlap", "--matmuls", "0"], r"--matmuls 0 must be at least 1"),
    (["bench", "overlap", "--transfer-mb", "-1"], r"--transfer-mb -1\.0 must be a positive number of MB"),
    (["bench", "overlap", "--algorithm", "butterfly"], r"--algorithm 'butterfly' is unknown; choose one of"),
    (["bench", "overlap", "--rounds", "0"], r"--rounds 0 must be at least 1"),
    (["bench", "overlap", "--out", PROC], r"--out .* cannot be created"),
    (["bench", "autopar", "--experiments", "1,4"], r"experiment 4 is the profiler: add --trace DIR"),
    (["bench", "autopar", "--device", "tpu"], r"--device 'tpu' is unknown; choose one of auto, cpu, cuda"),
    (["bench", "autopar", "--rounds", "0"], r"--rounds 0 must be at least 1"),
    (["bench", "autopar", "--trace", PROC], r"--trace .* cannot be created" if _PROFILES_EVERY_THREAD else
     r"--trace needs a torch whose profiler records every thread .* torch 2\.7 or later"),  # refused first before 2.7
    (["bench", "autopar", "--lanes", "1"], r"--lanes 1 must be at least 2"),
    (["bench", "autopar", "--matrix-size", "0"], r"--matrix-size 0 must be at least 1"),
    (["bench", "autopar", "--matmuls", "0"], r"--matmuls 0 must be at least 1"),
    (["bench", "autopar", "--sizes", "64,32"], r"--sizes 64,32 must be distinct positive numbers in ascending order"),
    (["bench", "autopar", "--ops-per-size", "0"], r"--ops-per-size 0 must be at least 1"),
    (["bench", "autopar", "--target-ms", "0"], r"--target-ms 0\.0 must be a positive number of milliseconds"),
    (["bench", "autopar", "--chunks", "0"], r"--chunks 0 must be at least 1"),
    (["bench", "autopar", "--chunk-rows", "0"], r"--chunk-rows 0 must be at least 1"),
    (["bench", "autopar", "--width", "0"], r"--width 0 must be at least 1"),
    (["bench", "autopar", "--batch-size", "7"], r"--batch-size 7 must be even and at least 2"),
    (["bench", "autopar", "--hidden", "0"], r"--hidden 0 must be at least 1"),
    (["bench", "autopar", "--steps", "0"], r"--steps 0 must be at least 1"),
    (["bench", "autopar", "--dtype", "float16"], r"--dtype 'float16' is unknown; choose one of float32, float64"),
    (["bench", "autopar", "--out", PROC], r"--out .* cannot be created"),
    (["verify", "--model", "vgg"], r"--model 'vgg' is unknown; choose one of"),
    (["verify", "--devices", "1"], r"--devices 1 must be at least 2 \(1 device is the reference"),
    (["verify", "--devices", "cpu:0,2"], r"--devices 0,2: 0 must be at least 2 \(1 device is the reference"),
    (["verify", "--device", "tpu"], r"--device 'tpu' is unknown"),
    (["verify", "--steps", "0"], r"--steps 0 must be at least 1"),
    (["verify", "--batch-size", "1"], r"--batch-size 1 is smaller than 3 devices"),
    (["verify", "--lr", "0"], r"--lr 0\.0 must be a positive finite number"),
    (["verify", "--seed", "-5"], r"--seed -5 must be 0 or more"),
    (["verify", "--dtype", "float16"], r"--dtype 'float16' is unknown"),
    (["verify", "--tolerance", "-1"], r"--tolerance -1\.0 must be a positive finite number"),
    (["verify", "--allreduce", "butterfly"], r"--allreduce 'butterfly' is unknown"),
    (["verify", "--overlap=on"], r"argument --overlap/--no-overlap: ignored explicit argument"),
    (["verify", "--no-overlap=yes"], r"argument --overlap/--no-overlap: ignored explicit argument"),
    (["verify", "--batchnorm", "global"], r"--batchnorm 'global' is unknown"),
    (["verify", "--grad-dtype", "int8"], r"--grad-dtype 'int8' is unknown"),
    (["verify", "--plant", "nothing"], r"--plant 'nothing' is unknown"),
    (["verify", "--dataset", "cifar"], r"--dataset 'cifar' is unknown; choose one of"),
    (["verify", "--dataset", "fashion-mnist", "--data-dir", NOWHERE], r"data dir .* does not exist"),
    (["verify", "--timeout", "0"], r"--timeout 0\.0 must be a finite number of seconds, at least 1"),
    (["verify", "--no-diagnose=yes"], r"argument --no-diagnose: ignored explicit argument"),
    (["verify", "--out", f"{PROC}/v.json"], r"--out .*: directory .* does not exist"),
    (["predict", "--model", "vgg"], r"--model 'vgg' is unknown; choose one of lenet, mlp"),
    (["predict", "--overlap", "--hosts", "2", "--link-gbit", "10"], r"--hosts predicts flat against hierarchical "
     r"exchanges as training runs them \(beside backward\); drop --overlap"),
    (["predict", "--batch-size", "0"], r"--batch-size 0: every global batch size must be at least the largest world size"),
    (["predict", "--world-sizes", "0"], r"--world-sizes 0 must be at least 1"),
    (["predict", "--allreduce", "butterfly"], r"--allreduce 'butterfly' is unknown; choose one of"),
    (["predict", "--bucket-cap-mb", "0"], r"--bucket-cap-mb 0\.0 must be a positive number of MB"),
    (["predict", "--interconnect", "carrier-pigeon"], r"--interconnect 'carrier-pigeon' is unknown; choose one of loopback"),
    (["predict", "--alpha-us", "-1"], r"--alpha-us -1\.0 must be a finite latency of 0 µs or more"),
    (["predict", "--beta-gbps", "0"], r"--beta-gbps 0\.0 must be a positive finite bandwidth"),
    (["predict", "--overlap-efficiency", "2"], r"--overlap-efficiency 2\.0 must be between 0 and 1"),
    (["predict", "--validate=yes"], r"argument --validate: ignored explicit argument"),
    (["predict", "--rounds", "0"], r"--rounds 0 must be at least 1"),
    (["predict", "--steps", "0"], r"--steps 0 must be at least 2"),
    (["predict", "--warmup-steps", "-1"], r"--warmup-steps -1 must be at least 0"),
    (["predict", "--out", PROC], r"--out .* cannot be created"),
    (["predict", "--hosts", "1", "--link-gbit", "1"], r"--hosts 1 must be at least 2"),
    (["predict", "--hosts", "2"], r"--hosts needs --link-gbit"),
    (["predict", "--hosts", "2", "--link-gbit", "0"], r"--link-gbit 0\.0 must be a positive number of Gbit/s"),
    (["predict", "--link-gbit", "1"], r"--link-gbit 1 is the link between hosts: give --hosts too"),
    (["predict", "--workers-per-host", "0"], r"--workers-per-host 0 must be at least 1"),
    (["bench", "hosts", "--hosts", "1"], r"--hosts 1 must be at least 2"),
    (["bench", "hosts", "--workers-per-host", "0"], r"--workers-per-host 0 must be at least 1"),
    (["bench", "hosts", "--link-gbit", "0"], r"--link-gbit 0\.0 must be a positive number of Gbit/s"),
    (["bench", "hosts", "--model", "vgg"], r"--model 'vgg' is unknown; choose one of lenet, mlp"),
    (["bench", "hosts", "--batch-size", "3"], r"--batch-size 3 is smaller than 4 workers"),
    (["bench", "hosts", "--allreduce-calls", "0"], r"--allreduce-calls 0 must be at least 1"),
    (["bench", "hosts", "--steps", "0"], r"--steps 0 must be at least 1"),
    (["bench", "hosts", "--warmup-steps", "-1"], r"--warmup-steps -1 must be at least 0"),
    (["bench", "hosts", "--rounds", "0"], r"--rounds 0 must be at least 1"),
    (["bench", "hosts", "--out", PROC], r"--out .* cannot be created|bench hosts needs simulated hosts"),
    (["sweep", "--devices", "0"], r"--devices 0 holds 0; device counts must be at least 1"),
    (["sweep", "--per-device-batch", "0"], r"--per-device-batch 0 holds 0"),
    (["sweep", "--lr", "-1"], r"--lr -1\.0 must be a positive finite number or 'scaled'"),
    (["sweep", "--base-lr", "0"], r"--base-lr 0\.0 must be a positive finite number"),
    (["sweep", "--base-batch", "0"], r"--base-batch 0 must be at least 1"),
    (["sweep", "--warmup-epochs", "-1"], r"--warmup-epochs -1 must be at least 0"),
    (["sweep", "--epochs", "0"], r"--epochs 0 must be at least 1"),
    (["sweep", "--target", "2"], r"--target 2\.0 is not an accuracy"),
    (["sweep", "--model", "vgg"], r"--model 'vgg' is unknown"),
    (["sweep", "--dataset", "cifar"], r"--dataset 'cifar' is unknown"),
    (["sweep", "--data-dir", NOWHERE], r"data dir .* does not exist"),
    (["sweep", "--train-examples", "-3"], r"--train-examples -3 must be at least 1"),
    (["sweep", "--seed", "-5"], r"--seed -5 must be 0 or more"),
    (["sweep", "--threads-per-device", "0"], r"--threads-per-device 0 must be at least 1"),
    (["sweep", "--timeout", "0"], r"--timeout 0\.0 must be a finite number of seconds, at least 1"),
    (["sweep", "--out", PROC], r"--out .* cannot be created"),
    (["sweep", "--resume=yes"], r"argument --resume: ignored explicit argument"),
    (["sweep", "--overwrite=yes"], r"argument --overwrite: ignored explicit argument"),
    (["run", "--devices", "0", "train.py"], r"--devices 0 asks for no device"),
    (["run", "--timeout", "0", "train.py"], r"--timeout 0\.0 must be a finite number of seconds, at least 1"),
    (["run", "--threads-per-device", "0", "train.py"], r"--threads-per-device 0 must be at least 1"),
    (["run", "--bind-cores", "--devices", TOO_MANY, "train.py"], r"--bind-cores needs a core per worker"),
    (["run", "--quiet=yes", "train.py"], r"argument --quiet: ignored explicit argument 'yes'"),
    (["run", "--max-restarts", "-1", "train.py"], r"--max-restarts -1 must be 0 \(no restarts\) or more"),
    (["run", f"{NOWHERE}/train.py"], r"script .*train\.py does not exist; name a Python file"),
    (["run", "."], r"script \. is a directory; name a Python file"),
    (["run"], r"the following arguments are required: script \(see"),  # not "script, args": args may be none
    (["run", "-m", "nowhere_pkg.train"], r"module nowhere_pkg\.train is not found \(python -m nowhere_pkg\.train would "
                                         r"say 'No module named nowhere_pkg\.train'\): check its name"),
    (["run", "--module", "train-2"], r"-m 'train-2' is not a module name; name it as python -m takes it"),
    (["--version=1"], r"argument --version: ignored explicit argument '1'"),
]
# Other launchers' flags before the script: each named with phalanx run's way (runtime/launcher_flags.py).
FLAG_CASES += [
    (["run", "--nproc-per-node", "4", "train.py"],
     r"^phalanx: error: torchrun's --nproc-per-node 4 is --devices in phalanx run: .*e\.g\. phalanx run --devices 4 "),
    (["run", "--nproc_per_node=gpu", "train.py"], r"torchrun's --nproc_per_node gpu is --devices in phalanx run"),
    (["run", "--standalone", "train.py"], r"phalanx run is standalone already .*: drop --standalone$"),
    (["run", "--devices", "cpu:2", "--local-ranks-filter", "0,2", "train.py"],
     r"^phalanx: error: --local-ranks-filter names local rank 2, but this host runs 2 workers \(local ranks 0 to 1\); "
     r"name ranks below 2, e.g. --local-ranks-filter 0$"),
    (["run", "--local-ranks-filter", "-1", "train.py"], r"--local-ranks-filter -1 must be at least 0"),
    (["run", "--local_ranks_filter", "0", "train.py"],
     r"phalanx run spells it --local-ranks-filter R,\.\.\. \(torchrun takes --local_ranks_filter too\)"),
    # torchtitan's run_train.sh line: every other launcher's flag before the script named at once (before
    # 2026-12-07 one per attempt, five attempts); the script's own after its name are its own.
    (["run", "--nproc_per_node=2", "--rdzv_backend", "c10d", "--rdzv_endpoint=localhost:0", "--local-ranks-filter", "0",
      "--role", "rank", "--tee", "3", "-m", "train", "--tee", "2", "--nnodes", "4"],
     r"^phalanx: error: torchrun's --nproc_per_node 2 is --devices in phalanx run: .*; the command line also gives "
     r"--rdzv_backend, --rdzv_endpoint and --role, none of them phalanx run's either \(`phalanx run --help` "
     r"lists its own\)$"),
    (["train", "--nproc-per-node", "2", "--epochs", "1", "--nnodes", "1"],
     r"is --devices in phalanx train: .*; the command line also gives --nnodes, not phalanx train's either"),
    (["run", "--max_restarts", "3", "train.py"], r"phalanx run spells it --max-restarts N \(torchrun takes --max_restarts "
                                                 r"too\)$"),
    (["run", "--no-python", "train.py"], r"phalanx run runs a Python file, or a module with -m"),
    (["run", "--run-path", "train.py"], r"phalanx run already runs the script in each worker's own interpreter"),
    (["run", "--numa-binding", "node", "train.py"], r"phalanx run takes no --numa-binding: --bind-cores pins each worker"),
    (["run", "--use-env", "train.py"], r"phalanx run gives each worker LOCAL_RANK in its environment, as --use-env asked "
                                       r"torch\.distributed\.launch to .*: drop --use-env, and let a script that parses "
                                       r"--local-rank read int\(os\.environ\[\"LOCAL_RANK\"\]\)$"),
]
FLAG_CASES += [(["run", flag, "1", "train.py"],
                rf"phalanx run starts the workers of this host, .* takes no {flag}; for many hosts start the script with "
                r"torchrun itself \(torchrun --nnodes 2 .* script\.py\), where phalanx\.init\(\) joins torchrun's world")
               for flag in ("--nnodes", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf", "--role",
                            "--node-rank", "--master-addr", "--master-port", "--local-addr")]
FLAG_CASES += [(["run", flag, "0", "train.py"], rf"phalanx run takes no {flag}: every worker writes to this console")
               for flag in ("--duplicate-stdout-filters",
                            "--duplicate-stderr-filters", "--logs-specs", "--log-line-prefix-template")]
FLAG_CASES += [(["run", flag, "3", "train.py"], rf"^phalanx: error: phalanx run spells it {spelled} \S* ?\(torchrun takes "
                                                rf"{flag} too\)$")
               for flag, spelled in (("-r", "--redirects"), ("-t", "--tee"), ("--log_dir", "--log-dir"))]
# torchrun's worker logs, phalanx run's own since 2026-12-07 (runtime/worker_logs.py)
FLAG_CASES += [
    (["run", "--tee", "3", "train.py"], r"^phalanx: error: --tee 3 writes each worker's streams to files: add --log-dir "
                                        r"DIR$"),
    (["run", "--log-dir", "logs", "--tee", "5", "train.py"],
     r"^phalanx: error: --tee 5 is not 0 \(neither stream\), 1 \(stdout\), 2 \(stderr\) or 3 \(both\), for every "
     r"local rank or rank by rank \(0:3,1:2\); e\.g\. --tee 3$"),
    (["run", "--log-dir", "logs", "--redirects", "one:3", "train.py"],
     r"^phalanx: error: --redirects one:3: 'one:3' is not rank:streams; e\.g\. --redirects 0:3,1:2$"),
    (["run", "--log-dir", "train.py", "train.py"],
     r"^phalanx: error: --log-dir train\.py is a file, not a directory; give a directory \(made if missing\)$"),
]
FLAG_CASES += [(["run", "--print-completion", "bash", "train.py"],  # torch 2.14's, as --log-line-prefix-template
                r"^phalanx: error: phalanx run prints no shell completion script: --print-completion is torchrun's "
                r"\(phalanx --help lists the commands\)$")]
FLAG_CASES += [([*argv, "train.py"], rf"torchrun's {argv[1]} has no counterpart in phalanx run, .*drop it, or start the "
                                     "script with torchrun itself")
               for argv in (["run", "--monitor-interval", "1"], ["run", "--start-method", "fork"],
                            ["run", "--event-log-handler", "null"], ["run", "--signals-to-handle", "SIGTERM"],
                            ["run", "--shutdown-timeout", "5"], ["run", "--virtual-local-rank"])]
FLAG_CASES += [(["run", "--debug", "train.py"], r"accelerate launch's --debug has no counterpart in phalanx run")]
# The counts and the many hosts' flags given to phalanx train: --devices, or torchrun itself (before
# 2026-12-06 argparse's "unrecognized arguments").
FLAG_CASES += [(["train", spelling, *(["2"] if takes_value else [])],
                rf"^phalanx: error: ({re.escape(launcher)}'s {re.escape(spelling)} 2 is --devices in phalanx train: .*"
                r"e\.g\. phalanx train --devices 2$|phalanx train starts the workers of this host, so it takes no "
                rf"{re.escape(spelling)}; for many hosts start it with torchrun itself \(torchrun --nnodes 2 .* -m "
                r"phalanx train \.\.\.\): docs/many-hosts\.md$)")
               for launcher, spellings, takes_value, _ in launcher_flags("train") for spelling in spellings]
# accelerate launch's and fabric run's, each spelling (Accelerate takes --num_processes and --num-processes)
FLAG_CASES += [(["run", spelling, *values, "train.py"], pattern) for flags, values, pattern in (
    (("--num_processes", "--num-processes"), ["3"],
     r"^phalanx: error: accelerate launch's --num[_-]processes 3 is --devices in phalanx run: .*--devices 3 script"),
    (("--cpu",), [], r"phalanx run names CPU workers in --devices: --devices cpu:N \(N workers\); it takes no --cpu$"),
    (("--multi_gpu", "--multi-gpu"), [], r"phalanx run names its devices in --devices: --devices cuda:0,1 .*; it takes "
                                         r"no --multi[_-]gpu$"),
    (("--gpu_ids", "--gpu-ids"), ["0,1"], r"phalanx run names its devices in --devices: .*; it takes no --gpu[_-]ids$"),
    (("--num_cpu_threads_per_process", "--num-cpu-threads-per-process"), ["4"],
     r"phalanx run's threads per CPU worker are --threads-per-device N"),
    (("--enable_cpu_affinity", "--enable-cpu-affinity"), [], r"pins each worker to its own equal share of the cores "
                                                             r"with --bind-cores; it takes no --enable"),
    (("--num_machines", "--num-machines", "--machine_rank", "--machine-rank", "--main_process_ip", "--main-process-ip",
      "--main_process_port", "--main-process-port", "--num-nodes", "--num_nodes", "--main-address", "--main_address",
      "--main-port", "--main_port"), ["1"], r"phalanx run starts the workers of this host, .*for many hosts start the "
                                           r"script with torchrun itself"),
    (("--same_network", "--same-network"), [], r"takes no --same[_-]network; for many hosts"),
    (("--mixed_precision", "--mixed-precision", "--precision"), ["bf16"],
     r"takes no --(mixed[_-])?precision: mixed precision is set in the script, phalanx\.prepare\(model, world=world, "
     r"precision=\"bf16-mixed\"\)$"),
    (("--dynamo_backend", "--dynamo-backend"), ["inductor"], r"compilation is set in the script, torch\.compile\(model\) "
                                                             r"before phalanx\.prepare$"),
    (("--use_deepspeed", "--use-deepspeed", "--use_fsdp", "--use-fsdp"), [],
     r"sharding \(ZeRO stages 1-3, FSDP's kind\) is set in the script, phalanx\.prepare\(model, world=world, shard="),
    (("--zero_stage", "--zero-stage"), ["2"], r"takes no --zero[_-]stage: sharding .* is set in the script"),
    (("--gradient_accumulation_steps", "--gradient-accumulation-steps"), ["4"],
     r"accumulation is set in the script, for piece in dp\.accumulate\(n\)"),
    (("--gradient_clipping", "--gradient-clipping"), ["1.0"], r"clipping is set in the script, phalanx\.clip_grad_norm_"),
    (("--config_file", "--config-file"), ["cfg.yaml"], r"phalanx run reads no config file: its flags are --devices"),
    (("--accelerator",), ["cpu"], r"phalanx run names the kind of device in --devices: --devices cpu:N \(CPU workers\)"),
    (("--strategy",), ["ddp"], r"phalanx run is data parallel, DDP's strategy, always: drop --strategy"),
) for spelling in flags]
# horovodrun's and deepspeed's, each spelling
FLAG_CASES += [(["run", spelling, *values, "train.py"], pattern) for flags, values, pattern in (
    (("-np", "--num-proc"), ["4"], r"^phalanx: error: horovodrun's (-np|--num-proc) 4 is --devices in phalanx run: "
                                   r".*e\.g\. phalanx run --devices 4 script\.py$"),
    (("--num_gpus", "--num_accelerators"), ["2"], r"^phalanx: error: deepspeed's --num_(gpus|accelerators) 2 is "
                                                  r"--devices in phalanx run"),
    (("-H", "--hosts", "--hostfile", "--host-discovery-script", "-p", "--ssh-port", "--ssh-identity-file",
      "--network-interface", "--launcher", "--launcher_args", "--ssh_port", "--venv_script"), ["x"],
     r"phalanx run starts the workers of this host, .*for many hosts start the script with torchrun itself"),
    (("--no_ssh_check", "--force_multi", "--no_ssh"), [], r"takes no --(no_ssh_check|force_multi|no_ssh); for many "
                                                          r"hosts"),
    (("-q",), [], r"phalanx run spells it --quiet \(no first line on stderr\)$"),
    (("-i", "--include", "-e", "--exclude"), ["localhost:0,2"],
     r"phalanx run starts the workers of this host on the devices --devices names \(cuda:0,2: these GPUs\); it "
     r"takes no (-i|--include|-e|--exclude) \(many hosts: torchrun itself"),
    (("--min-np", "--max-np", "--slots-per-host", "--elastic-timeout", "--reset-limit", "--min_elastic_nodes",
      "--max_elastic_nodes"), ["2"], r"phalanx run takes no --[a-z_-]+: --max-restarts N starts its workers again "
                                     r"after a failure, .*phalanx\.resume"),
    (("--elastic_training",), [], r"phalanx run takes no --elastic_training: --max-restarts N"),
    (("--gloo", "--mpi", "--jsrun", "--tcp"), [], r"phalanx run's workers meet through its own store and exchange "
                                                  r"through shared memory \(CPU workers\) or NCCL \(GPUs\); it takes "
                                                  r"no --(gloo|mpi|jsrun|tcp)$"),
    (("--start-timeout", "--gloo-timeout-seconds"), ["30"], r"phalanx run bounds every wait with --timeout SECONDS"),
    (("--no-stall-check",), [], r"phalanx run names a rank that does not reach a collective within --timeout"),
    (("--stall-check-warning-time-seconds", "--stall-check-shutdown-time-seconds"), ["60"],
     r"phalanx run names a rank that does not reach a collective"),
    (("--output-filename", "--log-level", "--enable_each_rank_log", "--log_level"), ["logs"],
     r"takes no --[a-z_-]+: every worker writes to this console"),
    (("--fusion-threshold-mb",), ["64"], r"the gradient bucket's size is set in the script, phalanx\.prepare\(model, "
                                         r"world=world, bucket_cap_mb=25\)$"),
    (("--hierarchical-allreduce",), [], r"phalanx takes the hierarchical exchange itself where the ranks span hosts"),
    (("--timeline-filename",), ["t.json"], r"phalanx train --trace DIR writes each rank's timeline"),
    (("--binding-args", "--thread-affinity", "--bind_core_list"), ["0-3"],
     r"pins each worker to its own equal share of the cores with --bind-cores; it takes no --"),
    (("--bind_cores_to_rank",), [], r"with --bind-cores; it takes no --bind_cores_to_rank$"),
    (("--no_local_rank",), [], r"phalanx run hands a --local_rank argument only to a script whose parser defines it, said once"),
    (("--cycle-time-ms", "--cache-capacity", "--mpi-args", "--autotuning"), ["5"],
     r"^phalanx: error: (horovodrun|deepspeed)'s --[a-z_-]+ has no counterpart in phalanx run"),
    (("--autotune", "--verbose", "--check-build", "--disable-cache", "--save_pid"), [],
     r"^phalanx: error: (horovodrun|deepspeed)'s --[a-z_-]+ has no counterpart in phalanx run"),
) for spelling in flags]


FLAG_CASES += [(["bench", "step", flag, value], pattern) for flag, value, pattern in (
    ("--device", "tpu", r"--device 'tpu' is unknown; choose one of cpu, cuda"),
    ("--model", "vgg", r"--model 'vgg' is unknown; choose one of"),
    ("--batch-size", "0", r"--batch-size 0 must be at least 1"),
    ("--steps", "0", r"--steps 0 must be at least 1"),
    ("--warmup-epochs", "-1", r"--warmup-epochs -1 must be at least 0"),
    ("--epochs", "0", r"--epochs 0 must be at least 1"),
    ("--threads", "0", r"--threads 0 must be at least 1"),
    ("--rounds", "0", r"--rounds 0 must be at least 1"),
    ("--out", PROC, r"--out .* cannot be created"))]
# No GPU here (the fixture below): bench gpu's own checks come first, then its refusal in one line.
FLAG_CASES += [(["bench", "gpu", flag, value], pattern) for flag, value, pattern in (
    ("--model", "vgg", r"--model 'vgg' is unknown; choose one of"),
    ("--batch-size", "0", r"--batch-size 0 must be at least 1"),
    ("--images", "100", r"--batch-size 256 is larger than --images 100"),
    ("--warmup-epochs", "-1", r"--warmup-epochs -1 must be at least 0"),
    ("--epochs", "0", r"--epochs 0 must be at least 1"),
    ("--rounds", "0", r"--rounds 0 must be at least 1"),
    ("--variants", "fused,tf32", r"--variants fused,tf32: 'tf32' is unknown; choose one of fused, channels_last"),
    ("--variant-rounds", "-1", r"--variant-rounds -1 must be at least 0"),
    ("--budget-s", "0", r"--budget-s 0\.0 must be a positive number of seconds"),
    ("--out", PROC, r"bench gpu needs a CUDA GPU, and torch sees none; `phalanx bench step`"))]
FLAG_CASES += [(["bench", "memory", flag, value], pattern) for flag, value, pattern in (
    ("--models", "mlp,vgg", r"--models mlp,vgg: 'vgg' is unknown; choose one of lenet, mlp, mlp-wide, resnet"),
    ("--devices", "1", r"--devices 1 must be at least 2 \(sharding over one device divides nothing\)"),
    ("--batch-size", "1", r"--batch-size 1 is smaller than 2 devices"),
    ("--steps", "0", r"--steps 0 must be at least 1"),
    ("--warmup-steps", "-1", r"--warmup-steps -1 must be at least 0"),
    ("--rounds", "0", r"--rounds 0 must be at least 1"),
    ("--contenders", "ddp,zero3", r"--contenders ddp,zero3: 'zero3' is unknown; choose one of ddp, zero"),
    ("--out", PROC, r"--out .* cannot be created"))]


def _flags(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _flags(sub, (*path, name))
        elif action.option_strings and not isinstance(action, argparse._HelpAction):
            yield path, action.option_strings[0]
        elif not action.option_strings and action.nargs != argparse.REMAINDER:
            yield path, action.dest  # a positional (phalanx run's script)


def _covers(argv: list[str], path: tuple[str, ...], flag: str) -> bool:
    if tuple(argv[: len(path)]) != path:
        return False
    rest = argv[len(path):]
    if not flag.startswith("-"):  # a positional: some case gives it a bad value or leaves it out
        return True
    return any(arg == flag or arg.startswith(flag + "=") for arg in rest)


def test_every_flag_has_a_case():
    missing = [f"{' '.join(path)} {flag}" for path, flag in _flags(build_parser())
               if not any(_covers(argv, path, flag) for argv, _ in FLAG_CASES)]
    assert not missing, f"flags with no bad-input case in FLAG_CASES: {missing}"


@pytest.fixture(autouse=True)
def _gpu_less_and_offline(monkeypatch, tmp_path):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setenv("PHALANX_DATA_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("argv, pattern", FLAG_CASES, ids=[" ".join(argv) for argv, _ in FLAG_CASES])
def test_flag_refused_in_one_line(argv, pattern, tmp_path, monkeypatch, capsys):
    work = tmp_path / "cwd"
    work.mkdir()
    (work / "train.py").write_text("raise SystemExit('must not run')\n")
    monkeypatch.chdir(work)
    code = main(argv)
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert code == 2, captured
    assert len(lines) == 1 and lines[0].startswith("phalanx: error: "), captured.err
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in captured.err + captured.out
    assert sorted(p.name for p in work.iterdir()) == ["train.py"], "a refused run must write nothing"
    assert not (tmp_path / "cache").exists()


def test_a_config_file_names_every_flag_phalanx_run_has(capsys):
    # The line lists phalanx run's own flags; written by hand it missed --max-restarts once run took it.
    run = build_parser(["run"])._subparsers._group_actions[0].choices["run"]
    own = [action.option_strings[0] for action in run._actions
           if action.option_strings and action.help != argparse.SUPPRESS and action.option_strings[0] != "-h"]
    assert {"--devices", "--max-restarts", "-m"} <= set(own)
    assert main(["run", "--config_file", "cfg.yaml", "train.py"]) == 2
    line = capsys.readouterr().err.strip()
    assert f"its flags are {', '.join(own[:-1])} and {own[-1]}," in line, line
