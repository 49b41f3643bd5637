"""The fork server's choices, without starting it (tests/distributed/test_fork_server.py starts it):
when a launch forks from it and when it spawns, and what a copy takes on of the launcher's."""

import os
import resource
import sys

import pytest

from phalanx.runtime import fork_server
from phalanx.runtime.fork_server import LauncherState


@pytest.mark.skipif(sys.platform != "linux", reason="the fork server is used on Linux only")
def test_a_server_is_started_anew_when_a_variable_read_at_start_changed_and_only_then(monkeypatch):
    from multiprocessing import forkserver

    events = []
    monkeypatch.setattr(forkserver, "ensure_running", lambda: events.append("ensure"))
    monkeypatch.setattr(fork_server, "_stop", lambda server: events.append("stop"))
    monkeypatch.setattr(fork_server, "_started_with", None)
    monkeypatch.setattr(fork_server, "_preload", fork_server.PRELOAD)
    fork_server._ensure_running()  # the first: nothing to stop
    assert events == ["ensure"] and fork_server._started_with == (fork_server._at_start_variables(),
                                                                fork_server.PRELOAD)
    monkeypatch.setenv("PHALANX_UNRELATED_MARK", "1")  # read after the start: the copy takes it on
    fork_server._ensure_running()
    assert events == ["ensure"] * 2
    for name in ("OMP_SCHEDULE", "LD_PRELOAD", "PYTHONHASHSEED", "MALLOC_ARENA_MAX", "KMP_INIT_AT_FORK"):
        events.clear()
        with monkeypatch.context() as changed:
            changed.setenv(name, "7")
            fork_server._ensure_running()
            fork_server._ensure_running()  # started with it now: kept
        assert events == ["stop", "ensure", "ensure"], name
        assert fork_server.start_method() == "forkserver"  # never spawn for it: one import, not k
        events.clear()
        fork_server._ensure_running()  # the variable is back as it was: started anew again
        assert events == ["stop", "ensure"], name


@pytest.mark.skipif(sys.platform != "linux", reason="the fork server is used on Linux only")
def test_the_compilers_cache_directory_set_by_torchs_own_import_keeps_the_server(monkeypatch, tmp_path):
    """torch._dynamo's import writes TORCHINDUCTOR_CACHE_DIR (torch's default) where it is unset: a
    launcher that imported it after the server started (an optimizer made in-process: verify's
    reference, auto's probe) must not restart the server for it; another directory still does."""
    from multiprocessing import forkserver

    default_cache_dir = pytest.importorskip(  # what torch._dynamo imports
        "torch._inductor.runtime.cache_dir_utils", reason="this torch's compiler keeps its cache directory elsewhere"
    ).default_cache_dir

    events = []
    monkeypatch.setattr(forkserver, "ensure_running", lambda: events.append("ensure"))
    monkeypatch.setattr(fork_server, "_stop", lambda server: events.append("stop"))
    monkeypatch.setattr(fork_server, "_started_with", None)
    monkeypatch.setattr(fork_server, "_preload", fork_server.PRELOAD)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    fork_server._ensure_running()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(default_cache_dir()))
    fork_server._ensure_running()
    assert events == ["ensure", "ensure"]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # the user's own: the server's import read it
    fork_server._ensure_running()
    assert events == ["ensure", "ensure", "stop", "ensure"]


def test_the_server_leaves_without_the_teardown_and_a_copy_runs_on(monkeypatch):
    """The server's atexit call flushes and ends the process at once (0, or 1 after an uncaught
    exception); in a copy, which inherits the registration and runs its atexit handlers as a
    spawned worker would, it does nothing, so the worker's own handlers and exit code stand."""
    import atexit
    import importlib.util
    import signal

    # Loaded as a copy under another name, with atexit and signal held: imported for real, it would
    # ignore SIGTERM in this process and end pytest itself through os._exit.
    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    spec = importlib.util.spec_from_file_location("server_init_under_test", fork_server.__file__.replace(
        "fork_server.py", "fork_server_init.py"))
    server_init = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(server_init)
    assert registered == [server_init._leave_at_once]

    class Exited(Exception):
        pass

    def exit_now(code):
        raise Exited(code)

    flushed = []
    monkeypatch.setattr(os, "_exit", exit_now)
    monkeypatch.setattr(sys, "stdout", type("Out", (), {"flush": lambda self: flushed.append("out")})())
    monkeypatch.setattr(sys, "stderr", type("Err", (), {"flush": lambda self: flushed.append("err")})())
    monkeypatch.delattr(sys, "last_value", raising=False)
    with pytest.raises(Exited) as exited:
        server_init._leave_at_once()  # loaded in this process: the server's view
    assert exited.value.args == (0,) and flushed == ["out", "err"]
    monkeypatch.setattr(sys, "last_value", RuntimeError("the server's loop failed"), raising=False)
    with pytest.raises(Exited) as exited:
        server_init._leave_at_once()
    assert exited.value.args == (1,)
    flushed.clear()
    monkeypatch.setattr(server_init, "SERVER_PID", os.getpid() + 1)  # a copy's view: its parent's pid
    assert server_init._leave_at_once() is None and flushed == []


def test_the_server_of_a_command_whose_workers_train_imports_torchs_compiler_front_end(monkeypatch):
    from phalanx import cli

    chosen = []
    monkeypatch.setattr(fork_server, "start_early", lambda **choice: chosen.append(choice["workers_train"]))
    monkeypatch.delenv("RANK", raising=False)
    for argv in (["train", "--devices", "cpu:2"], ["verify"], ["predict"], ["sweep"], ["run", "a.py"],
                 ["bench", "allreduce"], ["train", "--help"]):
        cli._start_fork_server(argv)
    assert chosen == [True, True, True, True, False, False]  # --help starts none
    chosen.clear()  # one device with no restarts trains in the launcher: no server
    for argv in (["train"], ["train", "--devices", "1"], ["train", "--devices=cpu:1", "--epochs", "2"],
                 ["train", "--devices", "1", "--max-restarts", "2"], ["train", "--devices", "2"],
                 ["train", "--devices", "auto"], ["train", "--max-restarts=1"], ["train", "--devices"]):
        cli._start_fork_server(argv)
    assert chosen == [True] * 5


def test_spawn_where_there_is_no_fork_server(monkeypatch):
    monkeypatch.setattr(fork_server.sys, "platform", "darwin")
    assert fork_server.start_method() == "spawn"


def test_the_hash_seed_the_server_starts_with_is_the_one_spawned_workers_get(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    drawn = fork_server._at_start_variables()["PYTHONHASHSEED"]
    assert drawn == fork_server._at_start_variables()["PYTHONHASHSEED"] and "PYTHONHASHSEED" not in os.environ
    monkeypatch.setenv("PYTHONHASHSEED", "3")
    assert fork_server._at_start_variables()["PYTHONHASHSEED"] == "3"


def test_the_launcher_state_is_what_a_spawned_worker_would_inherit(monkeypatch):
    monkeypatch.setenv("PHALANX_UNRELATED_MARK", "here")
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    old_umask = os.umask(0o027)
    try:
        state = LauncherState.capture()
    finally:
        os.umask(old_umask)
    assert state.umask == 0o027 and os.umask(old_umask) == old_umask
    assert state.environ["PHALANX_UNRELATED_MARK"] == "here" and "PYTHONHASHSEED" in state.environ
    assert "PYTHONHASHSEED" not in os.environ  # drawn for the workers, not set here
    assert state.limits[resource.RLIMIT_NOFILE] == resource.getrlimit(resource.RLIMIT_NOFILE)
    if hasattr(os, "sched_getaffinity"):
        assert state.cores == os.sched_getaffinity(0)
    assert [stream.fd for stream in state.streams] == [0, 1, 2]


def test_a_stream_closed_in_the_launcher_is_closed_in_the_copy(tmp_path):
    read_end, write_end = os.pipe()
    os.close(write_end)
    rebuild, args = fork_server._Stream(write_end).__reduce__()
    assert args == (write_end, None)  # nothing to send: the copy closes its own
    os.close(read_end)
