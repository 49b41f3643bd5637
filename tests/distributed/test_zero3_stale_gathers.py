"""A stage-3 bucket gathered before an optimizer step or a load is not used after it.

Under `shard="parameters"` a bucket is whole from a layer's forward until every layer owning some
of it has run; a layer's forward also starts the all-gather of the bucket forward needs next (the
neighbouring index), on the communication thread. A layer that does not run in a forward (a head
used in training only, skipped by an evaluation) left its bucket whole and its prefetch in flight,
both holding this rank's range as it was, and the next forward used them as they were: after an
optimizer step in between, the layers computed with the weights before the step; after
`dp.load_state_dict`, with those before the load. On 2 gloo workers, float64, one bucket per tensor:

- an evaluation forward between finish_gradient_sync and the optimizer step: 3 steps ended up to
  4.4 off the unsharded run (every parameter); now they equal it exactly;
- load_state_dict after an evaluation forward: full_state_dict gave the values before the load
  (up to 0.88 off the loaded ones: aux, first.bias, last.weight); now the loaded ones.

An optimizer step, `dp.load_state_dict` or `phalanx.resume` inside `with dp.gathered_parameters():`
changes each rank's range while the block holds the parameters whole from before it: a step there
left the weights read 0.13 off the unsharded run's, a forward there 0.35, and a clamp kept by
writeback=True undid the step (0.20 off at the end); a load left the reads 0.64 off (a resume
loads the same way). Each is now refused in one line on every rank, and the ways named (step
before the block; `dp.module.load_state_dict` inside it under writeback=True) give the unsharded
run's values exactly.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx
from phalanx.errors import UsageError
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed
STEPS, ROWS = 3, 4
TINY_MB = 0.0001  # one bucket per tensor, so a layer's neighbour is another layer's bucket


class WithAuxHead(nn.Module):
    """`aux` runs in training only (Inception's auxiliary classifier), registered between the two."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.aux, self.last = nn.Linear(6, 6), nn.Linear(6, 1), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        out = self.last(h).sum(dim=1, keepdim=True)
        return out + self.aux(h) if self.training else out


def _options(shard: str) -> phalanx.DataParallelConfig:
    return phalanx.DataParallelConfig(shard=shard, overlap=True, allreduce="shm", bucket_cap_mb=TINY_MB,
                                      first_bucket_cap_mb=TINY_MB)


def _trained(world, shard: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    dp = phalanx.DataParallel(WithAuxHead().double(), world=world, options=_options(shard))
    optimizer = dp.optimizer(torch.optim.SGD, lr=0.5) if shard != "none" else torch.optim.SGD(dp.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(world.rank)
    for _ in range(STEPS):
        x = torch.randn(ROWS, 6, dtype=torch.float64, generator=g)
        dp.zero_grad()
        dp.train()
        phalanx.shard_loss(dp(x).pow(2).sum(), 2 * ROWS).backward()
        dp.finish_gradient_sync()
        dp.eval()
        with torch.no_grad():  # a look at the summed step before taking it (the head skipped)
            dp(x)
        optimizer.step()
    state = dp.full_state_dict()
    dp.close()
    return state


def _loaded(world) -> tuple[list[str], dict[str, float]]:
    torch.manual_seed(0)
    dp = phalanx.DataParallel(WithAuxHead().double(), world=world, options=_options("parameters"))
    dp.eval()
    with torch.no_grad():  # the head skipped: what it shares stays whole, its prefetch in flight
        dp(torch.randn(ROWS, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(world.rank)))
    wanted = {name: torch.full(tuple(p.shape), 0.5, dtype=torch.float64) for name, p in dp.module.named_parameters()}
    dp.load_state_dict(wanted)
    got = dp.full_state_dict()
    dp.close()
    return sorted(wanted), {name: (got[name] - value).abs().max().item() for name, value in wanted.items()}


def _refused(call) -> str:
    try:
        call()
    except UsageError as exc:  # bad input: exit 2, one line, under phalanx run and phalanx.launch
        return str(exc)
    return "not refused"


def _in_the_block(world, shard: str, path: str) -> dict:
    """Each step: under stage 3 the refused habits inside the block, then the ways they name (every
    stage); what the block read."""
    torch.manual_seed(0)
    dp = phalanx.DataParallel(WithAuxHead().double(), world=world, options=_options(shard))
    optimizer = dp.optimizer(torch.optim.SGD, lr=0.5) if shard != "none" else torch.optim.SGD(dp.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(world.rank)
    refusals, read, outputs = [], [], []
    for _ in range(STEPS):
        x = torch.randn(ROWS, 6, dtype=torch.float64, generator=g)
        dp.zero_grad()
        phalanx.shard_loss(dp(x).pow(2).sum(), 2 * ROWS).backward()
        dp.finish_gradient_sync()
        if shard == "parameters":  # (any other stage takes a step there: the block is a no-op)
            with dp.gathered_parameters(writeback=True):
                refusals.append(_refused(optimizer.step))
        optimizer.step()  # the way named: before the block
        with dp.gathered_parameters(writeback=True):
            read.append({name: p.detach().clone() for name, p in dp.module.named_parameters()})
            with torch.no_grad():
                outputs.append(dp(x))
            for p in dp.module.parameters():
                p.data.clamp_(-0.3, 0.3)  # WGAN's clipping, kept
    loaded = {name: torch.full(tuple(p.shape), 0.25, dtype=torch.float64) for name, p in dp.module.named_parameters()}
    if shard == "parameters":
        with dp.gathered_parameters(writeback=True):
            refusals.append(_refused(lambda: dp.load_state_dict(loaded)))
        phalanx.checkpoint(path, world=world, model=dp, optimizer=optimizer, epoch=1, global_batch_size=2 * ROWS,
                           seed=0)
        with dp.gathered_parameters(writeback=True):
            refusals.append(_refused(lambda: phalanx.resume(path, world=world, model=dp, optimizer=optimizer,
                                                            global_batch_size=2 * ROWS, seed=0)))
    with dp.gathered_parameters(writeback=True):
        dp.module.load_state_dict(loaded)  # the way named inside the block
    final = dp.full_state_dict()
    dp.close()
    return {"refusals": refusals, "read": read, "outputs": outputs, "final": final,
            "loaded_off": max((final[name] - value).abs().max().item() for name, value in loaded.items())}


def _worker(world, path: str) -> dict:
    none, sharded = _trained(world, "none"), _trained(world, "parameters")
    plain, third = _in_the_block(world, "none", path), _in_the_block(world, "parameters", path)
    return {"trained": {name: (none[name] - sharded[name]).abs().max().item() for name in none},
            "loaded": _loaded(world),
            "in_block": {"refusals": third["refusals"],
                         "read_off": max((a[k] - b[k]).abs().max().item()
                                         for a, b in zip(plain["read"], third["read"]) for k in a),
                         "output_off": max((a - b).abs().max().item()
                                           for a, b in zip(plain["outputs"], third["outputs"])),
                         "loaded_off": third["loaded_off"]}}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_workers(_worker, 2, str(tmp_path_factory.mktemp("zero3") / "ck"), timeout_s=240)


def test_a_forward_skipping_a_layer_then_a_step_trains_as_unsharded(results):
    for rank in results:
        assert rank["trained"] == {name: 0.0 for name in rank["trained"]}


def test_load_state_dict_after_a_forward_skipping_a_layer_keeps_the_loaded_values(results):
    for rank in results:
        names, off = rank["loaded"]
        assert "aux.weight" in names
        assert off == {name: 0.0 for name in names}


def test_a_step_or_a_load_inside_gathered_parameters_is_refused_and_the_ways_named_are_exact(results):
    for rank in results:
        block = rank["in_block"]
        *steps, load, resume = block["refusals"]
        assert len(steps) == STEPS and all(message.startswith("optimizer.step() inside dp.gathered_parameters(): it "
                                                              "changes each rank's range") for message in steps)
        assert "step before the block" in steps[0] and "\n" not in steps[0]
        assert load.startswith("dp.load_state_dict(...) inside dp.gathered_parameters(): ")
        assert "dp.module.load_state_dict(...) under writeback=True" in load
        assert resume.startswith("phalanx.resume(...) inside dp.gathered_parameters(): ") and "resume before" in resume
        assert (block["read_off"], block["output_off"], block["loaded_off"]) == (0.0, 0.0, 0.0)
