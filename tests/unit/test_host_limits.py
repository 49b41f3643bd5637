"""A worker's error that a finite ulimit explains is one line naming the limit and the fix (it was
the error's traceback: gloo's "Resource temporarily unavailable" under `ulimit -u 8`, a
MemoryError under `ulimit -v`); the error files a run can do without fall away where no
temporary directory can be made."""

import errno
import resource
import tempfile

import pytest

from phalanx.errors import UsageError
from phalanx.runtime import host_limits
from phalanx.runtime.host_limits import check_limits, check_temp_dir, limit_reason
from phalanx.runtime.worker_errors import error_files


def _limits(monkeypatch, **soft_by_name):
    table = {getattr(resource, name): value for name, value in soft_by_name.items()}
    monkeypatch.setattr(host_limits.resource, "getrlimit",
                        lambda which: (table.get(which, resource.RLIM_INFINITY),) * 2)


def test_a_thread_that_cannot_start_names_ulimit_u(monkeypatch):
    _limits(monkeypatch, RLIMIT_NPROC=8)
    monkeypatch.setattr(host_limits, "_user_tasks", lambda: 8)
    line = limit_reason(RuntimeError("Resource temporarily unavailable"))
    assert "ulimit -u 8" in line and "ulimit -u 4096" in line and "\n" not in line


def test_out_of_address_space_names_ulimit_v(monkeypatch):
    _limits(monkeypatch, RLIMIT_AS=1_000_000 * 1024)
    line = limit_reason(ImportError("x.so: failed to map segment from shared object"))
    assert "ulimit -v 1000000" in line and "ulimit -v unlimited" in line
    assert "ulimit -v 1000000" in limit_reason(MemoryError())


def test_too_many_open_files_names_ulimit_n(monkeypatch):
    _limits(monkeypatch, RLIMIT_NOFILE=14)
    assert "(ulimit -n 1024)" in limit_reason(OSError(errno.EMFILE, "Too many open files"))
    _limits(monkeypatch, RLIMIT_NOFILE=4096)  # already past the usual default: a value above what it holds
    assert "(ulimit -n 8192)" in limit_reason(OSError(errno.EMFILE, "Too many open files"))


def test_errors_no_limit_explains_stay_errors(monkeypatch):
    _limits(monkeypatch)  # every limit unlimited: a MemoryError is the program's own
    assert limit_reason(MemoryError()) is None
    assert limit_reason(RuntimeError("Resource temporarily unavailable")) is None
    _limits(monkeypatch, RLIMIT_NPROC=8, RLIMIT_AS=2**31, RLIMIT_NOFILE=64)
    assert limit_reason(ValueError("bad value")) is None
    assert limit_reason(BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")) is None
    _limits(monkeypatch, RLIMIT_NPROC=60_000)  # the default for a user: far from it, an EAGAIN is something else
    monkeypatch.setattr(host_limits, "_user_tasks", lambda: 300)
    assert limit_reason(RuntimeError("Resource temporarily unavailable")) is None


def test_this_users_threads_are_counted():
    assert host_limits._user_tasks() >= 2  # this process, and pytest's at least one more thread or process


def test_a_hard_limit_below_the_floor_is_refused(monkeypatch):
    _limits(monkeypatch, RLIMIT_NOFILE=12)
    with pytest.raises(UsageError, match=r"ulimit -n is 12 \(hard limit 12\).*ulimit -n 1024"):
        check_limits(2)


def test_the_fix_names_at_least_what_the_workers_need(monkeypatch):
    # `--devices cpu:100000` under a hard limit of 20,000 was told "raise it (ulimit -n 1024)".
    _limits(monkeypatch, RLIMIT_NOFILE=20_000)
    with pytest.raises(UsageError) as caught:
        check_limits(100_000)
    line = str(caught.value)
    assert "need at least 400032 open files" in line and "(ulimit -n 400032: the hard limit too" in line
    assert line.endswith("or run fewer workers") and "\n" not in line
    _limits(monkeypatch, RLIMIT_AS=2**30)  # a floor per process: fewer workers would not help
    with pytest.raises(UsageError) as caught:
        check_limits(2)
    assert "(ulimit -v unlimited: the hard limit too" in str(caught.value) and "fewer" not in str(caught.value)


def test_no_temporary_directory_is_refused_and_the_error_files_fall_away(monkeypatch):
    def none_usable():
        raise FileNotFoundError(errno.ENOENT, "No usable temporary directory found in ['/tmp']")

    monkeypatch.setattr(tempfile, "gettempdir", none_usable)
    monkeypatch.setattr(tempfile, "mkdtemp", lambda **_: none_usable())
    with pytest.raises(UsageError, match="set TMPDIR to a writable directory"):
        check_temp_dir()
    with error_files(2) as paths:
        assert paths == [None, None]


def test_a_batch_that_does_not_fit_in_dev_shm_names_its_size_and_the_fix(monkeypatch):
    monkeypatch.setattr(host_limits.os, "statvfs",
                        lambda path: type("S", (), {"f_blocks": 2048, "f_bavail": 512, "f_frsize": 4096})())
    exc = RuntimeError("Caught RuntimeError in DataLoader worker process 0.\nOriginal Traceback ...\nRuntimeError: "
                       "unable to allocate shared memory(shm) for file </torch_1_2_0>: No space left on device (28)")
    line = limit_reason(exc)
    assert line.startswith("a DataLoader worker could not pass a batch through shared memory: /dev/shm holds 8 MiB "
                           "(2 MiB free now"), line
    assert "--shm-size" in line and "num_workers=0" in line and "\n" not in line


def test_a_soft_limit_below_the_floor_is_raised(monkeypatch):
    set_to = {}
    monkeypatch.setattr(host_limits.resource, "getrlimit", lambda which: (
        (20, 4096) if which == resource.RLIMIT_NOFILE else (resource.RLIM_INFINITY, resource.RLIM_INFINITY)))
    monkeypatch.setattr(host_limits.resource, "setrlimit", lambda which, limits: set_to.update({which: limits}))
    check_limits(2)
    assert set_to == {resource.RLIMIT_NOFILE: (1024, 4096)}
