"""metrics.jsonl on resume: a resumed run keeps the rows of the epochs its checkpoint trained and
names, in one warning line, those the file lacks (a deleted file or deleted rows) and where the
plot will start; a line that is not a whole JSON row is refused in one line naming the file."""

import json

import pytest

from phalanx.errors import UsageError
from phalanx.job.outputs import Outputs
from phalanx.telemetry.metrics import MetricsFile, read_metrics


def _write(path, epochs):
    path.write_text("".join(json.dumps({"epoch": e, "test_acc": 0.5}) + "\n" for e in epochs))


def test_a_torn_line_is_one_line_naming_the_file_and_the_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, [1, 2])
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(UsageError, match=rf"^{path} is damaged: line 2 is not a whole JSON row"):
        read_metrics(path)
    with pytest.raises(UsageError):
        MetricsFile(path, start_epoch=2)


@pytest.mark.parametrize("kept, start_epoch, missing", [([1, 2, 3], 2, []), ([3], 3, [1, 2]), ([1, 3], 3, [2]),
                                                        (None, 2, [1, 2]), ([], 0, [])])
def test_the_epochs_a_resumed_file_lacks_are_named(tmp_path, kept, start_epoch, missing):
    path = tmp_path / "metrics.jsonl"
    if kept is not None:
        _write(path, kept)
    assert MetricsFile(path, start_epoch=start_epoch).missing_epochs == missing


def test_resuming_without_the_earlier_rows_is_one_warning_saying_where_the_plot_starts(tmp_path):
    said = []
    outputs = Outputs(out_dir=tmp_path)
    _, history = outputs.open_metrics(start_epoch=2, warn=said.append)  # metrics.jsonl deleted
    assert history == []
    assert said == [f"phalanx: warning: {tmp_path / 'metrics.jsonl'} has no row for 2 epochs (1-2) of the 2 the "
                    "checkpoint has trained (deleted?); training resumes from the checkpoint, those rows stay "
                    "missing and accuracy.png starts at epoch 3"]
    said.clear()
    _write(outputs.metrics, [1, 2, 4])
    outputs.open_metrics(start_epoch=4, warn=said.append)
    assert said and "has no row for epoch 3 of the 4" in said[0] and said[0].endswith("accuracy.png skips them")
    said.clear()
    _write(outputs.metrics, [1, 2])
    _, history = outputs.open_metrics(start_epoch=2, warn=said.append)
    assert said == [] and [r["epoch"] for r in history] == [1, 2]
