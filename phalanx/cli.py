"""The `phalanx` command: pick the subcommand, parse its flags, run it, and turn bad input into one line.

Nothing imports this module (the command's entry point, phalanx.__main__, installs the stop
handlers before it imports this). `COMMANDS` names each subcommand, its line in `phalanx --help`
and the module that owns its parser and runner; that module (and torch with it) is imported only
when the command is named, so `phalanx --help` and `phalanx --version` load no torch. Every
ending a user can act on is one line on stderr, no traceback: bad input (`UsageError`, a config's
`ValueError`) `phalanx: error: <problem>; <fix>`, exit 2; a checked stop or an output that could
not be written (`RunFailed`) `phalanx: run stopped: ...`, exit 1; a failed worker `phalanx:
worker rank R failed: ...` (then every rank's report), exit 1; Ctrl-C `phalanx: interrupted`,
exit 130; SIGTERM/SIGHUP `phalanx: stopped by SIGTERM; every worker was stopped`, exit 128 + the
signal's number, or, for a training run with somewhere to save, `phalanx: stopped by SIGTERM after
epoch E, step S of N, saved in DIR; run the same command with --resume auto to continue` (printed
by rank 0 alone under torchrun).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

from phalanx import __version__
from phalanx.errors import RunFailed, Stopped, UsageError
from phalanx.command_parser import CommandParser
from phalanx.dependencies import API, REQUIRED, missing_reason
from phalanx.runtime.lifeline import stop_message


@dataclass(frozen=True, kw_only=True)
class Command:
    summary: str  # its line in `phalanx --help` (and the subcommand's own help)
    module: str  # owns the parser and the runner; imported only when the command is named
    add: str  # module's function filling the subcommand's parser (generated from its configs)
    run: str  # module's function running it: parsed arguments -> exit code
    needs: tuple[str, ...] = tuple(REQUIRED)  # the dependencies it may import, checked before it starts


COMMANDS = {
    "train": Command(summary="train a model on k devices in lockstep", module="phalanx.job.command",
                     add="add_train_arguments", run="run_train"),
    "bench": Command(summary="measure allreduce, scaling against DDP, sharded memory, overlap, splits; the "
                             "automatic parallelism exercises", module="phalanx.bench.cli", add="add_bench_arguments",
                     run="run_bench"),
    "verify": Command(summary="check that k-device training equals 1-device training, step by step",
                      module="phalanx.verify.cli", add="add_verify_arguments", run="run_verify"),
    "predict": Command(summary="predict step time and images/s on k devices from one device's profile",
                       module="phalanx.predict.cli", add="add_predict_arguments", run="run_predict"),
    "sweep": Command(summary="train over devices x per-device batch x lr; plot accuracy and time",
                     module="phalanx.sweep.cli", add="add_sweep_arguments", run="run_sweep"),
    "run": Command(summary="run your own training script on k workers (phalanx.init() or your own "
                           "init_process_group joins the world)", module="phalanx.runtime.script",
                   add="add_run_arguments", run="run_run", needs=API),
}
# Commands that measure or train by starting their own workers: under a several-task Slurm step
# each task would run one beside the others (runtime/slurm.py).
STARTS_ITS_OWN_WORKERS = ("bench", "verify", "predict", "sweep")
WORKERS_TRAIN = ("train", "verify", "predict", "sweep")  # each worker makes a torch optimizer: fork_server.py


def build_parser(commands: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The `phalanx` parser with the full parsers of `commands` (None: all of them); every other
    subcommand is only its name and summary, so its module is not imported."""
    parser = CommandParser(prog="phalanx", description="Data-parallel training across k devices.")
    # The one flag of `phalanx` itself: argparse's own version action (it prints and exits).
    parser.add_argument("--version", action="version", version=f"phalanx {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=CommandParser)
    for name, command in COMMANDS.items():
        if commands is not None and name not in commands:
            sub.add_parser(name, help=command.summary, add_help=False)
        else:
            getattr(importlib.import_module(command.module), command.add)(sub.add_parser(name, help=command.summary))
    return parser


def _runner(name: str) -> Callable[[argparse.Namespace], int]:
    command = COMMANDS[name]
    return getattr(importlib.import_module(command.module), command.run)


def main(argv: list[str] | None = None) -> int:
    try:
        if argv is None:  # the command line itself, not a call from Python
            _start_fork_server(sys.argv[1:])
        return _run_command(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        print(f"phalanx: error: {exc}", file=sys.stderr)
        from phalanx.runtime.join import post_refusal

        post_refusal(str(exc))  # under torchrun: the other nodes, waiting at the join, end with this line
        return 2
    except RunFailed as exc:  # one device runs in this process: its checked stops arrive here
        print(f"phalanx: run stopped: {exc}", file=sys.stderr)
        return exc.exit_code
    except (KeyboardInterrupt, Stopped) as exc:
        line, code = stop_message(exc)
        if not _a_torchrun_peer_saw_it(exc):
            print(line, file=sys.stderr)
        return code
    except Exception as exc:
        from phalanx.runtime.launch import WorkerFailed

        if isinstance(exc, WorkerFailed):
            print(f"phalanx: {exc}", file=sys.stderr)
            return 1
        lost = _peer_lost_under_torchrun(exc)
        if lost is not None:
            print(lost, file=sys.stderr)
            return 1
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
            print(f"phalanx: run stopped: {_out_of_files(exc)}", file=sys.stderr)
            return 1
        from phalanx.runtime.host_limits import limit_reason

        limit = limit_reason(exc)  # one device trains in this process: a ulimit it meets, in one line
        if limit is not None:
            print(f"phalanx: run stopped: {limit}", file=sys.stderr)
            return 1
        raise


def _out_of_files(exc: OSError) -> str:
    """A process (or the system) out of file descriptors: the limit, and how to raise it."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if exc.errno == errno.ENFILE:
        return "the system's table of open files is full (ENFILE); close other programs' files and run again"
    return (f"too many open files: this process may hold {soft} (ulimit -n), and the workers, their pipes and the "
            "shared memory need more; raise it (ulimit -n 1024) and run again")


def _peer_lost_under_torchrun(exc: BaseException) -> str | None:
    """One line for a torchrun worker whose collective lost its peer (gloo's "Connection reset by
    peer" when another host's worker died); None for any other error, or outside torchrun. phalanx's
    own launcher names the rank that failed; under torchrun each worker knows only its side."""
    import socket

    from phalanx.comm.hosts import backend_reason
    from phalanx.job.survivors import made
    from phalanx.runtime.worker_errors import is_echo
    from phalanx.runtime.world import launcher_env

    env = launcher_env()
    if env is None or not is_echo(exc):
        return None
    saved = made()  # this rank saved the step the run reached (job/survivors.py)
    return (f"phalanx: run stopped: rank {env.rank} (on {socket.gethostname()}) lost its connection to another rank "
            f"({backend_reason(exc)}): a worker of this run stopped, or its host or the link to it failed; that "
            "worker's own output says why, and torchrun's agent ends the rest" +
            (f"; rank {env.rank} saved the run where it stopped, {saved}: torchrun's --max-restarts, or the same "
             "command with --resume auto, goes on from there" if saved else ""))


def _a_torchrun_peer_saw_it(exc: BaseException) -> bool:
    """A saved stop under torchrun, on a rank other than 0: every rank raised it, rank 0 says it."""
    if not getattr(exc, "detail", None):
        return False
    from phalanx.runtime.world import launcher_env  # World reads the launcher's variables, nobody else

    env = launcher_env()
    return env is not None and env.rank != 0


def _start_fork_server(argv: list[str]) -> None:
    """For a command that may start workers: their fork server imports torch on another core while
    this process imports the command's modules (runtime/fork_server.py). Not in a torchrun worker
    (RANK and WORLD_SIZE set, read as in __main__.py), whose run starts no workers of its own, nor
    for a `train` that runs in this process."""
    named = _subcommand(argv)
    if named not in ("train", "run", *STARTS_ITS_OWN_WORKERS) or {"-h", "--help"} & set(argv):
        return
    if named == "train" and _trains_here(argv):
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        from phalanx.runtime.fork_server import start_early

        start_early(workers_train=named in WORKERS_TRAIN)


def _trains_here(argv: list[str]) -> bool:
    """Whether `phalanx train` runs in this process, starting no worker: on one device (`--devices
    1` or `cpu:1`, or none: its default) with no `--max-restarts` (which puts even one device in a
    worker). Read from the words, before the parser loads; a form not read here (an abbreviated
    flag) starts the server as any launch does. Its imports (torch, torch._dynamo: 4-5 s of a core)
    had run beside such a run for nothing."""
    given = {"--devices": "1", "--max-restarts": "0"}
    for i, word in enumerate(argv):
        name, equals, value = word.partition("=")
        if name in given:
            given[name] = value if equals else (argv[i + 1] if i + 1 < len(argv) else "")
    return given["--devices"] in ("1", "cpu:1") and given["--max-restarts"] == "0"


def _subcommand(argv: list[str]) -> str | None:
    """The first word that is not a flag (the top level's flags take no value)."""
    return next((word for word in argv if not word.startswith("-")), None)


def _run_command(argv: list[str]) -> int:
    named = _subcommand(argv)
    if named in COMMANDS:  # before the command's module imports them
        absent = missing_reason(COMMANDS[named].needs)
        if absent is not None:
            raise UsageError(absent)
    parser = build_parser([named] if named in COMMANDS else [])
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command in STARTS_ITS_OWN_WORKERS:
        from phalanx.runtime.slurm import alone_in_slurm_step  # train and run check where their worlds form

        alone_in_slurm_step(command=args.command)
    return _runner(args.command)(args)
