"""`srun --ntasks 2 python script.py` without torchrun: every task would be rank 0 of a world of
one, training alone and writing the same outputs. The Slurm step's variables (faked here) make
`phalanx train`, `phalanx run`, `phalanx.init()` and the commands that start their own workers
(bench, verify, predict, sweep) stop in one line, exit 2, nothing written;
a batch script, a one-task step, torchrun's variables and the opt-out are accepted."""

from __future__ import annotations

import os

import pytest

from phalanx.cli import main
from phalanx.errors import UsageError
from phalanx.runtime import script
from phalanx.runtime.slurm import INDEPENDENT_TASKS_VAR, alone_in_slurm_step

SRUN_TASK_1 = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2",
               "SLURM_PROCID": "1", "SLURM_LOCALID": "1"}
ONE_LINE = r"Slurm task \d of 2 but has no RANK/WORLD_SIZE, so each task would train alone as rank 0 of 1"


@pytest.mark.parametrize("env", [
    SRUN_TASK_1,
    {"SLURM_NTASKS": "2", "SLURM_PROCID": "0"},  # no job id: the step's count is SLURM_NTASKS
])
def test_a_task_of_a_several_task_step_is_refused_with_the_fix(env):
    with pytest.raises(UsageError, match=ONE_LINE) as caught:
        alone_in_slurm_step(env)
    assert "torchrun" in str(caught.value) and f"{INDEPENDENT_TASKS_VAR}=1" in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("env", [
    {},  # not Slurm
    {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"},  # the batch script: one process
    {"SLURM_JOB_ID": "77", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"},  # srun -n 1
    {**SRUN_TASK_1, INDEPENDENT_TASKS_VAR: "1"},  # each task alone on purpose (a sweep)
    {**SRUN_TASK_1, "RANK": "1", "WORLD_SIZE": "2"},  # a launcher's worker (srun torchrun ...): its world
])
@pytest.mark.parametrize("command", [None, "bench"])
def test_one_process_per_step_or_the_opt_out_is_accepted(env, command):
    alone_in_slurm_step(env, command=command)


@pytest.fixture
def in_srun_task(monkeypatch, tmp_path):
    for name, value in SRUN_TASK_1.items():
        monkeypatch.setenv(name, value)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", INDEPENDENT_TASKS_VAR):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_phalanx_train_in_a_srun_task_stops_before_writing(in_srun_task, capsys):
    code = main(["train", "--dataset", "synthetic", "--epochs", "1", "--devices", "cpu:1", "--out", "out"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("phalanx: error: this process is Slurm task 1 of 2")
    assert os.listdir(in_srun_task) == []


def test_phalanx_run_in_a_srun_task_stops_before_starting_workers(in_srun_task, capsys):
    (in_srun_task / "train.py").write_text("open('written', 'w').close()\n")
    assert main(["run", "--devices", "cpu:1", "train.py"]) == 2
    assert capsys.readouterr().err.startswith("phalanx: error: this process is Slurm task 1 of 2")
    assert os.listdir(in_srun_task) == ["train.py"]


def test_phalanx_init_in_a_srun_task_exits_2_in_one_line(in_srun_task, monkeypatch, capsys):
    monkeypatch.setattr(script, "_current", None)
    with pytest.raises(SystemExit) as stopped:
        script.init(device="cpu")
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "each task would train alone" in err


@pytest.mark.parametrize("argv", [["bench", "allreduce"], ["verify"], ["predict"], ["sweep"]])
def test_a_measuring_command_in_a_several_task_step_is_refused_before_it_starts(argv, in_srun_task, capsys):
    # Each task would start its own workers beside the other's, timing one another on the same cores
    # and writing the same outputs; before, nothing looked at Slurm's variables for these commands.
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"Slurm task 1 of 2, so each task would run phalanx {argv[0]} beside the others" in err, err
    assert f"srun --ntasks 1 phalanx {argv[0]}" in err and err.count("\n") == 1
    assert os.listdir(in_srun_task) == []

