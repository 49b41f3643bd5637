"""Whether `loss_fn` is a mean over the examples, as verify's scaling assumes: direct evidence.

With `loss_reduction="mean"` each rank's loss is taken back to a sum as `loss x its examples`,
which is the sum only when loss_fn averages over examples. A token mean with `ignore_index`
(nanoGPT's `cross_entropy(..., ignore_index=-1)`) averages over each shard's own non-ignored
tokens: `mean x examples` is then not the shard's sum, the ranks' gradients do not add up to the
1-device one, and no probe (BatchNorm, dropout, uneven shards) makes them agree. The test here
is the initial model in eval mode (each example's output its own) on the first global batch:
the gradient of loss_fn on the whole batch against the k shards' gradients weighted by their
examples. For a mean over examples the two agree to rounding; for a token mean they differ
beyond the run's tolerance (a tiny GPT with 30% of targets ignored, 2 shards: 1.6e-3 relative,
where the loss values differ by only 1.8e-5, too little to tell from rounding in float32).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from phalanx.data import shard_bounds
from phalanx.verify.batches import BatchSource
from phalanx.verify.config import VerifyConfig
from phalanx.verify.run import build_model

def example_mean_gap(model_fn: Callable[[], nn.Module], loss_fn: Callable, data: Any, config: VerifyConfig, *,
                     world_size: int, device: torch.device) -> float | None:
    """Relative gap (max |a - b| / max |b|) between the gradient of loss_fn on the first global
    batch and its k shards' gradients weighted by their examples, where it exceeds the run's
    tolerance; None where it does not or the check does not apply (a summed loss, a scale rule
    other than `global`, a loss that fails on a shard alone)."""
    if config.loss_reduction != "mean" or config.loss_scale != "global":
        return None
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        model = build_model(model_fn, config).to(device).eval()
        params = [p for p in model.parameters() if p.requires_grad]
        X, y = BatchSource(data, config, device=device).batch(0)
        n = X.shape[0]

        def gradient(inputs, targets) -> torch.Tensor:
            grads = torch.autograd.grad(loss_fn(model(inputs), targets), params, allow_unused=True)
            return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)])
        try:
            whole = gradient(X, y)
            weighted = sum((stop - start) / n * gradient(X[start:stop], y[start:stop])
                           for start, stop in (shard_bounds(n, world_size, r) for r in range(world_size))
                           if stop > start)
        except Exception:  # noqa: BLE001 - a loss that cannot take a shard alone: no evidence either way
            return None
    gap = float((weighted - whole).abs().max() / whole.abs().max().clamp_min(1e-30))
    return gap if gap > config.rtol else None
