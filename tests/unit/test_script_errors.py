"""torch's own errors re-worded for a script under `phalanx run` (runtime/script_errors.py), each
made by torch itself in this process, not written by hand: a group opened with backend "nccl" for
CPU tensors (a CPU build refuses NCCL at init; where NCCL opens, its first collective on a CPU
tensor fails), and `init_process_group` a second time after phalanx.init(). Each is re-worded only
where it applies (CPU workers; after phalanx.init()), and a look-alike raised outside torch is not.
The SyncBatchNorm case runs end to end in tests/distributed/test_run_environment.py."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.distributed as dist

from phalanx.runtime.script_errors import GROUP_AFTER_INIT, NCCL_ON_CPU, reworded


@pytest.fixture
def no_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _caught(call) -> BaseException:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that NCCL is not compiled in
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - the exception is the result
            return exc
    raise AssertionError("torch raised nothing")


def _nccl_for_cpu_tensors() -> None:
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    dist.all_reduce(torch.ones(1))  # reached only where NCCL opened: a CPU tensor


def test_nccl_on_cpu_workers_is_named_with_gloo(no_group):
    exc = _caught(_nccl_for_cpu_tensors)
    said = reworded(exc, device_type="cpu", init_ran=False)
    assert said is not None and re.fullmatch(  # the line that raised: the group's opening (a CPU build) or the call
        re.escape(NCCL_ON_CPU.split("{at}")[0]) + r" at test_script_errors\.py:3[78] \(`dist\.(init_process_group|"
        r"all_reduce)\(.*`\)" + re.escape(NCCL_ON_CPU.split("{at}")[1]), said), repr(exc)
    assert reworded(exc, device_type="cuda", init_ran=False) is None
    assert reworded(RuntimeError("Distributed package doesn't have NCCL built in"), device_type="cpu",
                    init_ran=False) is None  # not raised by torch


@pytest.mark.skipif(dist.is_nccl_available(), reason="opens an NCCL group where torch has NCCL")
def test_nccl_opened_inside_a_library_names_the_scripts_line_and_the_library(no_group, tmp_path):
    # timm's train.py (1.0.31) without --device cpu: timm.utils.distributed opens an NCCL group, and the line
    # said "open it with init_process_group("gloo")", a call the script does not make (2026-12-07).
    in_library = _loaded(_installed(tmp_path, "timm/utils/distributed.py"), "timm.utils.distributed",
                         "import torch.distributed as dist\n\ndef init_distributed_device(store):\n"
                         "    dist.init_process_group(\"nccl\", store=store, rank=0, world_size=1)\n")
    as_main = _loaded(tmp_path / "train.py", "__main__",
                      "def main(init, store):\n    return init(store)  # the user's line\n")
    exc = _caught(lambda: as_main["main"](in_library["init_distributed_device"], dist.HashStore()))
    assert reworded(exc, device_type="cpu", init_ran=False) == NCCL_ON_CPU.format(
        at=" at train.py:2 (`return init(store)  # the user's line`) (in timm.utils.distributed, line 4)")
    assert "as timm's train.py from --device, takes that option's CPU value" in NCCL_ON_CPU


def _installed(root, name: str):
    """A path for module file `name` as an installed package's (under a site-packages folder)."""
    path = root / "lib" / "site-packages" / name
    path.parent.mkdir(parents=True)
    return path


def _loaded(path, module: str, code: str) -> dict:
    """`code` written to `path` and run as module `module`: its namespace, its frames at `path`."""
    path.write_text(code)
    namespace = {"__name__": module}
    exec(compile(code, str(path), "exec"), namespace)
    return namespace


def test_a_refusal_raised_in_a_module_of_the_users_own_names_that_modules_line(no_group, tmp_path):
    # The script's own package (not installed) wraps the model: the line to change is there, not at
    # the script's call (before 2026-12-07 the __main__ frame was named, with the module as a library).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    in_module = _loaded(tmp_path / "wrapping.py", "mytrainer.wrapping",
                        "from torch.nn.parallel import DistributedDataParallel as DDP\n\ndef wrap(model):\n"
                        "    return DDP(model, device_ids=[0])  # the line\n")
    as_main = _loaded(tmp_path / "train.py", "__main__", "def main(wrap, model):\n    return wrap(model)\n")
    exc = _caught(lambda: as_main["main"](in_module["wrap"], torch.nn.Linear(2, 2)))
    assert reworded(exc, device_type="cpu", init_ran=False).startswith(
        "the script wraps a model on the CPU as DistributedDataParallel(model, device_ids=[...]) at wrapping.py:4 "
        "(`return DDP(model, device_ids=[0])  # the line`): device_ids names GPUs")


def _raised_in_torch(exc: BaseException) -> BaseException:
    """`exc` raised from a frame of torch.distributed.distributed_c10d, where torch raises it: a build
    this process does not have (a CUDA build on a host without a GPU) cannot make it here."""
    import torch.distributed.distributed_c10d as c10d

    try:
        exec(compile("raise exc", c10d.__file__, "exec"), {"__name__": c10d.__name__, "exc": exc})
    except BaseException as raised:  # noqa: BLE001 - the exception is the result
        return raised
    raise AssertionError("nothing raised")


@pytest.mark.parametrize("exc", [
    RuntimeError("Distributed package doesn't have NCCL built in"),          # a CPU build (CI's 2.13.0+cpu)
    ValueError("ProcessGroupNCCL is only supported with GPUs, no GPUs found!"),  # PyPI's 2.4.1, 2.11.0 on a CPU host
    RuntimeError("nccl2 requires at least one CUDA device"),  # PyPI's 2.15.0 on a CPU host (torchcomms' NCCL group)
], ids=["cpu-build", "cuda-build-no-gpu", "cuda-build-2.15-no-gpu"])
def test_nccl_refused_by_every_build_is_named_with_gloo(exc):
    """Found on torch 2.11.0 and 2.4.1 (PyPI's CUDA builds, the usual `pip install torch`) on a CPU
    host: their ValueError reached the user as a traceback, since only a RuntimeError was re-worded;
    and on 2.15.0, whose "nccl" backend is a new group with its own words (2026-12-05)."""
    raised = _raised_in_torch(exc)
    assert reworded(raised, device_type="cpu", init_ran=False).startswith(
        "the script's process group uses backend \"nccl\" at test_script_errors.py:")
    assert reworded(raised, device_type="cuda", init_ran=False) is None
    assert reworded(type(exc)(str(exc)), device_type="cpu", init_ran=False) is None  # not raised by torch


def test_a_second_group_after_phalanx_init_is_named(no_group):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    exc = _caught(lambda: dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1))
    assert reworded(exc, device_type="cpu", init_ran=True) == GROUP_AFTER_INIT
    assert reworded(exc, device_type="cpu", init_ran=False) is None  # the script's own two calls: torch's words


no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: torch gives these scripts one")


@no_gpu
@pytest.mark.parametrize("asks", [
    lambda: torch.cuda.set_device(0),                          # nanoGPT's and the DDP tutorials' line
    lambda: torch.nn.Linear(2, 2).to(0),                       # the DDP tutorial's `ToyModel().to(rank)`
    lambda: torch.zeros(1).cuda(),
    lambda: torch.zeros(1).to("cuda:1"),
], ids=["set_device", "module-to-rank", "cuda", "to-cuda"])
def test_a_gpu_asked_for_on_cpu_workers_is_named_with_the_scripts_line(asks):
    # nanoGPT's train.py under `phalanx run --devices cpu:2 ... --backend=gloo` ended in torch's
    # "AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'" and a traceback (torchrun's too).
    exc = _caught(asks)
    line = reworded(exc, device_type="cpu", init_ran=False)
    assert line is not None, repr(exc)
    assert line.startswith("the script asks for a GPU at test_script_errors.py:"), line
    assert "these workers are CPU workers (" in line and "phalanx.init().device" in line
    assert reworded(exc, device_type="cuda", init_ran=False) is None  # GPU workers: torch's own words


@no_gpu
@pytest.mark.parametrize("said", ["Found no NVIDIA driver on your system.", "No CUDA GPUs are available"])
def test_a_cuda_build_without_a_gpu_is_named_too(said):
    """What a CUDA build says on a host without a GPU (its lazy start, in torch.cuda), made here in a
    frame of torch.cuda, since this build cannot say it."""
    import torch.cuda as cuda

    try:
        exec(compile("raise RuntimeError(said)", cuda.__file__, "exec"), {"__name__": cuda.__name__, "said": said})
    except RuntimeError as raised:
        line = reworded(raised, device_type="cpu", init_ran=False)
    assert line is not None and line.startswith("the script asks for a GPU"), line
    assert reworded(ValueError(said), device_type="cpu", init_ran=False) is None  # another type: not torch's


def _ddp_device_ids():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return _caught(lambda: torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2), device_ids=[0]))


def _group_bound_to_the_cpu():
    # pytorch/examples' FSDP2 script, made to run on CPU, opens its group with device_id=torch.device("cpu").
    exc = _caught(lambda: dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                                  device_id=torch.device("cpu")))
    assert not dist.is_initialized()
    return exc


@pytest.mark.parametrize("make, starts, ends", [
    (_ddp_device_ids, "the script wraps a model on the CPU as DistributedDataParallel(model, device_ids=[...])",
     "leave it out (None) on CPU workers, or wrap the model with phalanx.prepare(model), which needs neither"),
    (_group_bound_to_the_cpu, "the script opens its process group with init_process_group(..., device_id=<the CPU>)",
     "leave it out on CPU workers, where the group needs no device, or call phalanx.init(), which binds the GPU on "
     "GPUs only")])
def test_a_gpu_only_argument_on_a_cpu_worker_is_named_at_the_scripts_line(no_group, make, starts, ends):
    exc = make()  # torch's ValueError, which names no fix
    line = reworded(exc, device_type="cpu", init_ran=False)
    assert isinstance(exc, ValueError) and line is not None, repr(exc)
    assert line.startswith(f"{starts} at test_script_errors.py:"), line
    assert line.endswith(ends), line
    assert reworded(exc, device_type="cuda", init_ran=False) is None
    assert reworded(ValueError(str(exc)), device_type="cpu", init_ran=False) is None  # not raised by torch


def test_a_refusal_raised_inside_a_library_names_the_scripts_line_and_the_librarys(no_group, tmp_path):
    # timm's train.py (1.0.31, 2026-12-05) wraps DDP inside timm.task.classification: the line named
    # that file alone (classification.py:97), never the script's line a user changes (train.py:1028).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    in_library = _loaded(_installed(tmp_path, "timm/task/classification.py"), "timm.task.classification",
                         "import torch\n\ndef wrap(model, device_ids):\n"
                         "    return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)\n")
    as_main = _loaded(tmp_path / "train.py", "__main__",
                      "def main(wrap, model):\n    return wrap(model, [0])  # the user's line\n")
    exc = _caught(lambda: as_main["main"](in_library["wrap"], torch.nn.Linear(2, 2)))
    assert reworded(exc, device_type="cpu", init_ran=False).startswith(
        "the script wraps a model on the CPU as DistributedDataParallel(model, device_ids=[...]) at train.py:2 "
        "(`return wrap(model, [0])  # the user's line`) (in timm.task.classification, line 4): device_ids names GPUs")


def test_only_gloos_own_timeout_is_reworded_as_the_timeout():
    from phalanx.runtime.script_errors import stalled

    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms "
                        "for recv operation to complete")
    assert stalled(gloo, timeout_s=20.0).startswith("a rank waited 20 s in a collective of the script's own process group")
    assert stalled(RuntimeError("Timed out waiting for my own queue"), timeout_s=20.0) is None  # the script's own
    assert stalled(ValueError(str(gloo)), timeout_s=20.0) is None


class _World:
    def __init__(self, board) -> None:
        self.board = board


def _two_boards():
    """Rank 0's and rank 1's views of one board in plain memory (runtime/board.py), as two local
    ranks share it through /dev/shm."""
    from phalanx.runtime.board import LINE_WORDS, Board

    memory = bytearray(LINE_WORDS * 8 * 2)
    return tuple(Board(memory, rank=r, local_rank=r, local_world_size=2, world_size=2, pid=100 + r) for r in (0, 1))


GLOO_TIMEOUT = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                            "15000ms for recv operation to complete")


def test_a_timeout_in_a_call_of_the_scripts_own_after_phalanx_init_names_the_rank_and_where_its_peer_was():
    # `if rank == 0: dist.all_reduce(t)` under phalanx.init(): the line said "the script's own process group ...
    # pass timeout= to init_process_group" (a call the script never made) and named neither rank.
    from phalanx.runtime.board import FAILED, FINISHED, Ticket
    from phalanx.runtime.script_errors import stalled
    from phalanx.runtime.tags import Tag

    def said(build) -> str:
        me, peer = _two_boards()
        build(me, peer)
        return stalled(GLOO_TIMEOUT, timeout_s=15.0, rank=0, world=_World(me))

    def waits(me, peer) -> Ticket:
        ticket = peer.enter(1, Tag("gradient", 0, step=9), 864)
        peer.block(ticket)
        return ticket

    named = ("rank 0 waited 15 s in a torch.distributed collective of the script's own for another rank, the "
             "--timeout of the process group phalanx.init() opened, while rank 1 waited in step 10's gradient "
             "bucket 0 (864 B), a collective of phalanx's: the ranks made different collective calls (a "
             "torch.distributed call on some ranks only?); every rank must make the same collective calls in "
             "the same order")
    assert said(waits) == named
    # The peer's own deadline ran out first, in a collective this rank never entered: it cannot have
    # completed, so the peer waited there (the line said "another rank was busy" in 1 of 3 runs).
    assert said(lambda me, peer: (waits(me, peer), peer.unblock(), peer.mark(FAILED))) == named
    # ... read between the end of its wait and its FAILED mark (CI read "another rank was busy" there).
    assert said(lambda me, peer: (waits(me, peer), peer.unblock())) == named
    finished = said(lambda me, peer: peer.mark(FINISHED))
    assert ", while rank 1 had finished its work without making that call" in finished
    # Busy after a collective this rank entered too (it completed; the peer works or failed elsewhere).
    busy_now = said(lambda me, peer: (me.enter(1, Tag("gradient", 0, step=9), 864), waits(me, peer),
                                      peer.unblock()))
    failed_later = said(lambda me, peer: (me.enter(1, Tag("gradient", 0, step=9), 864), waits(me, peer),
                                          peer.unblock(), peer.mark(FAILED)))
    for busy in (busy_now, failed_later):
        assert busy.endswith("opened: another rank was busy that long (a dataset's preprocessing, an evaluation or "
                             "a save on one rank alone?) or never made the call; raise --timeout")
        assert "init_process_group" not in busy



@pytest.mark.parametrize("quiet", [False, True])
def test_a_reset_in_the_fd_server_thread_is_quiet_and_other_errors_are_not(quiet, monkeypatch):
    # This process serves a file descriptor, as a DataLoader worker serves a batch's shared memory
    # to its rank; the client connects and vanishes mid-handshake, as a rank stopped by torch's
    # SIGCHLD check did in CI (the server thread's traceback under phalanx's one line).
    import os
    import socket
    import struct
    import sys
    import time
    from multiprocessing import resource_sharer

    from phalanx.runtime.script_errors import quiet_fd_sharing_resets

    reached = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: reached.append(kind))
    if quiet:
        quiet_fd_sharing_resets()
        quiet_fd_sharing_resets()  # once is enough: a second call wraps nothing
        assert sys.excepthook.quiet_fd_sharing_resets
    read_end, write_end = os.pipe()
    try:
        shared = resource_sharer.DupFd(write_end)
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(resource_sharer._resource_sharer._address)
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            time.sleep(0.3)  # the server's challenge sent and unread: closing resets the connection
        deadline = time.monotonic() + 5
        while not reached and not quiet and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert [kind.__name__ for kind in reached] == ([] if quiet else ["ConnectionResetError"])
        served = shared.detach()  # the server thread goes on serving a later request
        os.write(served, b"x")
        assert os.read(read_end, 1) == b"x"
        os.close(served)
        sys.excepthook(ValueError, ValueError("any other error"), None)
        assert reached[-1] is ValueError
    finally:
        resource_sharer.stop(timeout=5)
        os.close(read_end)
        os.close(write_end)


class _Wrapper(torch.nn.Module):
    """DDP's names without a process group: the model as the child `module`."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


def test_a_checkpoint_that_differs_from_the_model_by_ddps_prefix_is_named_at_the_scripts_line(tmp_path):
    # The commonest DDP question: a DDP checkpoint loaded into the bare model (or the reverse) listed every
    # key twice, as missing and as unexpected, and said nothing of "module." (a traceback before 2026-12-07).
    as_main = _loaded(tmp_path / "evaluate.py", "__main__",
                      "def main(model, state):\n    model.load_state_dict(state)  # the user's line\n")
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    wrapped_state = _Wrapper(model).state_dict()
    saved_by_ddp = _caught(lambda: as_main["main"](model, wrapped_state))
    assert reworded(saved_by_ddp, device_type="cpu", init_ran=False) == (
        "the checkpoint's keys carry DDP's \"module.\" prefix and the model's do not at evaluate.py:2 "
        "(`model.load_state_dict(state)  # the user's line`) (e.g. \"module.0.bias\" for \"0.bias\"): it was saved "
        "from a DistributedDataParallel's state_dict(); strip the prefix before loading (torch.nn.modules.utils."
        "consume_prefix_in_state_dict_if_present(state, \"module.\")), or save ddp.module.state_dict() instead "
        "(phalanx's replica, dp.load_state_dict, takes either)")
    into_wrapper = _caught(lambda: as_main["main"](_Wrapper(model), model.state_dict()))
    assert reworded(into_wrapper, device_type="cuda", init_ran=True).startswith(
        "the model's keys carry DDP's \"module.\" prefix and the checkpoint's do not at evaluate.py:2")
    other = dict(wrapped_state)
    other.pop("module.0.bias")  # another difference besides the prefix: torch's own error stands
    assert reworded(_caught(lambda: as_main["main"](model, other)), device_type="cpu", init_ran=False) is None
    assert reworded(RuntimeError(str(saved_by_ddp)), device_type="cpu", init_ran=False) is None  # not torch's


class _Heads(torch.nn.Module):
    """A trunk and two heads; forward uses head `use` only (the other gets no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = torch.nn.Linear(4, 4).requires_grad_(False)  # first, and not in DDP's list: the indices skip it
        self.trunk, self.heads = torch.nn.Linear(4, 4), torch.nn.ModuleList([torch.nn.Linear(4, 2) for _ in range(2)])
        self.use = 0

    def forward(self, x):
        return self.heads[self.use](self.trunk(self.frozen(x)))


def test_ddps_unused_parameters_error_names_them_and_the_fixes_at_the_scripts_line(tmp_path, no_group):
    # DDP's commonest error: a 12-line paragraph listing the parameters by index ("2 3") unless
    # TORCH_DISTRIBUTED_DEBUG is set (a traceback before 2026-12-07).
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    as_main = _loaded(tmp_path / "train.py", "__main__",
                      "def step(model, x):\n    model(x).sum().backward()  # the user's line\n")
    model = DistributedDataParallel(_Heads())
    as_main["step"](model, torch.randn(2, 4))
    exc = _caught(lambda: as_main["step"](model, torch.randn(2, 4)))
    assert "Parameter indices which did not receive grad for rank 0: 4 5" in str(exc)  # torch's own: by index
    assert reworded(exc, device_type="cpu", init_ran=False) == (
        "DistributedDataParallel stopped at the next step at train.py:2 (`model(x).sum().backward()  # the user's "
        "line`): 2 parameters got no gradient from the previous step's loss on rank 0 (heads.1.weight, heads.1.bias), "
        "and DDP waits for every parameter's unless told; pass find_unused_parameters=True to "
        "DistributedDataParallel(...), set requires_grad=False on parameters no step uses, or wrap the model with "
        "phalanx.prepare(model), which needs neither")
    assert reworded(RuntimeError(str(exc)), device_type="cpu", init_ran=False) is None  # not raised by DDP
