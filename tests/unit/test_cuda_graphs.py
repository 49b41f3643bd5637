"""The CUDA graph step without a GPU: the plan (every refusal named, `on` refused in one line,
the first log line's words) and CapturedStep's bookkeeping on a small model with a stand-in
graph (tests/unit/graph_stand_in.py): warm-up, capture, the first-replay check, the fallbacks,
static inputs and outputs. tests/distributed/test_cuda_graph_stand_in.py runs whole epochs;
tests/gpu/test_cuda_graphs.py runs the real thing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from phalanx.data_parallel import DataParallel, DataParallelConfig
from phalanx.job.config import TrainConfig
from phalanx.runtime.world import World
from phalanx.train.graph_plan import StepFacts, plan, refusal
from phalanx.train.graphs import CapturedStep
from tests.unit.graph_stand_in import RecordedGraph

WORLD1 = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend="none",
               timeout_s=10.0)
CUDA1 = StepFacts(device_type="cuda", num_devices=1)

REFUSALS = [
    (dict(split="layers"), "--split layers runs its own schedule"),
    (dict(grad_accum_steps=4), "--grad-accum 4 runs micro-batches under no_sync"),
    (dict(tracing=True), "--trace times each step's spans on the host"),
    (dict(num_devices=2, sync_batchnorm=True), "SyncBatchNorm reads each layer's example count on the host"),
    (dict(num_devices=2, allreduce="ring"), "--allreduce ring runs on a Python thread"),
    (dict(num_devices=2, allreduce="naive"), "--allreduce naive runs on a Python thread"),
    (dict(num_devices=2, backend="gloo"), "gloo (ranks sharing one GPU) cannot be captured; NCCL can"),
    (dict(lr_changes_every_step=True), "lr warmup changes the lr every step"),
    (dict(num_devices=2), "2 GPUs: a replayed graph would hide its NCCL allreduces"),
    (dict(exchanging=True), "this one-device replica exchanges its gradients"),
]


@pytest.mark.parametrize("changes, words", REFUSALS, ids=[w.split(" ")[0] + str(i) for i, (_, w) in enumerate(REFUSALS)])
def test_each_refusal_is_named_in_the_first_line_and_by_on(changes, words):
    facts = StepFacts(**{**CUDA1.__dict__, **changes})
    assert words in refusal(facts)
    auto = plan("auto", facts)
    assert not auto.capture and words in auto.describe() and auto.describe().startswith(", eager step (")
    with pytest.raises(ValueError, match="--cuda-graphs on: .*; use --cuda-graphs auto to run such a step eagerly"):
        plan("on", facts)


def test_the_plan_captures_one_cuda_device_and_says_so():
    assert refusal(CUDA1) is None
    for mode in ("auto", "on"):
        chosen = plan(mode, CUDA1)
        assert chosen.capture and chosen.describe() == (
            ", step captured as one CUDA graph (each full batch; the smaller last batch eager)")
    off = plan("off", CUDA1)
    assert not off.capture and off.describe() == ", eager step (--cuda-graphs off)"
    assert plan("auto", StepFacts(device_type="cpu", num_devices=2)).describe() == ""  # a CPU run: nothing to say
    with pytest.raises(ValueError, match="--cuda-graphs on: CUDA graphs need CUDA devices; this run is on cpu"):
        plan("on", StepFacts(device_type="cpu", num_devices=1))
    with pytest.raises(ValueError, match="--cuda-graphs 'always' is unknown; choose one of auto, on, off"):
        plan("always", CUDA1)


def test_train_config_states_its_facts():
    assert TrainConfig().graph_plan("cuda", 1).capture
    assert "--grad-accum 2" in TrainConfig(data_parallel=dataclasses.replace(
        TrainConfig().data_parallel, grad_accum_steps=2)).graph_plan("cuda", 1).reason
    assert "SyncBatchNorm" in TrainConfig(model="lenet-bn").graph_plan("cuda", 2).reason
    assert "2 GPUs" in TrainConfig(model="lenet").graph_plan("cuda", 2).reason
    assert "lr warmup" in TrainConfig(optim=dataclasses.replace(
        TrainConfig().optim, warmup_epochs=1.0)).graph_plan("cuda", 1).reason
    assert not TrainConfig(cuda_graphs="off").graph_plan("cuda", 1).capture


class _Step:
    """A one-device replica's whole step on static inputs (x, y), as CapturedStep wants it."""

    def __init__(self, *, momentum: float = 0.9, lr: float = 0.1) -> None:
        torch.manual_seed(0)
        self.dp = DataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double(), world=WORLD1)
        self.optimizer = torch.optim.SGD(self.dp.parameters(), lr=lr, momentum=momentum)
        self.x, self.y = torch.zeros(5, 4, dtype=torch.float64), torch.zeros(5, dtype=torch.long)
        self.calls = 0

    def __call__(self):
        self.calls += 1
        self.dp.zero_grad()
        logits = self.dp(self.x)
        loss_sum = F.cross_entropy(logits, self.y, reduction="sum")
        (loss_sum / 5).backward()
        self.dp.finish_gradient_sync()
        self.optimizer.step()
        return loss_sum.detach(), (logits.argmax(1) == self.y).sum()

    def captured(self, backend, **kwargs) -> CapturedStep:
        return CapturedStep(self, inputs=(self.x, self.y), module=self.dp.module, optimizer=self.optimizer,
                            backend=backend, capturing=self.dp.capturing, after_replay=self.dp.finish_gradient_sync,
                            **kwargs)


def _batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (5,), generator=g))
            for _ in range(n)]


def _params(step: _Step) -> list[torch.Tensor]:
    return [p.detach().clone() for p in step.dp.parameters()]


def _eager_run(batches) -> tuple[list, list]:
    step, outputs = _Step(), []
    for x, y in batches:
        step.x.copy_(x), step.y.copy_(y)
        outputs.append([t.clone() for t in step()])
    return _params(step), outputs


def test_warm_up_capture_check_and_replays_train_as_the_eager_steps_do():
    batches = _batches(9)
    want_params, want_outputs = _eager_run(batches)
    step, lines = _Step(), []
    graph = RecordedGraph(quiet=step.dp.capturing)
    captured = step.captured(graph, warmup_steps=3, say=lines.append)
    states = []
    for index, (x, y) in enumerate(batches):
        out = captured(x, y)
        assert [float(t) for t in out] == [float(t) for t in want_outputs[index]], index
        states.append(captured.state)
    assert states[:3] == ["warming up"] * 3 and states[3:] == ["replaying"] * 6
    assert graph.warm_steps == 3 and graph.captures == 1 and graph.replays == 6  # the 4th call's check replays once
    assert lines == [] and all(torch.equal(a, b) for a, b in zip(_params(step), want_params))
    assert step.dp._synced_steps == 9  # every replay counted by after_replay; the capture is no step
    assert out[0] is graph.outputs[0]  # a replay's outputs are the static tensors the capture returned


def test_a_capture_that_raises_runs_eagerly_from_the_same_state_and_says_so_once():
    batches = _batches(6)
    want_params, _ = _eager_run(batches)
    step, lines = _Step(), []
    captured = step.captured(RecordedGraph(fail=RuntimeError("operation not permitted when stream is capturing\n...")),
                             warmup_steps=2, say=lines.append)
    for x, y in batches:
        captured(x, y)
    assert captured.state == "eager" and lines == [
        "CUDA graph step abandoned, running eagerly: capturing the step raised RuntimeError: operation not permitted "
        "when stream is capturing"]
    assert all(torch.equal(a, b) for a, b in zip(_params(step), want_params))


def test_a_first_replay_that_disagrees_keeps_the_eager_result_and_runs_eagerly():
    batches = _batches(6)
    want_params, _ = _eager_run(batches)
    step, lines = _Step(), []

    def skip_nothing_but_scale_the_update(outputs):  # a replay whose update is 1% too large
        with torch.no_grad():
            for p in step.dp.parameters():
                p.add_(p.grad, alpha=-0.001)

    captured = step.captured(RecordedGraph(tamper=skip_nothing_but_scale_the_update), warmup_steps=2,
                             say=lines.append)
    for x, y in batches:
        captured(x, y)
    assert captured.state == "eager" and len(lines) == 1
    assert "its first replay disagreed with the eager step (parameter 0.weight: update off by" in lines[0]
    assert all(torch.equal(a, b) for a, b in zip(_params(step), want_params))


def test_outputs_that_disagree_are_caught_too():
    step, lines = _Step(), []

    def wrong_loss(outputs):
        outputs[0].add_(1.0)

    captured = step.captured(RecordedGraph(tamper=wrong_loss), warmup_steps=1, say=lines.append)
    for x, y in _batches(3):
        captured(x, y)
    assert captured.state == "eager" and "output 0 off by 1" in lines[0]


def test_an_lr_changed_after_capture_is_not_replayed_with_the_old_one():
    batches = _batches(6)
    step, lines = _Step(), []
    captured = step.captured(RecordedGraph(), warmup_steps=1, say=lines.append)
    for index, (x, y) in enumerate(batches):
        if index == 4:
            step.optimizer.param_groups[0]["lr"] = 0.05
        captured(x, y)
    assert captured.state == "eager"
    assert lines == ["CUDA graph step abandoned, running eagerly: the optimizer's settings (lr, ...) changed after "
                     "capture, and the graph holds them"]


def test_capturing_keeps_the_replicas_count_and_checks_off_and_refuses_an_exchanging_replica():
    step = _Step()
    with step.dp.capturing():
        step()
    assert step.dp._synced_steps == 0
    step()
    assert step.dp._synced_steps == 1
    with pytest.raises(ValueError, match="warmup_steps must be at least 1"):
        step.captured(RecordedGraph(), warmup_steps=0)
    alone = DataParallelConfig(exchange_alone=True)  # buckets and an exchange, as on each of k devices
    with DataParallel(nn.Linear(2, 2), world=WORLD1, options=alone) as dp:
        with pytest.raises(RuntimeError, match="capturing a replica that exchanges gradients is not supported"):
            with dp.capturing():
                pass
