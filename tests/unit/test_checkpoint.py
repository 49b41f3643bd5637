"""Checkpoints: a round trip restores weights, optimizer, position, epoch sums and RNG; anything
else (missing, corrupt, a pickle with code in it, another model's, other settings) is refused in
one line that says what to do."""

import pickle
import random
import warnings

import numpy as np
import pytest
import torch

from phalanx.errors import UsageError
from phalanx.models import build_model
from phalanx.train import checkpoint as ckpt
from phalanx.runtime.world import World

WORLD = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
              backend="none", timeout_s=10.0)


def _model(name: str = "lenet") -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(name, init="pytorch", num_classes=10)


def _fp(model, **overrides):
    settings = dict(model_name="lenet", global_batch_size=256, seed=0, dtype="float32") | overrides
    return ckpt.fingerprint(model, **settings)


def _save(tmp_path, model, *, position=ckpt.Position(epoch=1, step=7, epoch_totals=(3.5, 12.0, 40.0, 0.25)), **fp):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.rand(4, 1, 28, 28)).sum().backward()
    opt.step()  # momentum buffers: optimizer state worth restoring
    ckpt.save_checkpoint(tmp_path, world=WORLD, model=model, optimizer=opt, position=position, fingerprint=_fp(model, **fp))
    return opt


def test_round_trip_restores_everything(tmp_path):
    model = _model()
    opt = _save(tmp_path, model)
    torch.manual_seed(123); np.random.seed(5); random.seed(9)
    ckpt.save_checkpoint(tmp_path, world=WORLD, model=model, optimizer=opt,
                         position=ckpt.Position(epoch=1, step=7, epoch_totals=(3.5, 12.0, 40.0, 0.25)),
                         fingerprint=_fp(model))
    expected_draws = (torch.rand(3), np.random.rand(2), random.random())

    fresh = _model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    state = ckpt.read_checkpoint(tmp_path)
    ckpt.check_compatible(state, _fp(fresh), path=tmp_path)
    torch.manual_seed(0); np.random.seed(0); random.seed(0)  # scrambled; restore must undo it
    position = ckpt.restore(state, world=WORLD, model=fresh, optimizer=fresh_opt)

    assert position == ckpt.Position(epoch=1, step=7, epoch_totals=(3.5, 12.0, 40.0, 0.25))
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(opt.state[p]["momentum_buffer"], fresh_opt.state[q]["momentum_buffer"])
    draws = (torch.rand(3), np.random.rand(2), random.random())
    assert torch.equal(draws[0], expected_draws[0])
    assert np.array_equal(draws[1], expected_draws[1]) and draws[2] == expected_draws[2]


def test_missing_checkpoint_is_one_line(tmp_path):
    with pytest.raises(UsageError, match=r"^no checkpoint at .*checkpoint.pt; pass --resume") as info:
        ckpt.read_checkpoint(tmp_path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("content", [b"", b"not a zip at all", b"PK\x03\x04" + bytes(200)])
def test_corrupt_file_is_refused_in_one_line(tmp_path, content):
    (tmp_path / "checkpoint.pt").write_bytes(content)
    with pytest.raises(UsageError, match="is not loadable as a weights-only checkpoint") as info:
        ckpt.read_checkpoint(tmp_path)
    assert "\n" not in str(info.value)


def test_an_empty_file_is_named_empty(tmp_path):
    (tmp_path / "checkpoint.pt").write_bytes(b"")  # a copy cut short, `: > checkpoint.pt`
    with pytest.raises(UsageError, match=r"checkpoint.pt is not loadable as a weights-only checkpoint \(it is empty, "
                                         r"0 bytes\); it is corrupt"):
        ckpt.read_checkpoint(tmp_path)


class Payload:  # what an attacker pickles: unpickling would call os.system
    def __reduce__(self):
        import os
        return (os.system, ("echo pwned",))


def test_a_pickle_carrying_code_is_refused_not_run(tmp_path):
    torch.save({"format": ckpt.FORMAT, "model": Payload()}, tmp_path / "checkpoint.pt")
    with pytest.raises(UsageError, match="weights-only"):
        ckpt.read_checkpoint(tmp_path / "checkpoint.pt")



def test_a_plain_pickle_swapped_in_is_refused_in_one_line_and_nothing_else(tmp_path):
    # A checkpoint directory others can write, a file swapped in: before, torch's two-line
    # "Detected pickle protocol 4" UserWarning came before phalanx's one line.
    (tmp_path / "checkpoint.pt").write_bytes(pickle.dumps({"format": ckpt.FORMAT, "model": Payload()}, protocol=4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(UsageError, match="is not loadable as a weights-only checkpoint") as info:
            ckpt.read_checkpoint(tmp_path)
    assert "\n" not in str(info.value)
    assert [str(w.message) for w in caught] == []

def test_a_plain_state_dict_is_not_a_checkpoint(tmp_path):
    torch.save(_model().state_dict(), tmp_path / "model.pt")
    with pytest.raises(UsageError, match="is not a phalanx checkpoint"):
        ckpt.read_checkpoint(tmp_path / "model.pt")


@pytest.mark.parametrize("field, value, flag", [("global_batch_size", 512, "--batch-size 512"),
                                                ("seed", 3, "--seed 3"), ("dtype", "float64", "--dtype float64")])
def test_other_settings_are_named_with_their_flag(tmp_path, field, value, flag):
    model = _model()
    _save(tmp_path, model)
    state = ckpt.read_checkpoint(tmp_path)
    expected = _fp(model, **{"model_name" if field == "model" else field: value})
    with pytest.raises(UsageError, match=f"but this run has {flag}; resume with the same settings"):
        ckpt.check_compatible(state, expected, path=tmp_path)


def test_a_scripts_resume_names_what_the_script_passes_not_phalanx_trains_flags(tmp_path):
    # Before 2026-12-02 phalanx.resume said "--batch-size 32" to a script that has no such flag.
    import phalanx

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    world = WORLD
    phalanx.checkpoint(tmp_path, world=world, model=model, optimizer=optimizer, epoch=1, global_batch_size=32, seed=0)
    with pytest.raises(UsageError, match=r"was saved with global_batch_size=32 but this run has global_batch_size=48; "
                                         r"resume with the same settings$"):
        phalanx.resume(tmp_path, world=world, model=model, optimizer=optimizer, global_batch_size=48, seed=0)
    with pytest.raises(UsageError, match=r"was saved with parameters of dtype float32 but this run has parameters "
                                         r"of dtype float64"):
        phalanx.resume(tmp_path, world=world, model=model.double(), optimizer=optimizer, global_batch_size=32, seed=0)


def test_another_models_checkpoint_names_the_parameter(tmp_path):
    lenet = _model("lenet")
    _save(tmp_path, lenet)
    state = ckpt.read_checkpoint(tmp_path)
    other = _model("lenet-bn")
    with pytest.raises(UsageError, match="--model lenet but this run has --model lenet-bn"):
        ckpt.check_compatible(state, _fp(other, model_name="lenet-bn"), path=tmp_path)
    # Same name, other shapes (e.g. a different --init never changes shapes; a code change does):
    with pytest.raises(UsageError, match=r"does not fit this model: parameter \S+"):
        ckpt.check_compatible(state, _fp(other), path=tmp_path)


def test_a_file_named_without_a_suffix_is_that_file_and_its_damage_is_said_in_whole_words(tmp_path):
    """`--resume afile` was read as a directory ("no checkpoint at afile/checkpoint.pt"), and the
    damage's reason was torch's message cut at 160 characters ("... there is a high)")."""
    named = tmp_path / "afile"
    named.write_text("hello")
    with pytest.raises(UsageError, match=r"afile is not loadable as a weights-only checkpoint \(KeyError: ") as info:
        ckpt.read_checkpoint(named)
    zipped = tmp_path / "zipped.pt"
    zipped.write_bytes(b"PK\x03\x04" + bytes(200))
    with pytest.raises(UsageError) as info:
        ckpt.read_checkpoint(zipped)
    reason = str(info.value).split("(", 1)[1].split("); it is corrupt", 1)[0]
    assert ": " in reason and (reason.endswith("...") or ". " not in reason), reason
