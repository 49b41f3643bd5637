"""On a GPU, a checkpoint's RNG states put back the device's generator: the dropout masks drawn
after them are the ones drawn before. Skipped where no GPU is present (tests/unit/test_rng_state.py
checks the calls on the CPU)."""

import pytest
import torch
import torch.nn.functional as F

from phalanx.train.rng_state import rng_state, set_rng_state

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_dropout_masks_after_a_restore_are_the_ones_after_the_save():
    x = torch.ones(4096, device="cuda")
    F.dropout(x, 0.5)  # CUDA in use, as in a training run
    saved = rng_state()
    first = F.dropout(x, 0.5)
    F.dropout(x, 0.5)
    set_rng_state(saved)
    assert torch.equal(F.dropout(x, 0.5), first)
