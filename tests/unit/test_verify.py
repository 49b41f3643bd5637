"""phalanx verify without processes: config rules, loss scaling, batches, comparison maths, diagnosis, report, CLI."""

import dataclasses
import json
import math

import pytest
import torch

from phalanx.data import shard_sizes
from phalanx.errors import UsageError
from phalanx.cli import build_parser
from phalanx.verify import VerifyConfig, compare_runs, scale_loss
from phalanx.options import build
from phalanx.verify.cli import VerifyCommand, run_verify
from phalanx.verify.batches import BatchSource, check_data, example_digests
from phalanx.verify.compare import RELATIVE_FLOOR, gradient_scale, tensor_diff
from phalanx.verify.diagnose import Probe, ProbeResult, cause_from_probes, direct_cause, plan_probes
from phalanx.verify.report import VerifyReport, WorldResult
from phalanx.verify.run import RunRecord

# ---------------------------------------------------------------- config


@pytest.mark.parametrize("kwargs, words", [
    ({"world_sizes": (1, 2)}, "at least 2"),
    ({"world_sizes": ()}, "--devices is empty; give at least one value"),
    ({"steps": 0}, "--steps 0"),
    ({"global_batch_size": 2}, "smaller than 3 devices"),
    ({"lr": float("nan")}, "--lr nan"),
    ({"lr": 0.0}, "--lr 0.0"),
    ({"dtype": "float16"}, "float32, float64"),
    ({"tolerance": -1.0}, "--tolerance -1.0"),
    ({"algorithm": "butterfly"}, "--allreduce 'butterfly'"),
    ({"batchnorm": "global"}, "--batchnorm 'global'"),
    ({"grad_dtype": "int8"}, "--grad-dtype 'int8'"),
    ({"grad_dtype": torch.float64}, "not supported"),
    ({"loss_scale": "rank-max"}, "loss_scale 'rank-max'"),
    ({"eval_modules": ("layernorm",)}, "'layernorm'"),
    ({"device": "tpu"}, "--device 'tpu'"),
])
def test_config_refuses_bad_values_naming_them(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        VerifyConfig(**kwargs)


def test_config_tolerance_defaults_by_dtype_and_grad_dtype_is_normalized():
    assert VerifyConfig().rtol == 1e-9
    assert VerifyConfig(dtype="float32").rtol == 1e-2
    assert VerifyConfig(tolerance=0.05).rtol == 0.05
    config = VerifyConfig(grad_dtype=torch.bfloat16)
    assert config.grad_dtype == "bf16" and config.torch_grad_dtype is torch.bfloat16
    assert VerifyConfig(grad_dtype="fp16").torch_grad_dtype is torch.float16
    assert VerifyConfig().torch_grad_dtype is None


# ---------------------------------------------------------------- loss scaling

def _shard_losses(losses, k, scale, reduction="mean"):
    """What the k ranks backpropagate in total, for per-example losses split like phalanx splits."""
    n, total, start = len(losses), 0.0, 0
    for size in shard_sizes(n, k):
        shard = losses[start:start + size]
        start += size
        loss = shard.mean() if reduction == "mean" else shard.sum()
        total += float(scale_loss(loss, n_local=size, n_global=n, world_size=k, reduction=reduction, scale=scale))
    return total


def test_global_scaling_is_exact_for_uneven_shards_and_rank_mean_is_not():
    losses = torch.arange(1.0, 8.0, dtype=torch.float64)  # 7 examples: shards 4+3 and 3+2+2
    for k in (2, 3):
        for reduction in ("mean", "sum"):
            assert _shard_losses(losses, k, "global", reduction) == pytest.approx(float(losses.mean()), rel=1e-15)
        assert _shard_losses(losses, k, "rank-mean") != pytest.approx(float(losses.mean()), rel=1e-6)
        assert _shard_losses(losses, k, "rank-sum") == pytest.approx(k * _shard_losses(losses, k, "rank-mean"))
    even = torch.arange(1.0, 7.0, dtype=torch.float64)  # 6 = 3+3 = 2+2+2: rank-mean is exact
    assert _shard_losses(even, 2, "rank-mean") == pytest.approx(float(even.mean()), rel=1e-15)
    assert _shard_losses(even, 3, "rank-mean") == pytest.approx(float(even.mean()), rel=1e-15)


def _halve(loss, *, n_local, n_global, world_size):
    return loss * n_local / n_global / 2


def test_scale_loss_accepts_a_callable_rule():
    loss = torch.tensor(3.0)
    assert float(scale_loss(loss, n_local=2, n_global=4, world_size=2, reduction="mean", scale=_halve)) == 0.75


# ---------------------------------------------------------------- batches

def _pair(n=50):
    generator = torch.Generator().manual_seed(0)
    return (torch.randint(0, 256, (n, 1, 4, 4), dtype=torch.uint8, generator=generator),
            torch.randint(0, 10, (n,), generator=generator))


def test_batch_source_is_deterministic_trims_and_plants_its_own_order():
    data = _pair()
    config = VerifyConfig(global_batch_size=7, steps=9)  # 50 = 7 x 7 + 1: crosses into epoch 1
    a, b = BatchSource(data, config, device=torch.device("cpu")), BatchSource(data, config, device=torch.device("cpu"))
    for step in range(9):
        assert torch.equal(a.batch(step)[0], b.batch(step)[0])
    assert a.batch(0)[0].dtype == torch.float64 and float(a.batch(0)[0].max()) <= 1.0
    assert a.raw(7)[0].shape[0] == 1  # the epoch's last, smaller batch
    trimmed = BatchSource(data, VerifyConfig(global_batch_size=7, trim_to_multiple=3), device=torch.device("cpu"))
    assert trimmed.raw(0)[0].shape[0] == 6 and torch.equal(trimmed.raw(0)[0], a.raw(0)[0][:6])
    own = BatchSource(data, config, device=torch.device("cpu"), seed_offset=1)
    assert not torch.equal(own.raw(0)[0], a.raw(0)[0])


def test_example_digests_fingerprint_input_and_target():
    x = torch.zeros(3, 2, dtype=torch.float64)
    x[2, 0] = 1.0
    y = torch.tensor([0, 1, 0])
    d = example_digests(x, y)
    assert d[0] != d[1] != d[2] != d[0]  # row 1 differs by target only, row 2 by input only
    assert example_digests(x[:1], y[:1]) == d[:1]


def test_check_data_refuses_unusable_data():
    with pytest.raises(ValueError, match="got int"):
        check_data(3)
    with pytest.raises(ValueError, match="5 inputs and 4 targets"):
        check_data((torch.zeros(5, 2), torch.zeros(4)))
    check_data(_pair())
    check_data(lambda step: _pair(4))


# ---------------------------------------------------------------- comparison

def _snapshot(scale=1.0, grad_shift=0.0):
    f64 = torch.float64
    grad = {"w": torch.tensor([1.0, -2.0, 0.5], dtype=f64) * scale + grad_shift, "b": torch.tensor([0.25], dtype=f64) * scale}
    return {"grad": grad, "param": {"w": torch.tensor([0.3, 0.1, -0.2], dtype=f64), "b": torch.tensor([0.0], dtype=f64)},
            "buffer": {"n": torch.tensor(1)}}


def _record(rank, world_size, snapshots, batches, *, param_digest="p"):
    """A record whose step s shard is this rank's slice of batches[s] (lists of example ids)."""
    record = RunRecord(rank=rank, world_size=world_size, snapshots=snapshots if rank == 0 else None)
    for batch in batches:
        sizes = shard_sizes(len(batch), world_size)
        start = sum(sizes[:rank])
        record.example_digests.append(batch[start:start + sizes[rank]])
        record.shard_sizes.append(sizes[rank])
        record.batch_sizes.append(len(batch))
        record.param_digests.append(param_digest)
    return record


BATCHES = [list("abcde"), list("fghij")]  # two steps of 5 examples: uneven over 2 ranks


def _run(k, snapshots, batches=BATCHES, **kwargs):
    return [_record(r, k, snapshots, batches, **kwargs) for r in range(k)]


def test_tensor_diff_is_relative_with_a_floor_for_zero_gradients():
    assert tensor_diff(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]), scale=2.0) == (0.0, 0.0)
    abs_diff, rel = tensor_diff(torch.tensor([1.0, 2.1]), torch.tensor([1.0, 2.0]), scale=2.0)
    assert abs_diff == pytest.approx(0.1) and rel == pytest.approx(0.05)
    # a gradient that is zero in exact arithmetic: judged against the floor, not against its noise
    _, rel = tensor_diff(torch.tensor([3e-17]), torch.tensor([-1e-17]), scale=1.0)
    assert rel == pytest.approx(4e-17 / RELATIVE_FLOOR)
    assert tensor_diff(torch.tensor(2), torch.tensor(1), scale=0.0)[1] == math.inf


def test_identical_runs_pass_and_a_perturbed_gradient_is_the_first_divergence():
    reference = _record(0, 1, [_snapshot(), _snapshot()], BATCHES)
    assert compare_runs(reference, _run(2, [_snapshot(), _snapshot()]), rtol=1e-9).passed
    perturbed = [_snapshot(), _snapshot(grad_shift=1e-3)]
    comparison = compare_runs(reference, _run(2, perturbed), rtol=1e-9)
    assert not comparison.passed and comparison.data_mismatch is None and comparison.replica_mismatch is None
    first = comparison.first_divergence
    assert (first.step, first.kind, first.name) == (2, "grad", "w")
    assert first.abs_diff == pytest.approx(1e-3) and first.rel_diff == pytest.approx(1e-3 / 2.0)
    assert comparison.steps[0].max_rel["grad"] == 0.0
    assert comparison.steps[1].max_rel["grad"] == pytest.approx(5e-4) and comparison.steps[1].worst["grad"] == "w"
    assert comparison.uneven_steps == [1, 2]
    assert compare_runs(reference, _run(2, perturbed), rtol=1e-2).passed  # a user tolerance admits it


def test_data_and_replica_checks():
    reference = _record(0, 1, [_snapshot(), _snapshot()], BATCHES)
    swapped = compare_runs(reference, _run(2, [_snapshot()] * 2, [list("abcde"), list("fghji")]), rtol=1e-9)
    assert "another order" in swapped.data_mismatch and not swapped.passed
    foreign = compare_runs(reference, _run(2, [_snapshot()] * 2, [list("abcxy"), list("fghij")]), rtol=1e-9)
    assert "2 of the 1-device batch's 5 examples are on no rank" in foreign.data_mismatch
    assert "[0, 2]" in foreign.data_mismatch
    ranks = _run(3, [_snapshot()] * 2)
    ranks[2].param_digests[1] = "other"
    replicas = compare_runs(reference, ranks, rtol=1e-9)
    assert replicas.replica_mismatch == "after step 2 rank 2 holds other parameters than rank 0"


def test_gradient_scale_fits_a_clean_multiple_only():
    want = _snapshot()["grad"]
    assert gradient_scale(_snapshot(scale=3.0)["grad"], want) == pytest.approx(3.0)
    assert gradient_scale(_snapshot(grad_shift=0.7)["grad"], want) is None  # not a rescaling


# ---------------------------------------------------------------- diagnosis

def _comparison(k, scale=1.0, batches=BATCHES, rank_batches=None, **record_kwargs):
    reference = _record(0, 1, [_snapshot(), _snapshot()], batches)
    ranks = _run(k, [_snapshot(scale), _snapshot(scale)], rank_batches or batches, **record_kwargs)
    return compare_runs(reference, ranks, rtol=1e-9)


def test_direct_causes_name_data_order_replicas_and_loss_scaling():
    config = VerifyConfig()
    assert direct_cause(_comparison(2, 2.0), config).key == "loss-sum"
    assert direct_cause(_comparison(3, 3.1), config).key == "loss-sum"  # uneven shards: about k
    assert direct_cause(_comparison(2, 0.5), config).key == "loss-double-average"
    assert direct_cause(_comparison(2, 1.6), config).key == "loss-scale"
    assert direct_cause(_comparison(2, 1.0), config) is None
    shuffled = _comparison(2, 2.0, rank_batches=[list("abcde"), list("fghji")])
    assert direct_cause(shuffled, config).key == "data-order"  # before the gradient scale
    reference = _record(0, 1, [_snapshot()] * 2, BATCHES)
    ranks = _run(2, [_snapshot()] * 2)
    ranks[1].param_digests[0] = "other"
    cause = direct_cause(compare_runs(reference, ranks, rtol=1e-9), config)
    assert cause.key == "replicas" and "after step 1 rank 1" in cause.summary


def test_probes_are_planned_by_what_the_model_and_config_hold():
    uneven = dict(world_size=2, batch_sizes=[5, 5])
    keys = lambda config, **counts: [p.key for p in plan_probes(config, **uneven, **counts)]  # noqa: E731
    assert keys(VerifyConfig(), num_batchnorm=0, num_dropout=0) == ["rank-mean"]
    assert keys(VerifyConfig(), num_batchnorm=3, num_dropout=0) == ["rank-mean", "batchnorm", "combined"]
    assert keys(VerifyConfig(batchnorm="local"), num_batchnorm=3, num_dropout=1) == [
        "batchnorm", "rank-mean", "dropout", "combined"]
    assert keys(VerifyConfig(grad_dtype="bf16"), num_batchnorm=0, num_dropout=0) == ["grad-dtype", "rank-mean",
                                                                                        "combined"]
    assert plan_probes(VerifyConfig(), world_size=2, batch_sizes=[4, 6], num_batchnorm=0, num_dropout=0) == []
    assert keys(VerifyConfig(eval_modules=("dropout",)), num_batchnorm=0, num_dropout=2) == ["rank-mean"]
    combined = plan_probes(VerifyConfig(batchnorm="local"), **uneven, num_batchnorm=1, num_dropout=1)[-1]
    assert combined.changes == {"eval_modules": ("batchnorm", "dropout"), "trim_to_multiple": 2}
    probe_config = combined.apply(VerifyConfig(batchnorm="local"))
    assert probe_config.trim_to_multiple == 2 and not probe_config.diagnose and probe_config.batchnorm == "local"


def test_the_first_passing_probe_names_the_cause():
    failed, agree = _comparison(2, 1.01), _comparison(2, 1.0)
    bn = Probe(key="batchnorm", description="BatchNorm layers in eval mode")
    trim = Probe(key="rank-mean", description="every global batch cut to a multiple of 2")
    results = [ProbeResult(probe=bn, comparison=failed), ProbeResult(probe=trim, comparison=agree)]
    cause = cause_from_probes(VerifyConfig(), failed, results)
    assert cause.key == "rank-mean" and "per-rank mean on uneven shards" in cause.summary and "3+2" in cause.summary
    assert "agree" in cause.evidence
    bn_cause = cause_from_probes(VerifyConfig(batchnorm="local"), failed, [ProbeResult(probe=bn, comparison=agree)],
                                 num_batchnorm=3)
    assert bn_cause.key == "batchnorm" and "BatchNorm statistics" in bn_cause.summary and "--batchnorm sync" in bn_cause.fix
    compression = cause_from_probes(VerifyConfig(grad_dtype="bf16"), failed, [
        ProbeResult(probe=Probe(key="grad-dtype", description="as computed"), comparison=agree)])
    assert compression.key == "grad-dtype" and "bf16" in compression.summary and "--tolerance" in compression.fix
    unknown = cause_from_probes(VerifyConfig(), failed, [ProbeResult(probe=bn, comparison=failed)])
    assert unknown.key == "unknown" and "grad of w at step 1" in unknown.summary


@pytest.mark.parametrize("eager_limit, spawns", [(10**6, [2]), (0, [1, 1])])
def test_verify_runs_probes_in_the_same_spawn_for_small_models_else_after_a_failure(monkeypatch, eager_limit, spawns):
    """verify's orchestration with fake runs: a planted rank-mean that the trim probe clears."""
    from phalanx.verify import api

    calls = []

    def fake_reference(model_fn, loss_fn, data, config, *, device):
        record = _record(0, 1, [_snapshot()] * 2, BATCHES)
        record.initial = {"w": torch.zeros(3)}
        return record

    def fake_spawn(k, model_fn, loss_fn, data, configs):
        calls.append(len(configs))
        return [_run(k, [_snapshot(scale=1.0 if c.trim_to_multiple or c.loss_scale == "global" else 1.05)] * 2)
                for c in configs]

    monkeypatch.setattr(api, "reference_run", fake_reference)
    monkeypatch.setattr(api, "_spawn", fake_spawn)
    monkeypatch.setattr(api, "EAGER_PROBES_MAX_PARAMETERS", eager_limit)
    report = api.verify(dict, _pair(), config=VerifyConfig(world_sizes=(2,), loss_scale="rank-mean"))
    assert calls == spawns and not report.passed
    assert report.result(2).cause.key == "rank-mean" and [p.probe.key for p in report.result(2).probes] == ["rank-mean"]
    calls.clear()
    assert api.verify(dict, _pair(), config=VerifyConfig(world_sizes=(2,))).result(2).probes == []
    assert calls == [spawns[0]]
    with pytest.raises(ValueError, match="lambda"):
        api.verify(lambda: None, _pair())


class _TokenNet(torch.nn.Sequential):
    def __init__(self):
        super().__init__(torch.nn.Embedding(11, 4), torch.nn.Linear(4, 11))


def _token_mean(outputs, targets):
    """nanoGPT's loss: the mean over the tokens whose target is not -1."""
    return torch.nn.functional.cross_entropy(outputs.flatten(0, 1), targets.flatten(), ignore_index=-1)


def _tokens(ignored: bool):
    ids = torch.randint(0, 11, (9, 6), generator=torch.Generator().manual_seed(0))
    targets = ids.roll(-1, dims=1)
    if ignored:
        targets[:3, :4] = -1  # padding in the first shard's sequences only
    return ids, targets


def test_a_token_mean_with_ignored_targets_is_named_from_its_first_gradient(monkeypatch):
    # Before 2026-12-03 verify said "no usual culprit explains it" for nanoGPT's token mean with ignore_index.
    from phalanx.verify import api
    from phalanx.verify.example_mean import example_mean_gap

    config = VerifyConfig(world_sizes=(2,), global_batch_size=9)
    cpu = torch.device("cpu")
    gap = example_mean_gap(_TokenNet, _token_mean, _tokens(True), config, world_size=2, device=cpu)
    assert gap is not None and gap > config.rtol
    # Every token counted: the token mean is the mean over examples / 6, a mean over examples.
    assert example_mean_gap(_TokenNet, _token_mean, _tokens(False), config, world_size=2, device=cpu) is None
    summed = dataclasses.replace(config, loss_reduction="sum")
    assert example_mean_gap(_TokenNet, _token_mean, _tokens(True), summed, world_size=2, device=cpu) is None

    def fake_reference(model_fn, loss_fn, data, config, *, device):
        return _record(0, 1, [_snapshot()] * 2, BATCHES)

    monkeypatch.setattr(api, "reference_run", fake_reference)
    monkeypatch.setattr(api, "_spawn", lambda k, *args: [_run(k, [_snapshot(scale=1.05)] * 2)] * len(args[-1]))
    cause = api.verify(_TokenNet, _tokens(True), loss_fn=_token_mean, config=config).result(2).cause
    assert cause.key == "token-mean" and cause.summary.startswith("loss_fn is not a mean over the examples (a token "
                                                                  "mean with ignore_index?)")
    assert 'loss_reduction="sum"' in cause.fix and "phalanx.shard_loss(loss_sum, global count" in cause.fix
    assert f"differ by {gap:.2g} relative" in cause.evidence


# ---------------------------------------------------------------- report and CLI

def test_report_renders_numbers_verdict_and_cause_and_writes_strict_json():
    failed = _comparison(2, 2.0)
    result = WorldResult(world_size=2, comparison=failed, cause=direct_cause(failed, VerifyConfig()))
    report = VerifyReport(config=VerifyConfig(world_sizes=(2,)), results=[result], title="toy")
    text = report.render()
    assert not report.passed and "FAIL" in text and "summed vs averaged loss" in text
    assert "first divergence: step 1, gradient w" in text and text.endswith("verdict: FAIL (k = 2: loss-sum)")
    payload = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert payload["results"][0]["cause"]["key"] == "loss-sum" and payload["passed"] is False
    assert payload["results"][0]["steps"][0]["grad_max_rel"] == pytest.approx(1.0)
    ok = VerifyReport(config=VerifyConfig(world_sizes=(2,)), results=[WorldResult(world_size=2,
                                                                                  comparison=_comparison(2))])
    assert ok.passed and ok.render().endswith("verdict: PASS")


def _args(*argv):
    return build_parser(["verify"]).parse_args(["verify", *argv])


def test_cli_flags_map_and_bad_input_is_one_line(tmp_path):
    command = build(VerifyCommand, _args("--devices", "2,3", "--grad-dtype", "bf16", "--plant", "rank-mean",
                                         "--tolerance", "1e-2", "--split", "data"))
    config = command.verify_config()
    assert (config.world_sizes, config.grad_dtype, config.tolerance, config.loss_scale) == ((2, 3), "bf16", 1e-2,
                                                                                          "rank-mean")
    assert (command.plant, command.split.kind) == ("rank-mean", "data")
    assert build(VerifyCommand, _args("--plant", "shuffle-per-rank")).verify_config().shuffle_per_rank
    assert build(VerifyCommand, _args()).verify_config() == VerifyConfig()
    for argv, words in [(("--model", "vgg"), "--model 'vgg' is unknown"), (("--plant", "x"), "--plant 'x'"),
                        (("--devices", "1"), "at least 2"), (("--devices", "two"), "--devices item 'two' is not a device count"),
                        (("--grad-dtype", "int8"), "--grad-dtype 'int8'"), (("--out", str(tmp_path)), "a directory"),
                        (("--out", str(tmp_path / "no" / "r.json")), "does not exist")]:
        with pytest.raises(UsageError, match=words.replace("(", r"\(")) as info:
            run_verify(_args(*argv))
    with pytest.raises(UsageError, match="--plant plants data-parallel bugs; drop it with --split layers"):
        run_verify(_args("--plant", "rank-sum", "--split", "layers"))
        assert "\n" not in str(info.value)


def test_the_help_says_the_tolerances_the_config_uses(capsys):
    from phalanx.cli import main
    from phalanx.verify import DEFAULT_TOLERANCE

    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ("relative difference allowed per tensor (default: "
            + ", ".join(f"{tolerance:g} in {dtype}" for dtype, tolerance in DEFAULT_TOLERANCE.items()) + ")") in text
    assert "0.01 in float32" in text and VerifyConfig(dtype="float32").rtol == 1e-2
