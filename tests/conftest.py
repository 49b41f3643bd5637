"""Shared fixtures: where the real Fashion-MNIST sample lives (beside the repo, never inside it)."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SAMPLE_DIR = REPO.parent / "shared" / "data" / "fashion-mnist-sample"


@pytest.fixture(scope="session")
def sample_dir() -> Path:
    """The 3,000/1,000-image real sample; CI always has it, so there its absence is a failure."""
    if not (SAMPLE_DIR / "train-images-idx3-ubyte.gz").exists():
        if os.environ.get("CI"):
            pytest.fail(f"Fashion-MNIST sample missing at {SAMPLE_DIR}")
        pytest.skip(f"Fashion-MNIST sample not found at {SAMPLE_DIR}")
    return SAMPLE_DIR
