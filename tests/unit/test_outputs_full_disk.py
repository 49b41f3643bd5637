"""When model.pt cannot be written (a full disk, simulated by making the atomic write raise ENOSPC),
the trained weights are not lost silently: one line names the last checkpoint that holds them, or
a copy kept in the temporary directory, or says plainly that they are lost; accuracy.png failing
afterwards names what was written. Another reason (a file-size limit, a removed --out) gets the
fix it calls for, as every output's failed write does (errors.write_fix)."""

import errno
import os

import pytest
import torch

from phalanx.errors import RunFailed
from phalanx.models import build_model
from phalanx.job import outputs as outputs_module
from phalanx.job.outputs import Outputs

ROWS = [{"epoch": 1, "train_acc": 0.5, "test_acc": 0.4}, {"epoch": 2, "train_acc": 0.6, "test_acc": 0.5}]


def _full_disk_for(monkeypatch, *full_dirs, code: int = errno.ENOSPC):
    """Writes into any of `full_dirs` fail as a full disk does (or with errno `code`); others go through."""
    real = outputs_module.atomic_write_bytes

    def write(path, data):
        if any(os.path.dirname(os.path.abspath(path)) == os.path.abspath(d) for d in full_dirs):
            raise OSError(code, os.strerror(code), str(path))
        return real(path, data)

    monkeypatch.setattr(outputs_module, "atomic_write_bytes", write)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("lenet", init="pytorch", num_classes=10)


def test_the_last_checkpoint_is_named_when_model_pt_does_not_fit(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    kept = tmp_path / "run" / "checkpoints" / "checkpoint.pt"
    kept.parent.mkdir()
    kept.write_bytes(b"the last epoch's checkpoint")
    _full_disk_for(monkeypatch, out)
    with pytest.raises(RunFailed) as info:
        Outputs(out_dir=out).finish(ROWS, _model(), title="t", checkpoint=kept)
    assert str(info.value) == (f"cannot write {out / 'model.pt'} (No space left on device); the trained model is in "
                               f"the last checkpoint, {kept} (its 'model' entry is the state dict model.pt would hold)")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints"]  # nothing half-written


def test_without_a_checkpoint_a_copy_is_kept_in_the_temporary_directory(tmp_path, monkeypatch):
    out, spare_dir = _spare_in(tmp_path, monkeypatch)
    _full_disk_for(monkeypatch, out)
    model = _model()
    with pytest.raises(RunFailed) as info:
        Outputs(out_dir=out).finish(ROWS, model, title="t", checkpoint=None)
    spare = spare_dir / f"phalanx-model-{os.getpid()}.pt"
    assert str(info.value) == (f"cannot write {out / 'model.pt'} (No space left on device); the trained model is "
                               f"kept at {spare} instead: move it to {out / 'model.pt'} once there is space")
    kept = torch.load(spare, weights_only=True)
    assert all(torch.equal(kept[k], v) for k, v in model.state_dict().items())


def test_when_no_copy_fits_either_the_line_says_the_weights_are_lost(tmp_path, monkeypatch):
    out, spare_dir = _spare_in(tmp_path, monkeypatch)
    _full_disk_for(monkeypatch, out, spare_dir)
    with pytest.raises(RunFailed, match=r"^cannot write \S+model\.pt \(No space left on device\) nor a copy at "
                                        r"\S+ \(No space left on device\); the trained weights are lost: free space "
                                        r"there or choose another directory$"):
        Outputs(out_dir=out).finish(ROWS, _model(), title="t", checkpoint=tmp_path / "missing.pt")


def _spare_in(tmp_path, monkeypatch):
    out, spare_dir = tmp_path / "run", tmp_path / "tmp"
    out.mkdir()
    spare_dir.mkdir()
    monkeypatch.setenv("TMPDIR", str(spare_dir))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    return out, spare_dir


def test_a_file_size_limit_is_not_told_to_free_space(tmp_path, monkeypatch):
    # Past `ulimit -f` (EFBIG) every write of this process fails alike: the copy too.
    out, spare_dir = _spare_in(tmp_path, monkeypatch)
    _full_disk_for(monkeypatch, out, spare_dir, code=errno.EFBIG)
    with pytest.raises(RunFailed) as info:
        Outputs(out_dir=out).finish(ROWS, _model(), title="t")
    spare = spare_dir / f"phalanx-model-{os.getpid()}.pt"
    assert str(info.value) == (f"cannot write {out / 'model.pt'} (File too large) nor a copy at {spare} (File too "
                               "large); the trained weights are lost: the file is larger than this process may write "
                               "(ulimit -f, a filesystem's file-size limit); raise the limit (ulimit -f unlimited) or "
                               "choose another filesystem")


def test_an_out_removed_meanwhile_is_named_and_the_copy_kept(tmp_path, monkeypatch):
    out, spare_dir = _spare_in(tmp_path, monkeypatch)
    _full_disk_for(monkeypatch, out, code=errno.ENOENT)
    with pytest.raises(RunFailed) as info:
        Outputs(out_dir=out).finish(ROWS, _model(), title="t")
    spare = spare_dir / f"phalanx-model-{os.getpid()}.pt"
    assert str(info.value) == (f"cannot write {out / 'model.pt'} (No such file or directory); the trained model is "
                               f"kept at {spare} instead; its directory was removed while the run wrote there; choose "
                               "a directory nothing else removes and resume from the last checkpoint if one is left")
    assert spare.is_file()


def test_a_plot_that_does_not_fit_names_what_was_written(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()

    def no_space(path, **_):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(outputs_module, "plot_accuracy", no_space)
    with pytest.raises(RunFailed, match=r"^cannot write \S+accuracy\.png \(No space left on device\); "
                                        r"\S+model\.pt and metrics\.jsonl are written$"):
        Outputs(out_dir=out).finish(ROWS, _model(), title="t")
    assert (out / "model.pt").is_file()
