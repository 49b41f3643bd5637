"""A checkpoint's RNG states hold a GPU rank's own generator, the one its dropout masks come from.

No GPU here: torch.cuda's four calls are stood in for, which is what rng_state reads and writes;
tests/gpu/test_rng_state_gpu.py draws real masks on a GPU.
"""

from __future__ import annotations

import torch

from phalanx.train.rng_state import rng_state, set_rng_state

FIRST, LATER = torch.tensor([1, 2, 3], dtype=torch.uint8), torch.tensor([9], dtype=torch.uint8)


def _stand_in_gpu(monkeypatch, held: dict) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": held["state"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": held.update(state=state.clone()))


def test_a_gpu_ranks_generator_is_saved_and_put_back(monkeypatch):
    held = {"state": FIRST}
    _stand_in_gpu(monkeypatch, held)
    saved = rng_state()
    held["state"] = LATER  # the run draws on after the checkpoint
    set_rng_state(saved)
    assert torch.equal(held["state"], FIRST)


def test_a_checkpoint_without_a_gpu_state_leaves_the_gpu_generator_alone(monkeypatch):
    cpu_only = rng_state()  # no CUDA in use here: nothing of a GPU's is saved
    assert "cuda" not in cpu_only
    held = {"state": LATER}
    _stand_in_gpu(monkeypatch, held)
    set_rng_state(cpu_only)  # a CPU run's (or an older) checkpoint resumed on a GPU
    assert torch.equal(held["state"], LATER)
