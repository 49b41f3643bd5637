"""examples/ at tiny sizes, each on 1 and 2 workers through `phalanx run`, checked against what
the maths says: LeNet, the char transformer without dropout and with its dropout drawn through
`phalanx.BatchRandom` (`--exact-dropout`), the lazy-file MLP, and Horovod's and
DeepSpeed's examples as ported (each ZeRO stage) end with the 1-device parameters (float64, 1e-9
relative); with dropout the two replicas stay identical; the
lazy Dataset opens each file once per pass, split between the ranks; the notebook runs as a kernel would
run it, its function on 2 forked workers."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RTOL = 1e-9


def run_example(name: str, devices: str, *args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "phalanx", "run", "--devices", devices, "--timeout", "60",
                           str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def max_rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() / max(b[k].abs().max().item(), 1e-30) for k in b)


def test_lenet_on_two_workers_equals_one(idx_dir, tmp_path):
    args = ["--data-dir", str(idx_dir), "--epochs", "1", "--dtype", "float64"]
    one = run_example("lenet_fashion_mnist.py", "cpu:1", *args, "--out", str(tmp_path / "k1.pt"))
    two = run_example("lenet_fashion_mnist.py", "cpu:2", *args, "--out", str(tmp_path / "k2.pt"))
    assert one.splitlines()[-1].startswith("epoch 1  train loss") and one.splitlines()[-1] == two.splitlines()[-1]
    k1, k2 = (torch.load(tmp_path / f"k{k}.pt", weights_only=True) for k in (1, 2))
    assert max_rel(k2, k1) < RTOL


TINY_LM = ["--max-chars", "4000", "--block", "16", "--d-model", "32", "--heads", "2", "--layers", "1",
           "--batch-size", "16", "--epochs", "1", "--warmup-steps", "5", "--dtype", "float64"]


def test_char_transformer_without_dropout_equals_one_device(tmp_path):
    outs = {}
    for devices in ("cpu:1", "cpu:2"):
        stdout = run_example("char_transformer.py", devices, *TINY_LM, "--dropout", "0", "--out", str(tmp_path / devices))
        loss = float(stdout.split("validation loss ")[1].split()[0])
        outs[devices] = torch.load(tmp_path / devices / "rank0.pt", weights_only=True)
        assert loss < math.log(80)  # below a uniform guess over any plausible character set
    assert max_rel(outs["cpu:2"], outs["cpu:1"]) < RTOL


def test_char_transformer_with_exact_dropout_equals_one_device(tmp_path):
    outs = {}
    for devices in ("cpu:1", "cpu:2"):
        run_example("char_transformer.py", devices, *TINY_LM, "--dropout", "0.2", "--exact-dropout",
                    "--out", str(tmp_path / devices))
        outs[devices] = torch.load(tmp_path / devices / "rank0.pt", weights_only=True)
    assert max_rel(outs["cpu:2"], outs["cpu:1"]) < RTOL


def test_char_transformer_with_dropout_keeps_replicas_identical(tmp_path):
    run_example("char_transformer.py", "cpu:2", *TINY_LM, "--dropout", "0.2", "--out", str(tmp_path))
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert max_rel(rank1, rank0) == 0.0  # same summed gradient, same update, bitwise


def test_horovod_s_mnist_example_ported_equals_one_device(idx_dir, tmp_path):
    """Horovod's pytorch_mnist.py as ported: without dropout, 2 workers end with the 1-device
    weights; with its fp16 compression of the exchange the replicas stay bitwise identical."""
    args = ["--data-dir", str(idx_dir), "--epochs", "1", "--dtype", "float64", "--batch-size", "64"]
    one = run_example("horovod_mnist.py", "cpu:1", *args, "--dropout", "0", "--out", str(tmp_path / "k1.pt"))
    two = run_example("horovod_mnist.py", "cpu:2", *args, "--dropout", "0", "--out", str(tmp_path / "k2.pt"))
    assert one.splitlines()[-1].startswith("epoch 1  test loss") and one.splitlines()[-1] == two.splitlines()[-1]
    k1, k2 = (torch.load(tmp_path / f"k{k}.pt", weights_only=True) for k in (1, 2))
    assert max_rel(k2, k1) < RTOL
    fp16 = run_example("horovod_mnist.py", "cpu:2", *args, "--fp16-allreduce", "--out", str(tmp_path / "fp16.pt"))
    assert "sent as fp16" in fp16 and float(fp16.split("accuracy ")[-1].rstrip("%\n")) > 10  # dropout and fp16


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_deepspeed_s_cifar_example_ported_equals_one_device_at_each_zero_stage(idx_dir, tmp_path, stage):
    """DeepSpeed's CIFAR tutorial as ported, its config's Adam, warm-up, clipping and 2-step
    accumulation: each ZeRO stage on 2 workers ends with the 1-device weights."""
    args = ["--data-dir", str(idx_dir), "--epochs", "1", "--dtype", "float64", "--gradient-accumulation-steps", "2",
            "--warmup-num-steps", "20"]
    one = run_example("deepspeed_cifar.py", "cpu:1", *args, "--out", str(tmp_path / "k1.pt"))
    two = run_example("deepspeed_cifar.py", "cpu:2", *args, "--zero-stage", str(stage), "--out", str(tmp_path / "k2.pt"))
    assert f"ZeRO-{stage}" in two if stage else "sharded" not in two
    k1, k2 = (torch.load(tmp_path / f"k{k}.pt", weights_only=True) for k in (1, 2))
    assert max_rel(k2, k1) < RTOL
    assert one.splitlines()[-1].startswith("epoch 1  test loss")


def test_lazy_files_each_rank_reads_only_its_shards(tmp_path):
    n, epochs = 101, 2
    args = ["--make-data", str(tmp_path / "points"), "--examples", str(n), "--epochs", str(epochs),
            "--batch-size", "16"]
    one = run_example("lazy_files.py", "cpu:1", *args, "--out", str(tmp_path / "k1"))
    two = run_example("lazy_files.py", "cpu:2", *args, "--out", str(tmp_path / "k2"))
    reads = [int(m) for m in re.findall(r"rank \d: \d+ files listed, (\d+) reads", two)]
    # Do the ranks hold one dataset? Each rank reads the first global batch's first 8 files once (ShardedLoader),
    # and the set's first 8 once (evaluate_dataset).
    probes = 2 * (8 + 8)
    assert len(reads) == 2 and sum(reads) == (epochs + 1) * n + probes and max(reads) < (epochs + 1) * n
    assert f"rank 0: {n} files listed, {(epochs + 1) * n} reads" in one
    k1 = torch.load(tmp_path / "k1" / "rank0.pt", weights_only=True)
    for rank in (0, 1):
        assert max_rel(torch.load(tmp_path / "k2" / f"rank{rank}.pt", weights_only=True), k1) < RTOL


def test_the_notebook_runs_its_cells_in_one_interactive_session():
    """examples/notebook.ipynb's code cells in order in one interpreter reading stdin (as a kernel
    runs them: no `__file__`), so its model class and function reach the workers by fork alone."""
    import json

    cells = json.loads((EXAMPLES / "notebook.ipynb").read_text())["cells"]
    assert all(cell.get("outputs", []) == [] for cell in cells)  # kept without outputs
    code = "\n\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "code")
    proc = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(EXAMPLES.parent)}, cwd=EXAMPLES.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "the replicas ended identical: True" in lines, proc.stdout
    assert lines[-1].startswith("trained in the workers, evaluated here: test acc "), proc.stdout
    assert float(lines[-1].split()[-1]) > 0.8
