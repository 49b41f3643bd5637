"""Draw random combinations of the library API's options and a user loop's habits, and check each
against a plain one-process PyTorch loop: k workers of `phalanx.prepare` must end where torch alone
ends, not merely where phalanx on one worker ends.

    .venv/bin/python tools/api_fuzz.py --runs 40 --seed 1

Each draw builds a small float64 model (a plain MLP, one with BatchNorm, a layer used twice, a
frozen layer, a parameter no forward uses, an embedding of token ids), picks `prepare`'s options
(`shard=`, `algorithm=`, `overlap=`, `bucket_cap_mb=`), the optimizer (SGD with or without
momentum and weight decay, Adam, AdamW) and the loop's habits (micro-batches through
`dp.accumulate`, cut from each rank's shard or handed out by `ShardedLoader(micro_batches=n)`,
clipping by the global norm, `dp.zero_grad()` or the optimizer's), trains two epochs of an
uneven global batch from `phalanx.ShardedLoader` (a map-style dataset or a stream, with or
without loader workers) on k in {2, 3} workers (`phalanx.launch`), and
trains the same global batches in one process with torch alone (loss sum / global batch size,
torch's own clipping). Every tensor of rank 0's final state must be within
1e-9 of torch's, relative to the model's largest value; a failure prints the draw. A third of
the draws stop at a drawn step, save with `phalanx.checkpoint`, and continue in a new launch on 1,
2 or 3 workers from `phalanx.resume` (shards resharded across the worker counts). BatchNorm with
micro-batches takes them from the loader (a rank's own shard cut into pieces does not normalize one
device's micro-batch: docs/api.md), every micro-batch of 2 or more examples. Exit 1 when any draw
failed.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from state_diff import worst_difference  # tools/, beside this script

FEATURES, CLASSES, VOCAB = 6, 4, 20


class Net(nn.Module):
    """The drawn architecture: `kind` picks one trait beside the plain MLP."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        width = 16
        self.embed = nn.Embedding(VOCAB, FEATURES) if kind == "embedding" else None
        self.first = nn.Linear(FEATURES, width, bias=kind != "batchnorm")
        self.norm = nn.BatchNorm1d(width) if kind == "batchnorm" else None
        self.middle = nn.Linear(width, width)
        self.unused = nn.Linear(width, width) if kind == "unused" else None
        self.head = nn.Linear(width, CLASSES)
        if kind == "frozen":
            self.first.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x).mean(dim=1)
        h = self.first(x)
        h = torch.relu(self.norm(h) if self.norm is not None else h)
        h = F.gelu(self.middle(h))
        if self.kind == "tied":  # the same layer twice: its gradient is the sum of both uses
            h = F.gelu(self.middle(h))
        return self.head(h)


def _data(draw: dict) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(draw["seed"])
    n = draw["examples"]
    x = (torch.randint(0, VOCAB, (n, 5), generator=g) if draw["model"] == "embedding"
         else torch.randn(n, FEATURES, generator=g, dtype=torch.float64))
    return torch.utils.data.TensorDataset(x, torch.randint(0, CLASSES, (n,), generator=g))


class _Stream(torch.utils.data.IterableDataset):
    """The draw's examples as a stream in index order; loader workers each yield every n-th item,
    which DataLoader's round robin puts back in order."""

    def __init__(self, data: torch.utils.data.TensorDataset) -> None:
        self.data = data

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return (self.data[i] for i in range(start, len(self.data), step))


def _optimizer(draw: dict, params):
    name, settings = draw["optimizer"]
    return getattr(torch.optim, name)(params, **settings)


def _model(draw: dict) -> Net:
    torch.manual_seed(draw["seed"])
    return Net(draw["model"]).double()


def _worker(draw: dict, location: str | None = None, stop_at: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """Train the draw; with `location`, resume from its checkpoint first, and with `stop_at` (epoch,
    step) save there and leave, returning nothing."""
    world = phalanx.init()
    data = _data(draw) if draw["data"] == "map" else _Stream(_data(draw))
    dp = phalanx.prepare(_model(draw), world=world, shard=draw["shard"], algorithm=draw["algorithm"],
                         overlap=draw["overlap"], bucket_cap_mb=draw["bucket_cap_mb"])
    settings = draw["optimizer"][1]
    optimizer = (dp.optimizer(getattr(torch.optim, draw["optimizer"][0]), **settings) if draw["shard"] != "none"
                 else _optimizer(draw, dp.parameters()))
    loader = phalanx.ShardedLoader(data, world=world, global_batch_size=draw["batch"], seed=draw["seed"],
                                   micro_batches=draw["accum"] if draw["pieces"] == "loader" else None,
                                   num_workers=draw["workers"])
    kept = dict(world=world, model=dp, optimizer=optimizer, global_batch_size=draw["batch"], seed=draw["seed"],
                loader=loader)
    start = phalanx.resume(location, **kept) if location is not None else None
    for epoch in range(start.epoch if start else 0, 2):
        for step, (batch, global_size) in enumerate(loader.epoch(epoch)):
            if start is not None and epoch == start.epoch and step < start.step:
                continue  # trained before the checkpoint
            if (epoch, step) == stop_at:
                phalanx.checkpoint(location, epoch=epoch, step=step, **kept)
                dp.close()
                return {}
            dp.zero_grad() if draw["zero_grad"] == "dp" else optimizer.zero_grad()
            pieces = batch if draw["pieces"] == "loader" else phalanx.split_batch(*batch, draw["accum"])
            for x, y in dp.accumulate(pieces):
                phalanx.shard_loss(F.cross_entropy(dp(x), y, reduction="sum"), global_size).backward()
            dp.finish_gradient_sync()
            if draw["clip"] is not None:
                phalanx.clip_grad_norm_(dp, draw["clip"])
            optimizer.step()
    state = dp.full_state_dict() if draw["shard"] == "parameters" else dp.module.state_dict()
    state = {name: value.detach().clone() for name, value in state.items()}
    dp.close()
    return state if world.is_main else {}


def _torch_alone(draw: dict) -> dict[str, torch.Tensor]:
    data = _data(draw)
    model = _model(draw)
    optimizer = _optimizer(draw, [p for p in model.parameters() if p.requires_grad])
    for epoch in range(2):
        order = (phalanx.global_batches(len(data), draw["batch"], seed=draw["seed"], epoch=epoch)
                 if draw["data"] == "map" else torch.arange(len(data)).split(draw["batch"]))
        for batch in order:
            xb, yb = data[batch]
            optimizer.zero_grad()
            for x, y in zip(torch.tensor_split(xb, draw["accum"]), torch.tensor_split(yb, draw["accum"])):
                if len(y):
                    (F.cross_entropy(model(x), y, reduction="sum") / len(batch)).backward()
            if draw["clip"] is not None:
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], draw["clip"])
            optimizer.step()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _draw(rng: random.Random, seed: int) -> dict:
    model = rng.choice(["mlp", "batchnorm", "tied", "frozen", "unused", "embedding"])
    optimizer = rng.choice([("SGD", {"lr": 0.1}), ("SGD", {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}),
                            ("Adam", {"lr": 3e-3}), ("AdamW", {"lr": 3e-3, "weight_decay": 1e-2})])
    examples, batch = rng.choice([40, 61]), rng.choice([7, 13, 29])
    if model == "batchnorm" and examples % batch == 1:  # torch cannot normalize a last batch of one
        examples += 1
    accum, pieces = rng.choice([1, 1, 2, 3]), rng.choice(["own", "loader"])
    if model == "batchnorm" and accum > 1:  # one device's micro-batches, from the loader, 2 examples or more each
        pieces = "loader"
        if min(batch, examples % batch or batch) // accum < 2:
            accum = 1
    return {"seed": seed, "model": model, "optimizer": optimizer, "k": rng.choice([2, 3]),
            "examples": examples, "batch": batch,
            "shard": rng.choice(["none", "none", "optimizer", "gradients", "parameters"]),
            "algorithm": rng.choice(["auto", "auto", "ring", "native"]), "overlap": rng.choice([None, True, False]),
            "bucket_cap_mb": rng.choice(["auto", 0.0005, None]),
            "accum": accum, "pieces": pieces,
            "clip": rng.choice([None, None, 0.3]), "zero_grad": rng.choice(["dp", "optimizer"]),
            # a third stop after a step of epoch 0 or 1, save with phalanx.checkpoint and resume on 1-3 workers
            "stop_at": (rng.choice([0, 1]), rng.randrange(0, -(-examples // batch))) if rng.random() < 1 / 3 else None,
            "resume_k": rng.choice([1, 2, 3]), "data": rng.choice(["map", "map", "stream"]),
            "workers": rng.choice([0, 0, 2])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=1e-9)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    failed = 0
    for n in range(args.runs):
        draw = _draw(rng, seed=1000 * args.seed + n)
        try:
            if draw["stop_at"] is None:
                state = phalanx.launch(_worker, draw, devices=f"cpu:{draw['k']}")[0]
            else:  # stopped and saved on k workers, resumed on others
                with tempfile.TemporaryDirectory() as location:
                    phalanx.launch(_worker, draw, location, draw["stop_at"], devices=f"cpu:{draw['k']}")
                    state = phalanx.launch(_worker, draw, location, devices=f"cpu:{draw['resume_k']}")[0]
            worst, name = worst_difference(state, _torch_alone(draw))
            verdict = "pass" if worst <= args.tolerance else "FAIL"
        except Exception as exc:  # a refusal or a crash: both are findings to read
            worst, name, verdict = float("nan"), f"{type(exc).__name__}: {str(exc)[:300]}", "ERROR"
        failed += verdict != "pass"
        print(f"{n:3d} {verdict:5s} {worst:9.2e} {name}  {draw}", flush=True)
    print(f"{failed} of {args.runs} draws failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
