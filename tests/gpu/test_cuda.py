"""CUDA/NCCL paths; skipped where no GPU is present (CI has none, the device machine has one)."""

import pytest
import torch

from phalanx.cli import main

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_one_gpu_trains_on_the_sample(tmp_path, idx_dir, capsys):
    code = main(["train", "--devices", "cuda:0", "--data-dir", str(idx_dir), "--epochs", "2",
                 "--no-progress", "--out", str(tmp_path / "gpu")])
    out = capsys.readouterr().out
    assert code == 0
    assert out.strip().splitlines()[-1].endswith("sec/epoch on [cuda:0]")
    state = torch.load(tmp_path / "gpu" / "model.pt", weights_only=True)
    assert state["fc2.weight"].device.type == "cpu"  # saved portable


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_nccl(tmp_path, idx_dir, capsys):
    for algorithm in ("native", "ring"):
        code = main(["train", "--devices", "2", "--data-dir", str(idx_dir), "--epochs", "1",
                     "--allreduce", algorithm, "--no-progress"])
        assert code == 0
        assert capsys.readouterr().out.strip().endswith("on [cuda:0, cuda:1]")


def test_more_gpus_than_present_is_refused(capsys):
    count = torch.cuda.device_count()
    assert main(["train", "--devices", f"cuda:{count}"]) == 2
    assert f"{count} GPUs are present" in capsys.readouterr().err
