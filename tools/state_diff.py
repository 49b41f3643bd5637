"""How far one saved model is from another, the way the fuzzers judge k devices against 1.

`worst_difference(state, reference)`: the largest max|a - b| of any tensor, relative to that
tensor's largest |b| floored at 0.1 of the reference's largest value (a tensor whose true value
is ~0, a bias before BatchNorm, cannot fail on rounding alone), and the tensor's name; integer
tensors (BatchNorm's batch count) must be equal, and so must the keys (inf otherwise).
"""

from __future__ import annotations

import torch


def worst_difference(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[float, str]:
    if set(state) != set(reference):
        return float("inf"), f"keys differ: {sorted(set(state) ^ set(reference))}"
    scale = max(v.abs().max().item() for v in reference.values() if v.is_floating_point() and v.numel())
    worst, name = 0.0, ""
    for key, ref in reference.items():
        got = state[key].to(ref.device)
        if not ref.is_floating_point():
            if not torch.equal(got, ref):
                return float("inf"), f"{key} (integer): {got.tolist()} against {ref.tolist()}"
            continue
        diff = (got - ref).abs().max().item() / max(ref.abs().max().item(), 0.1 * scale, 1e-300)
        if diff > worst:
            worst, name = diff, key
    return worst, name
