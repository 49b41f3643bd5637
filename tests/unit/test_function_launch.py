"""phalanx.launch's refusals, made before any worker starts (tests/distributed/test_function_launch.py
runs the workers): bad options named as the function's keywords, a function spawn could not hand
to a fresh interpreter, a launching process whose forked copies could not work; and `on_cpu`."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist
from torch import nn

import phalanx
from phalanx.errors import UsageError
from phalanx.runtime import forked
from phalanx.runtime.function_launch import on_cpu


def _module_level(x):
    return x


@pytest.mark.parametrize("kwargs, said", [
    (dict(devices="cpu:0"), "devices='cpu:0' is not a CPU worker count; write cpu:N with N >= 1"),
    (dict(devices="gpu"), "devices='gpu' is not understood; use devices=N, cpu:N or cuda:0,1"),
    (dict(devices="cpu:2", timeout_s=0), "timeout_s 0 must be a finite number of seconds, at least 1"),
    (dict(devices="cpu:2", threads_per_device=0), "threads_per_device 0 must be at least 1"),
    (dict(devices="cpu:2", max_restarts=-1), "max_restarts -1 must be 0 (no restarts) or more"),
    (dict(devices="cpu:2", start_method="forkserver"), "start_method='forkserver' is not understood; use 'fork' or "
                                                        "'spawn'"),
])
def test_bad_options_are_one_line_naming_the_keyword(kwargs, said):
    with pytest.raises(UsageError) as caught:
        phalanx.launch(_module_level, 1, quiet=True, **kwargs)
    assert said in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("args, kwargs, said", [
    ((1,), dict(device="cpu:2"), "(got an unexpected keyword argument 'device')"),
    ((), dict(devices="cpu:2"), "(missing a required argument: 'x')"),
    ((1, 2), dict(devices="cpu:2"), "(too many positional arguments)"),
])
def test_arguments_the_function_cannot_take_are_refused_before_any_worker(args, kwargs, said):
    with pytest.raises(UsageError) as caught:
        phalanx.launch(_module_level, *args, quiet=True, **kwargs)
    assert str(caught.value) == (f"launch() cannot call _module_level(x) with these arguments {said}; launch's own "
                                 "keywords are devices, threads_per_device, bind_cores, timeout_s, start_method, "
                                 "max_restarts, quiet, every other one goes to the function")


def test_a_function_comes_first():
    with pytest.raises(UsageError, match=r"launch\(\) takes the function to run first, not a str; write "
                                         r"phalanx.launch\(train, \*args, devices='cpu:2'\)"):
        phalanx.launch("train.py", devices="cpu:2")


def test_spawn_refuses_a_lambda_a_closure_and_unpicklable_arguments():
    scale = 3

    def closure(x):
        return x * scale

    for fn, args in ((lambda x: x, (1,)), (closure, (1,)), (_module_level, ((i for i in range(3)),))):
        with pytest.raises(UsageError) as caught:
            phalanx.launch(fn, *args, devices="cpu:2", start_method="spawn", quiet=True)
        line = str(caught.value)
        assert line.startswith("launch() with start_method='spawn' cannot pickle the function or its arguments (")
        assert line.endswith("a fresh interpreter could not load it; define the function at the top level of a "
                             "module or script, or pass start_method='fork'")


def test_spawn_refuses_a_function_of_an_interactive_session(monkeypatch):
    import __main__
    monkeypatch.delattr(__main__, "__file__", raising=False)

    def in_a_cell():
        return 1
    in_a_cell.__module__ = "__main__"
    with pytest.raises(UsageError, match="gets 'test_spawn_refuses_a_function_of_an_interactive_session.<locals>."
                                         "in_a_cell', defined in an interactive session \\(a notebook\\)"):
        phalanx.launch(in_a_cell, devices="cpu:2", start_method="spawn", quiet=True)


def test_fork_refuses_a_process_group_open_here(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    with pytest.raises(UsageError, match=r"call torch.distributed.destroy_process_group\(\) first"):
        phalanx.launch(_module_level, 1, devices="cpu:2", start_method="fork", quiet=True)


def test_fork_refuses_gpus_once_cuda_is_initialized_here(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    forked.check_forkable(device_kind="cpu")  # CPU workers never touch the context
    with pytest.raises(UsageError, match="a forked worker cannot use CUDA then; restart the interpreter"):
        forked.check_forkable(device_kind="cuda")


def test_on_cpu_moves_tensors_and_modules_and_keeps_containers():
    point = collections.namedtuple("point", "x y")
    state = collections.OrderedDict(w=torch.ones(2))
    value = {"state": state, "pair": point(torch.zeros(1), 2), "items": [torch.ones(1), "a"],
             "model": nn.Linear(1, 1), "counts": collections.defaultdict(int, a=1)}
    moved = on_cpu(value)
    assert type(moved["state"]) is collections.OrderedDict and torch.equal(moved["state"]["w"], torch.ones(2))
    assert type(moved["pair"]) is point and moved["pair"].y == 2
    assert moved["items"][1] == "a" and isinstance(moved["model"], nn.Linear)
    assert type(moved["counts"]) is collections.defaultdict and moved["counts"]["a"] == 1


class _NotebookStream:
    """A stream like ipykernel's: no `reconfigure`, each write its own message."""

    def __init__(self) -> None:
        self.writes: list[str] = []
        self.encoding = "utf-8"

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        self.writes.append("<flush>")


def test_a_stream_that_cannot_be_reconfigured_gets_whole_lines(monkeypatch):
    import sys

    from phalanx.runtime.lifeline import line_buffered_output
    out, err = _NotebookStream(), _NotebookStream()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    line_buffered_output()
    line_buffered_output()  # a second call does not wrap twice
    print("hello from rank", 1)
    print("two\nlines", end="")
    assert out.writes == ["hello from rank 1\n", "two\n"]
    sys.stdout.flush()
    assert out.writes[2:] == ["lines", "<flush>"] and sys.stdout.encoding == "utf-8"
    print("warned", file=sys.stderr)
    assert err.writes == ["warned\n"]
