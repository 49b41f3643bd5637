"""Other launchers' flags given to `phalanx run` (torchrun's, accelerate launch's, fabric run's,
horovodrun's, deepspeed's), each named.

Someone coming from torchrun types `phalanx run --nproc-per-node 2 train.py`, from Accelerate
`--num_processes 2 --mixed_precision bf16`, from Fabric `--accelerator cpu --strategy ddp`, from
Horovod `-np 2`, from DeepSpeed `--num_gpus 2`, where argparse alone answers "unrecognized
arguments". Every flag of torchrun's parser (torch 2.13 to 2.15) is here, and those of accelerate launch
(1.15, both its spellings), fabric run (Lightning 2.6), horovodrun and deepspeed that a
single-host data-parallel run sets; hidden from `--help`, each given before the script
stops the command with a `UsageError` saying what phalanx does instead: `--devices`,
`--threads-per-device` or `--bind-cores`; one host with a store of its own (many hosts through
torchrun itself; restarts with `--max-restarts`); output on this console; precision, compilation, sharding,
accumulation and clipping set in the script. `-m/--module` is phalanx run's own, as torchrun's,
`--devices` and `--quiet` too (Fabric's and Accelerate's words, phalanx's meaning). The same flags
after the script are the script's, as under those launchers.
"""

from __future__ import annotations

import argparse

from phalanx.errors import UsageError

_COUNT = ("{launcher}'s {flag} {value} is --devices in phalanx run: --devices N (the GPUs when present, else N CPU "
          "workers), cpu:N, cuda:0,1 or auto (every GPU), e.g. phalanx run --devices {example} script.py")
_MANY_HOSTS = ("phalanx run starts the workers of this host, with a store of its own on a free port, so it takes no "
               "{flag}; for many hosts start the script with torchrun itself (torchrun --nnodes 2 --node-rank R "
               "--nproc-per-node N --master-addr A --master-port P script.py), where phalanx.init() joins torchrun's "
               "world: docs/many-hosts.md")
_OUTPUT = ("phalanx run takes no {flag}: every worker writes to this console as it runs (torchrun's default); show "
           "some ranks alone with --local-ranks-filter 0, print on rank 0 alone with world.print(...), and keep each "
           "worker's output in files of its own with --log-dir DIR (--tee, --redirects: torchrun's)")
_OTHER = ("{launcher}'s {flag} has no counterpart in phalanx run, whose launcher supervises its workers itself "
          "(--timeout bounds every wait); drop it, or start the script with torchrun itself, where phalanx.init() "
          "joins its world")
_IN_THE_SCRIPT = "phalanx run takes no {flag}: {what} is set in the script, {how}"
_PRECISION = _IN_THE_SCRIPT.format(flag="{flag}", what="mixed precision",
                                   how="phalanx.prepare(model, world=world, precision=\"bf16-mixed\")")
_SHARDING = _IN_THE_SCRIPT.format(flag="{flag}", what="sharding (ZeRO stages 1-3, FSDP's kind)",
                                  how="phalanx.prepare(model, world=world, shard=\"optimizer\" | \"gradients\" | "
                                      "\"parameters\"): docs/sharding.md")
_COMPILE = _IN_THE_SCRIPT.format(flag="{flag}", what="compilation", how="torch.compile(model) before phalanx.prepare")
_GPUS = ("phalanx run names its devices in --devices: --devices cuda:0,1 (these GPUs), N (N GPUs when present) or auto "
         "(every GPU); it takes no {flag}")
_CPUS = "phalanx run names CPU workers in --devices: --devices cpu:N (N workers); it takes no {flag}"
_BIND = "phalanx run pins each worker to its own equal share of the cores with --bind-cores; it takes no {flag}"
_HOST_DEVICES = ("phalanx run starts the workers of this host on the devices --devices names (cuda:0,2: these GPUs); "
                 "it takes no {flag} (many hosts: torchrun itself, docs/many-hosts.md)")
_ELASTIC = ("phalanx run takes no {flag}: --max-restarts N starts its workers again after a failure, and the script "
            "goes on from its last phalanx.checkpoint with phalanx.resume (a worker count that varies: torchrun "
            "--nnodes MIN:MAX itself)")
_TRANSPORT = ("phalanx run's workers meet through its own store and exchange through shared memory (CPU workers) or "
              "NCCL (GPUs); it takes no {flag}")
_WAITS = "phalanx run bounds every wait with --timeout SECONDS (the start and each collective); it takes no {flag}"
_STALLS = ("phalanx run names a rank that does not reach a collective within --timeout SECONDS and stops every "
           "worker; it takes no {flag}")


def _both(name: str) -> tuple[str, ...]:
    """A flag in Accelerate's two spellings (`--num_processes`, `--num-processes`)."""
    return (name, name.replace("_", "-")) if "_" in name else (name,)


# (launcher, spellings, whether it takes a value, the line); torchrun's in its --help order.
LAUNCHER_FLAGS: tuple[tuple[str, tuple[str, ...], bool, str], ...] = (
    ("torchrun", ("--nnodes",), True, _MANY_HOSTS),
    ("torchrun", ("--nproc-per-node", "--nproc_per_node"), True, _COUNT),
    ("torchrun", ("--rdzv-backend", "--rdzv_backend"), True, _MANY_HOSTS),
    ("torchrun", ("--rdzv-endpoint", "--rdzv_endpoint"), True, _MANY_HOSTS),
    ("torchrun", ("--rdzv-id", "--rdzv_id"), True, _MANY_HOSTS),
    ("torchrun", ("--rdzv-conf", "--rdzv_conf"), True, _MANY_HOSTS),
    ("torchrun", ("--standalone",), False,
     "phalanx run is standalone already (one host, a store of its own on a free port): drop --standalone"),
    ("torchrun", ("--max_restarts",), True, "phalanx run spells it --max-restarts N (torchrun takes {flag} too)"),
    ("torchrun", ("--monitor-interval", "--monitor_interval"), True, _OTHER),
    ("torchrun", ("--start-method", "--start_method"), True, _OTHER),
    ("torchrun", ("--event-log-handler", "--event_log_handler"), True, _OTHER),
    ("torchrun", ("--role",), True, _MANY_HOSTS),
    ("torchrun", ("--no-python", "--no_python"), False,
     "phalanx run runs a Python file, or a module with -m; start any other program with torchrun --no-python"),
    ("torchrun", ("--run-path", "--run_path"), False,
     "phalanx run already runs the script in each worker's own interpreter, as torchrun's --run-path does: drop it"),
    ("torchrun", ("--log_dir",), True, "phalanx run spells it --log-dir DIR (torchrun takes {flag} too)"),
    ("torchrun", ("-r",), True, "phalanx run spells it --redirects (torchrun takes {flag} too)"),
    ("torchrun", ("-t",), True, "phalanx run spells it --tee (torchrun takes {flag} too)"),
    ("torchrun", ("--log-line-prefix-template", "--log_line_prefix_template"), True, _OUTPUT),  # torch 2.14
    ("torchrun", ("--local_ranks_filter",), True,
     "phalanx run spells it --local-ranks-filter R,... (torchrun takes {flag} too)"),
    ("torchrun", ("--duplicate-stdout-filters", "--duplicate_stdout_filters"), True, _OUTPUT),
    ("torchrun", ("--duplicate-stderr-filters", "--duplicate_stderr_filters"), True, _OUTPUT),
    ("torchrun", ("--node-rank", "--node_rank"), True, _MANY_HOSTS),
    ("torchrun", ("--master-addr", "--master_addr"), True, _MANY_HOSTS),
    ("torchrun", ("--master-port", "--master_port"), True, _MANY_HOSTS),
    ("torchrun", ("--local-addr", "--local_addr"), True, _MANY_HOSTS),
    ("torchrun", ("--logs-specs", "--logs_specs"), True, _OUTPUT),
    ("torchrun", ("--numa-binding", "--numa_binding"), True,
     "phalanx run takes no --numa-binding: --bind-cores pins each worker to its own equal share of the cores"),
    ("torchrun", ("--signals-to-handle", "--signals_to_handle"), True, _OTHER),
    ("torchrun", ("--shutdown-timeout", "--shutdown_timeout"), True, _OTHER),
    ("torchrun", ("--virtual-local-rank", "--virtual_local_rank"), False, _OTHER),
    ("torchrun", ("--print-completion", "--print_completion"), True,  # torch 2.14
     "phalanx run prints no shell completion script: {flag} is torchrun's (phalanx --help lists the commands)"),
    # torch.distributed.launch's own (deprecated for torchrun; its other flags are torchrun's)
    ("torch.distributed.launch", ("--use-env", "--use_env"), False,
     "phalanx run gives each worker LOCAL_RANK in its environment, as {flag} asked torch.distributed.launch to (and "
     "torchrun does), and a --local-rank argument only to a script whose parser defines it (said once): drop {flag}, "
     "and let a script that parses --local-rank read int(os.environ[\"LOCAL_RANK\"])"),
    # accelerate launch's own (its flags shared with torchrun are torchrun's above)
    ("accelerate launch", _both("--num_processes"), True, _COUNT),
    ("accelerate launch", ("--cpu",), False, _CPUS),
    ("accelerate launch", _both("--multi_gpu"), False, _GPUS),
    ("accelerate launch", _both("--gpu_ids"), True, _GPUS),
    ("accelerate launch", _both("--num_cpu_threads_per_process"), True,
     "phalanx run's threads per CPU worker are --threads-per-device N (default: the cores / the workers); it takes "
     "no {flag}"),
    ("accelerate launch", _both("--enable_cpu_affinity"), False,
     _BIND),
    ("accelerate launch", _both("--num_machines"), True, _MANY_HOSTS),
    ("accelerate launch", _both("--machine_rank"), True, _MANY_HOSTS),
    ("accelerate launch", _both("--main_process_ip"), True, _MANY_HOSTS),
    ("accelerate launch", _both("--main_process_port"), True, _MANY_HOSTS),
    ("accelerate launch", _both("--same_network"), False, _MANY_HOSTS),
    ("accelerate launch", _both("--mixed_precision"), True, _PRECISION),
    ("accelerate launch", _both("--dynamo_backend"), True, _COMPILE),
    ("accelerate launch", _both("--use_deepspeed"), False, _SHARDING),
    ("accelerate launch", _both("--use_fsdp"), False, _SHARDING),
    ("accelerate launch", _both("--zero_stage"), True, _SHARDING),
    ("accelerate launch", _both("--gradient_accumulation_steps"), True,
     _IN_THE_SCRIPT.format(flag="{flag}", what="accumulation", how="for piece in dp.accumulate(n): ...")),
    ("accelerate launch", _both("--gradient_clipping"), True,
     _IN_THE_SCRIPT.format(flag="{flag}", what="clipping",
                           how="phalanx.clip_grad_norm_(dp, max_norm) before the step")),
    ("accelerate launch", _both("--config_file"), True,
     "phalanx run reads no config file: its flags are {own}, and the rest is set in the script (phalanx.prepare's "
     "keywords): drop {flag}"),
    ("accelerate launch", ("--debug",), False, _OTHER),
    # fabric run's own (its --devices is phalanx run's: N, cpu:N, cuda:0,1 or auto)
    ("fabric run", ("--accelerator",), True,
     "phalanx run names the kind of device in --devices: --devices cpu:N (CPU workers) or cuda:0,1 (GPUs); it takes "
     "no --accelerator"),
    ("fabric run", ("--strategy",), True,
     "phalanx run is data parallel, DDP's strategy, always: drop --strategy (for FSDP's or DeepSpeed's, "
     "phalanx.prepare(model, world=world, shard=...) in the script: docs/sharding.md)"),
    ("fabric run", ("--num-nodes", "--num_nodes"), True, _MANY_HOSTS),
    ("fabric run", ("--main-address", "--main_address"), True, _MANY_HOSTS),
    ("fabric run", ("--main-port", "--main_port"), True, _MANY_HOSTS),
    ("fabric run", ("--precision",), True, _PRECISION),
    # horovodrun's (Horovod 0.28.1; -hostfile and -cb only in their long spellings)
    ("horovodrun", ("-np", "--num-proc"), True, _COUNT),
    ("horovodrun", ("-H", "--hosts"), True, _MANY_HOSTS),
    ("horovodrun", ("--hostfile",), True, _MANY_HOSTS),
    ("horovodrun", ("--host-discovery-script",), True, _MANY_HOSTS),
    ("horovodrun", ("-p", "--ssh-port"), True, _MANY_HOSTS),
    ("horovodrun", ("--ssh-identity-file",), True, _MANY_HOSTS),
    ("horovodrun", ("--network-interface",), True, _MANY_HOSTS),
    ("horovodrun", ("--min-np",), True, _ELASTIC),
    ("horovodrun", ("--max-np",), True, _ELASTIC),
    ("horovodrun", ("--slots-per-host",), True, _ELASTIC),
    ("horovodrun", ("--elastic-timeout",), True, _ELASTIC),
    ("horovodrun", ("--reset-limit",), True, _ELASTIC),
    ("horovodrun", ("--gloo",), False, _TRANSPORT),
    ("horovodrun", ("--mpi",), False, _TRANSPORT),
    ("horovodrun", ("--jsrun",), False, _TRANSPORT),
    ("horovodrun", ("--tcp",), False, _TRANSPORT),
    ("horovodrun", ("--start-timeout",), True, _WAITS),
    ("horovodrun", ("--gloo-timeout-seconds",), True, _WAITS),
    ("horovodrun", ("--no-stall-check",), False, _STALLS),
    ("horovodrun", ("--stall-check-warning-time-seconds",), True, _STALLS),
    ("horovodrun", ("--stall-check-shutdown-time-seconds",), True, _STALLS),
    ("horovodrun", ("--output-filename",), True, _OUTPUT),
    ("horovodrun", ("--log-level",), True, _OUTPUT),
    ("horovodrun", ("--fusion-threshold-mb",), True,
     _IN_THE_SCRIPT.format(flag="{flag}", what="the gradient bucket's size",
                           how="phalanx.prepare(model, world=world, bucket_cap_mb=25)")),
    ("horovodrun", ("--hierarchical-allreduce",), False,
     "phalanx takes the hierarchical exchange itself where the ranks span hosts (docs/many-hosts.md); phalanx run "
     "takes no {flag}"),
    ("horovodrun", ("--timeline-filename",), True,
     "phalanx run takes no {flag}: phalanx train --trace DIR writes each rank's timeline of backward and bucket "
     "exchanges (docs/tracing.md); a script's own, torch.profiler"),
    ("horovodrun", ("--binding-args",), True, _BIND),
    ("horovodrun", ("--thread-affinity",), True, _BIND),
    ("horovodrun", ("--cycle-time-ms",), True, _OTHER),
    ("horovodrun", ("--cache-capacity",), True, _OTHER),
    ("horovodrun", ("--autotune",), False, _OTHER),
    ("horovodrun", ("--mpi-args",), True, _OTHER),
    ("horovodrun", ("--verbose",), False, _OTHER),
    ("horovodrun", ("--check-build",), False, _OTHER),
    ("horovodrun", ("--disable-cache",), False, _OTHER),
    # deepspeed's (DeepSpeed 0.19.8, and the elastic ones of earlier releases; its -H/--hostfile,
    # --num_nodes, --node_rank, --master_port/--master_addr and --no_python are above; --module and
    # --quiet are phalanx run's own)
    ("deepspeed", ("--num_gpus", "--num_accelerators"), True, _COUNT),
    ("deepspeed", ("-i", "--include"), True, _HOST_DEVICES),
    ("deepspeed", ("-e", "--exclude"), True, _HOST_DEVICES),
    ("deepspeed", ("--launcher",), True, _MANY_HOSTS),
    ("deepspeed", ("--launcher_args",), True, _MANY_HOSTS),
    ("deepspeed", ("--no_ssh_check",), False, _MANY_HOSTS),
    ("deepspeed", ("--no_ssh",), False, _MANY_HOSTS),
    ("deepspeed", ("--ssh_port",), True, _MANY_HOSTS),
    ("deepspeed", ("--venv_script",), True, _MANY_HOSTS),
    ("deepspeed", ("--log_level",), True, _OUTPUT),
    ("deepspeed", ("-q",), False, "phalanx run spells it --quiet (no first line on stderr)"),
    ("deepspeed", ("--force_multi",), False, _MANY_HOSTS),
    ("deepspeed", ("--elastic_training",), False, _ELASTIC),
    ("deepspeed", ("--min_elastic_nodes",), True, _ELASTIC),
    ("deepspeed", ("--max_elastic_nodes",), True, _ELASTIC),
    ("deepspeed", ("--no_local_rank",), False,
     "phalanx run hands a --local_rank argument only to a script whose parser defines it, said once (torchrun's way: "
     "LOCAL_RANK in the environment, world.local_rank in phalanx): drop {flag}"),
    ("deepspeed", ("--enable_each_rank_log",), True, _OUTPUT),
    ("deepspeed", ("--bind_cores_to_rank",), False, _BIND),
    ("deepspeed", ("--bind_core_list",), True, _BIND),
    ("deepspeed", ("--save_pid",), False, _OTHER),
    ("deepspeed", ("--autotuning",), True, _OTHER),
)


class _LauncherFlag(argparse.Action):
    """Another launcher's flag met before the script: the line saying phalanx run's way, as a UsageError."""

    def __init__(self, option_strings, dest, *, launcher: str, line: str, **kwargs) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.launcher, self.line = launcher, line

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        value = values if isinstance(values, str) else ""
        example = value if value.isdigit() else "2"
        own = [action.option_strings[0] for action in parser._actions  # what --help shows, read where it is declared
               if action.option_strings and action.help != argparse.SUPPRESS and action.option_strings[0] != "-h"]
        line = self.line.format(launcher=self.launcher, flag=option_string, value=value, example=example,
                                own=f"{', '.join(own[:-1])} and {own[-1]}")
        others = _other_launchers_flags(parser, option_string)
        if others:  # a torchrun command line brings several: all named at once, not one per attempt
            listed = others[0] if len(others) == 1 else f"{', '.join(others[:-1])} and {others[-1]}"
            line += (f"; the command line also gives {listed}, {'not' if len(others) == 1 else 'none of them'} "
                     f"{parser.prog}'s either (`{parser.prog} --help` lists its own)")
        raise UsageError(line)


def _other_launchers_flags(parser: argparse.ArgumentParser, first: str) -> list[str]:
    """The other launchers' flags on the command line before the script (after it, the script's own
    arguments), `first` left out, in order: from the words the parser was given (CommandParser keeps them)."""
    actions = {name: action for action in parser._actions for name in action.option_strings}
    words, found, at = getattr(parser, "words", []), [], 0
    while at < len(words) and words[at].startswith("-") and words[at] != "--":
        name = words[at].split("=", 1)[0]
        action = actions.get(name)
        if isinstance(action, _LauncherFlag) and name != first and name not in found:
            found.append(name)
        at += 2 if action is not None and action.nargs is None and "=" not in words[at] else 1
    return found


# phalanx train (a launcher too, of its own job) takes the counts and the many hosts' flags above, each
# naming train's way; the rest of the table is about a script.
_TRAIN_LINES = {
    _COUNT: ("{launcher}'s {flag} {value} is --devices in phalanx train: --devices N (the GPUs when present, else N "
             "CPU workers), cpu:N, cuda:0,1 or auto, e.g. phalanx train --devices {example}"),
    _MANY_HOSTS: ("phalanx train starts the workers of this host, so it takes no {flag}; for many hosts start it "
                  "with torchrun itself (torchrun --nnodes 2 --node-rank R --nproc-per-node N --master-addr A "
                  "--master-port P -m phalanx train ...): docs/many-hosts.md"),
}


def launcher_flags(command: str = "run") -> list[tuple[str, tuple[str, ...], bool, str]]:
    """`LAUNCHER_FLAGS` as `command` takes them: every one for run; for train the counts and the many
    hosts' flags, in train's words."""
    if command == "run":
        return list(LAUNCHER_FLAGS)
    return [(launcher, spellings, takes_value, _TRAIN_LINES[line])
            for launcher, spellings, takes_value, line in LAUNCHER_FLAGS if line in _TRAIN_LINES]


def add_launcher_flags(parser: argparse.ArgumentParser, *, command: str = "run") -> None:
    """Every flag of torchrun, accelerate launch and fabric run above (`launcher_flags(command)`'s),
    hidden from --help, named at use."""
    for launcher, spellings, takes_value, line in launcher_flags(command):
        parser.add_argument(*spellings, action=_LauncherFlag, launcher=launcher, line=line,
                            nargs=None if takes_value else 0, metavar="VALUE", default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS)
