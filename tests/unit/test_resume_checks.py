"""What `phalanx train` checks when it resumes (resume.py): another data set - other name, other
size, or the same size with one byte changed - is refused in one line; lr, epochs, gradient
clipping and the device count may change and the resumed line names each change; running sums
are each rank's own on the device count that saved them (the epoch's row then adds them in an
uninterrupted run's order), else one run's (rank 0 carries them, the others start at zero); a
checkpoint of the first format still loads."""

from dataclasses import replace

import pytest
import torch

from phalanx.data import load_dataset
from phalanx.errors import UsageError
from phalanx.models import build_model
from phalanx.train import checkpoint as ckpt
from phalanx.data.config import DataConfig
from phalanx.job.checkpointing import CheckpointConfig
from phalanx.job.config import TrainConfig
from phalanx.job.optim import OptimizerConfig
from phalanx.job.resume import Start, dataset_identity, mixed_lr, resume_run, run_fingerprint, run_settings
from phalanx.runtime.world import World

SIZES = (64, 16)


def _world(rank: int = 0, size: int = 1) -> World:
    return World(rank=rank, world_size=size, local_rank=rank, local_world_size=size, device=torch.device("cpu"),
                 backend="none" if size == 1 else "gloo", timeout_s=10.0)


def _data(**changes):
    data = load_dataset("synthetic", None, log=lambda _: None, synthetic_sizes=SIZES)
    return replace(data, **changes) if changes else data


def _save(directory, config: TrainConfig, data, *, num_devices: int = 2, position=None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(config.model, init=config.init, num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.optim.lr)
    ckpt.save_checkpoint(directory, world=_world(), model=model, optimizer=optimizer,
                         position=position or ckpt.Position(epoch=2, step=6, epoch_totals=(9.5, 30.0, 96.0, 1.25)),
                         fingerprint=run_fingerprint(config, model, data=dataset_identity(data)),
                         settings=run_settings(config, num_devices=num_devices))
    return model


def _resume(config: TrainConfig, data, world: World | None = None) -> tuple[Start, list[str]]:
    lines: list[str] = []
    model = build_model(config.model, init=config.init, num_classes=10)
    start = resume_run(config, world=world or _world(), model=model,
                       optimizer=torch.optim.SGD(model.parameters(), lr=config.optim.lr),
                       data=lambda: dataset_identity(data), log=lines.append)
    return start, lines


def test_the_identity_is_name_sizes_and_a_hash_of_the_training_set():
    identity = dataset_identity(_data())
    assert identity["name"] == "synthetic" and (identity["num_train"], identity["num_test"]) == SIZES
    assert identity == dataset_identity(_data())  # deterministic
    images = _data().train_images.clone()
    images[5, 0, 3, 3] ^= 1  # one bit of one pixel
    assert dataset_identity(_data(train_images=images))["train_sha256"] != identity["train_sha256"]


@pytest.mark.parametrize("change", ["name", "size", "one byte"])
def test_a_checkpoint_of_another_data_set_is_refused_in_one_line(tmp_path, change):
    config = TrainConfig(data=DataConfig(dataset="synthetic"), checkpoint=CheckpointConfig(resume=str(tmp_path)))
    _save(tmp_path, config, _data())
    if change == "name":
        other = _data(name="fashion-mnist")
    elif change == "size":
        other = load_dataset("synthetic", None, log=lambda _: None, synthetic_sizes=(65, 16))
    else:
        images = _data().train_images.clone()
        images[0, 0, 0, 0] += 1
        other = _data(train_images=images)
    with pytest.raises(UsageError) as info:
        _resume(config, other)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"checkpoint {tmp_path / 'checkpoint.pt'} was trained on synthetic (64 train / 16 test "
                              "images, sha256 ")
    assert message.endswith("; resume with the data set it was trained on (--dataset / --data-dir / --train-examples)")


def test_lr_epochs_and_devices_may_change_and_the_resumed_line_names_each(tmp_path):
    _save(tmp_path, TrainConfig(optim=OptimizerConfig(lr=0.2), epochs=4), _data(), num_devices=2)
    config = TrainConfig(optim=OptimizerConfig(lr=0.05), epochs=6, checkpoint=CheckpointConfig(resume=str(tmp_path)))
    start, lines = _resume(config, _data())
    assert lines == [f"resumed from {tmp_path / 'checkpoint.pt'} at epoch 3, step 6; changed since the checkpoint: "
                     "--lr 0.2 -> 0.05, --epochs 4 -> 6, devices 2 -> 1"]
    assert start.earlier == {"lr": 0.2, "warmup_epochs": 0.0, "epochs": 4, "clip_grad_norm": None, "num_devices": 2,
                             "shard": "none"}
    # The epoch that mixes the two rates says so in its row; the others do not.
    assert mixed_lr(start, config, epoch=2) == {"lr_before_resume": 0.2, "steps_before_resume": 6}
    assert mixed_lr(start, config, epoch=3) == {}
    same, lines = _resume(TrainConfig(optim=OptimizerConfig(lr=0.2), epochs=4, checkpoint=CheckpointConfig(resume=str(tmp_path))), _data(), world=_world(0, 2))
    assert lines == [f"resumed from {tmp_path / 'checkpoint.pt'} at epoch 3, step 6"]
    assert mixed_lr(same, TrainConfig(optim=OptimizerConfig(lr=0.2)), epoch=2) == {}


def test_a_changed_clip_grad_norm_is_named_among_the_changes(tmp_path):
    _save(tmp_path, TrainConfig(), _data(), num_devices=1)
    for clip, change in ((1.0, "--clip-grad-norm none -> 1"), (None, None)):
        config = TrainConfig(optim=OptimizerConfig(clip_grad_norm=clip),
                             checkpoint=CheckpointConfig(resume=str(tmp_path)))
        _, lines = _resume(config, _data())
        assert lines == [f"resumed from {tmp_path / 'checkpoint.pt'} at epoch 3, step 6"
                         + (f"; changed since the checkpoint: {change}" if change else "")]
    _save(tmp_path, TrainConfig(optim=OptimizerConfig(clip_grad_norm=0.5)), _data(), num_devices=1)
    config = TrainConfig(optim=OptimizerConfig(clip_grad_norm=2.0), checkpoint=CheckpointConfig(resume=str(tmp_path)))
    assert _resume(config, _data())[1][0].endswith("; changed since the checkpoint: --clip-grad-norm 0.5 -> 2")


def test_on_the_same_device_count_each_rank_continues_its_own_sums(tmp_path):
    state = {"format": ckpt.FORMAT, "epoch": 2, "step": 6, "rng": [None, None],
             "epoch_totals": [9.5, 30.0, 96.0, 1.25], "rank_totals": [[4.0, 10.0, 48.0, 1.25], [5.5, 20.0, 48.0, 1.5]]}
    model = build_model("lenet", init="pytorch", num_classes=10)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {**state, "model": model.state_dict(), "optimizer": sgd.state_dict(), "rng": [_rng(), _rng()]}
    for rank in (0, 1):  # each its own: the row adds them up in the uninterrupted run's order
        assert ckpt.restore(state, world=_world(rank, 2), model=model,
                            optimizer=sgd).epoch_totals == tuple(state["rank_totals"][rank])
    for rank, expected in ((0, (9.5, 30.0, 96.0, 1.25)), (2, (0.0, 0.0, 0.0, 1.25))):  # another count: one run's
        assert ckpt.restore(state, world=_world(rank, 3), model=model, optimizer=sgd).epoch_totals == expected


def _rng():
    from phalanx.train.rng_state import rng_state
    return rng_state()


def test_running_sums_are_one_runs_carried_by_rank_0(tmp_path):
    _save(tmp_path, TrainConfig(), _data())
    state = ckpt.read_checkpoint(tmp_path)
    assert state["epoch_totals"] == [9.5, 30.0, 96.0, 1.25]  # reduced at save time, not one list per rank
    model = build_model("lenet", init="pytorch", num_classes=10)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert ckpt.restore(state, world=_world(0, 3), model=model, optimizer=sgd).epoch_totals == (9.5, 30.0, 96.0, 1.25)
    assert ckpt.restore(state, world=_world(2, 3), model=model, optimizer=sgd).epoch_totals == (0.0, 0.0, 0.0, 1.25)


def test_a_first_format_checkpoint_still_loads_its_sums_added_up_and_says_its_data_is_unchecked(tmp_path):
    config = TrainConfig(checkpoint=CheckpointConfig(resume=str(tmp_path)))
    model = _save(tmp_path, config, _data())
    state = ckpt.read_checkpoint(tmp_path)
    # What the first format held: no data identity, no settings, one list of sums per rank.
    state["format"] = ckpt.FORMAT_1
    del state["fingerprint"]["data"], state["settings"]
    state["epoch_totals"] = [[4.0, 10.0, 48.0, 1.25], [5.5, 20.0, 48.0, 1.5]]
    torch.save(state, tmp_path / "checkpoint.pt")
    for rank, expected in ((0, (9.5, 30.0, 96.0, 1.25)), (1, (0.0, 0.0, 0.0, 1.25))):
        start, lines = _resume(config, _data(), world=_world(rank, 2))
        assert start.position == ckpt.Position(epoch=2, step=6, epoch_totals=expected)
        assert start.earlier == {}
    assert lines == [f"resumed from {tmp_path / 'checkpoint.pt'} at epoch 3, step 6; the checkpoint predates "
                     "data-set fingerprints, so its data set is not checked"]
    resumed = build_model("lenet", init="pytorch", num_classes=10)
    resumed.load_state_dict(state["model"])
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), resumed.state_dict().values()))


def test_a_resume_with_another_momentum_is_refused_before_training(tmp_path):
    _save(tmp_path, TrainConfig(), _data())  # plain SGD, as every checkpoint before --momentum
    with pytest.raises(UsageError, match=r"was saved with --momentum 0 but this run has --momentum 0\.9"):
        _resume(TrainConfig(optim=OptimizerConfig(momentum=0.9), checkpoint=CheckpointConfig(resume=str(tmp_path))),
                _data())


def test_a_resume_on_other_devices_names_each_span_of_epochs():
    from phalanx.job.job import device_spans
    rows = [{"epoch": e, "devices": ["cpu:0", "cpu:1"] if e <= 3 else ["cpu:0"]} for e in range(1, 6)]
    assert device_spans(rows) == "epochs 1-3 on [cpu:0, cpu:1]; epochs 4-5 on [cpu:0]"
    assert device_spans(rows[:4]) == "epochs 1-3 on [cpu:0, cpu:1]; epoch 4 on [cpu:0]"
    assert device_spans(rows[:3]) == "" and device_spans([]) == ""  # one device set: the title's own list
