"""torchrun's launcher flags given to `phalanx run`: each named in one line with phalanx run's way.

Someone coming from torchrun types `phalanx run --nproc-per-node 2 train.py`, where argparse alone
answers "unrecognized arguments: --nproc-per-node". Every flag of torchrun's parser (torch 2.13)
is here, hidden from `--help`: given before the script, it stops the command with a `UsageError`
saying what phalanx run does instead (`--devices 2`; one host with a store of its own, many hosts
through torchrun itself; output on this console). `-m/--module` is phalanx run's own, as
torchrun's (script.py). The same flags after the script are the script's, as under torchrun.
"""

from __future__ import annotations

import argparse

from phalanx.errors import UsageError

_MANY_HOSTS = ("phalanx run starts the workers of this host, with a store of its own on a free port, so it takes no "
               "{flag}; for many hosts start the script with torchrun itself (torchrun --nnodes 2 --node-rank R "
               "--nproc-per-node N --master-addr A --master-port P script.py), where phalanx.init() joins torchrun's "
               "world: docs/many-hosts.md")
_OUTPUT = ("phalanx run takes no {flag}: every worker writes to this console as it runs (torchrun's default); print on "
           "rank 0 alone with world.print(...), and keep a log by redirecting the command (phalanx run ... > run.log "
           "2>&1)")
_OTHER = ("torchrun's {flag} has no counterpart in phalanx run, whose launcher supervises its workers itself (--timeout "
          "bounds every wait); drop it, or start the script with torchrun itself, where phalanx.init() joins its world")

# (torchrun's spellings, whether it takes a value, the line), in torchrun's --help order.
TORCHRUN_FLAGS: tuple[tuple[tuple[str, ...], bool, str], ...] = (
    (("--nnodes",), True, _MANY_HOSTS),
    (("--nproc-per-node", "--nproc_per_node"), True,
     "torchrun's --nproc-per-node {value} is --devices in phalanx run: --devices N (the GPUs when present, else N CPU "
     "workers), cpu:N, cuda:0,1 or auto (every GPU), e.g. phalanx run --devices {example} script.py"),
    (("--rdzv-backend", "--rdzv_backend"), True, _MANY_HOSTS),
    (("--rdzv-endpoint", "--rdzv_endpoint"), True, _MANY_HOSTS),
    (("--rdzv-id", "--rdzv_id"), True, _MANY_HOSTS),
    (("--rdzv-conf", "--rdzv_conf"), True, _MANY_HOSTS),
    (("--standalone",), False,
     "phalanx run is standalone already (one host, a store of its own on a free port): drop --standalone"),
    (("--max-restarts", "--max_restarts"), True,
     "phalanx run restarts no worker: a failure ends the run in one line naming the rank; for restarts start the "
     "script with torchrun --max-restarts N itself, where phalanx.init() joins its world and phalanx.resume(...) "
     "continues from the script's last phalanx.checkpoint(...)"),
    (("--monitor-interval", "--monitor_interval"), True, _OTHER),
    (("--start-method", "--start_method"), True, _OTHER),
    (("--event-log-handler", "--event_log_handler"), True, _OTHER),
    (("--role",), True, _MANY_HOSTS),
    (("--no-python", "--no_python"), False,
     "phalanx run runs a Python file, or a module with -m; start any other program with torchrun --no-python"),
    (("--run-path", "--run_path"), False,
     "phalanx run already runs the script in each worker's own interpreter, as torchrun's --run-path does: drop it"),
    (("--log-dir", "--log_dir"), True, _OUTPUT),
    (("-r", "--redirects"), True, _OUTPUT),
    (("-t", "--tee"), True, _OUTPUT),
    (("--local-ranks-filter", "--local_ranks_filter"), True, _OUTPUT),
    (("--duplicate-stdout-filters", "--duplicate_stdout_filters"), True, _OUTPUT),
    (("--duplicate-stderr-filters", "--duplicate_stderr_filters"), True, _OUTPUT),
    (("--node-rank", "--node_rank"), True, _MANY_HOSTS),
    (("--master-addr", "--master_addr"), True, _MANY_HOSTS),
    (("--master-port", "--master_port"), True, _MANY_HOSTS),
    (("--local-addr", "--local_addr"), True, _MANY_HOSTS),
    (("--logs-specs", "--logs_specs"), True, _OUTPUT),
    (("--numa-binding", "--numa_binding"), True,
     "phalanx run takes no --numa-binding: --bind-cores pins each worker to its own equal share of the cores"),
    (("--signals-to-handle", "--signals_to_handle"), True, _OTHER),
    (("--shutdown-timeout", "--shutdown_timeout"), True, _OTHER),
    (("--virtual-local-rank", "--virtual_local_rank"), False, _OTHER),
)


class _TorchrunFlag(argparse.Action):
    """A torchrun flag met before the script: the line saying phalanx run's way, as a UsageError."""

    def __init__(self, option_strings, dest, *, line: str, **kwargs) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.line = line

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        value = values if isinstance(values, str) else ""
        example = value if value.isdigit() else "2"
        raise UsageError(self.line.format(flag=option_string, value=value, example=example))


def add_torchrun_flags(parser: argparse.ArgumentParser) -> None:
    """Every torchrun flag phalanx run does not take, hidden from --help, named at use."""
    for spellings, takes_value, line in TORCHRUN_FLAGS:
        parser.add_argument(*spellings, action=_TorchrunFlag, line=line, nargs=None if takes_value else 0,
                            metavar="VALUE", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
