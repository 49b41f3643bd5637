"""A worker killed mid-epoch of a model-parallel split stops the run in one line, never a hang.

A pipeline stage or a channel shard that dies leaves its neighbours blocked in a point-to-point
receive; the launcher must notice the death and take everyone down fast, naming the rank.
"""

import pytest

from tests.distributed.test_faults import assert_all_gone, kill_a_worker_mid_run

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("split, victim", [("layers", 0), ("channels", 1)])
def test_a_killed_split_worker_ends_the_run_in_one_line(tmp_path, split, victim):
    argv = ["train", "--devices", "cpu:2", "--split", split, "--dataset", "synthetic", "--epochs", "200",
            "--no-progress"]
    returncode, stderr, elapsed_s, workers = kill_a_worker_mid_run(argv, tmp_path / "run", 2, victim,
                                                                   start_timeout_s=240, stop_timeout_s=90)
    assert returncode == 1, stderr[-2000:]
    assert elapsed_s < 30, f"took {elapsed_s:.1f} s to stop"
    first = stderr.strip().splitlines()[0]
    assert f"worker rank {victim} failed: died (signal SIGKILL) after step" in first, stderr[-2000:]
    assert_all_gone(workers)
