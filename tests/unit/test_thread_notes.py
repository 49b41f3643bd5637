"""The first line says what phalanx did to the threads a user asked for elsewhere: an
OMP_NUM_THREADS from the environment that the worker's count replaced, and how to keep it (the
one way: --threads-per-device); and overlap auto's reason counts workers and cores in good
English, naming --bind-cores' share instead of "1 worker"."""

from __future__ import annotations

import os

import pytest

from phalanx.data_parallel.config import auto_overlap
from phalanx.runtime import binding
from phalanx.runtime.devices import parse_devices
from phalanx.runtime.launch import LaunchSpec
from phalanx.runtime.script import first_line

REPLACED = " (OMP_NUM_THREADS=4 from the environment is replaced: --threads-per-device 4 keeps it)"


@pytest.fixture
def omp_4(monkeypatch, tmp_path):
    """OMP_NUM_THREADS=4 in the environment, no worker placed in this process yet, no quota."""
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    monkeypatch.setenv("MKL_NUM_THREADS", "4")
    monkeypatch.setattr(binding, "_omp_before", None, raising=False)
    monkeypatch.setattr(binding, "quota_note", lambda: "", raising=False)
    monkeypatch.setattr(binding.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)


def test_phalanx_run_s_first_line_names_the_replaced_variable_and_the_flag(omp_4):
    line = first_line(LaunchSpec(plan=parse_devices("cpu:2")), workers=2, local_workers=2, store="127.0.0.1:1",
                      launcher="phalanx")
    assert f"2 workers on cpu, 1 thread each{REPLACED}; rendezvous" in line
    given = first_line(LaunchSpec(plan=parse_devices("cpu:2"), threads_per_device=1), workers=2, local_workers=2,
                       store="127.0.0.1:1", launcher="phalanx")
    assert "1 thread each; rendezvous" in given  # the flag chose: nothing replaced behind the user's back


def test_the_note_outlives_the_worker_s_own_export(omp_4, monkeypatch):
    monkeypatch.setattr(binding, "set_intra_op_threads", lambda count: None)  # this test process keeps its threads
    monkeypatch.setattr(binding, "keep_freed_memory_mapped", lambda: False)
    binding.place_worker(0, 1, bind_cores=False, threads=None)
    assert os.environ["OMP_NUM_THREADS"] == "2"  # the count every library in the worker reads
    assert binding.threads_note(2, flag_given=False) == REPLACED
    assert binding.threads_note(2, flag_given=True) == ""


def test_no_note_when_the_variable_agrees_or_is_unset(omp_4, monkeypatch):
    assert binding.threads_note(4, flag_given=False) == ""
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert binding.threads_note(2, flag_given=False) == ""
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")
    assert binding.threads_note(2, flag_given=False) == (
        " (OMP_NUM_THREADS=lots from the environment is replaced: --threads-per-device N keeps it)")


def test_overlap_auto_s_reason_counts_in_good_english():
    assert auto_overlap(algorithm="shm", workers=1, threads=1, cores=1) == (
        False, "1 worker x 1 thread on 1 core leaves no core for a communication thread")
    assert auto_overlap(algorithm="shm", workers=1, threads=1, cores=2) == (
        True, "1 worker x 1 thread on 2 cores leaves a core for a communication thread")
    # --bind-cores: this process is one of 2 workers, each on its own share of 1 core.
    assert auto_overlap(algorithm="shm", workers=1, threads=1, cores=1, bound_among=2) == (
        False, "each of 2 workers, bound to its own share, with 1 thread on 1 core, leaves no core for a "
               "communication thread")
