"""What `phalanx --help`, `--version`, `phalanx run --help`, `phalanx train --help` and every --timeout say.
The top-level help in a fresh interpreter (it lists every command and loads no
torch) is tests/distributed/test_cli.py's."""

from __future__ import annotations

import argparse
import re

import pytest

import phalanx
from phalanx.cli import COMMANDS, build_parser, main


def test_the_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    text = capsys.readouterr().out
    assert info.value.code == 0 and all(name in text for name in COMMANDS), text


def test_version_prints_the_version_and_exits_0(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert (info.value.code, capsys.readouterr().out) == (0, f"phalanx {phalanx.__version__}\n")


def test_run_help_says_what_a_script_gets_and_where_to_read_more(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = capsys.readouterr().out
    for said in ("Run your own training script on k workers", "example: phalanx run --devices cpu:2 train.py",
                 "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "phalanx.init()",
                 "init_process_group", "docs/api.md", "--timeout SECONDS", "(default: 120.0)", "script", "args"):
        assert said in text, text


def test_train_help_has_a_description_an_example_and_the_docs(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert "Train a model on k devices in lockstep" in text and "example: phalanx train --devices" in text
    assert "docs/command.md" in text


def _timeouts(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _timeouts(sub, (*path, name))
        elif "--timeout" in action.option_strings:
            yield " ".join(path), parser


def test_every_help_with_a_timeout_shows_its_default():
    found = list(_timeouts(build_parser()))
    assert {"train", "run"} <= {path for path, _ in found}
    for path, parser in found:
        text = parser.format_help()
        entry = re.search(r"^  --timeout .*?(?=^  -|^$)", text, re.MULTILINE | re.DOTALL)  # the flag's help
        assert entry and "(default: " in entry.group(0), f"phalanx {path} --help:\n{text}"


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """Every command's own parser, nested ones (bench's kinds) included: (path, parser)."""
    subcommands = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    if not subcommands:
        yield path, parser
    for action in subcommands:
        for name, sub in action.choices.items():
            yield from _commands(sub, (*path, name))


def test_every_command_and_benchmark_shows_each_options_default_in_its_help():
    from phalanx.bench.cli import BENCHMARKS

    found = dict(_commands(build_parser()))
    # Generated from the tables, not listed by hand: a new command or benchmark is checked too.
    assert set(found) == {(name,) for name in COMMANDS if name != "bench"} | {("bench", name) for name in BENCHMARKS}
    for path, parser in found.items():
        text = parser.format_help()
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0 or action.help == argparse.SUPPRESS:
                continue  # positionals, switches (off until given), -h, hidden (torchrun's flags at phalanx run)
            entry = re.search(rf"^  {re.escape(action.option_strings[0])}\b.*?(?=^  -|^\S|\Z)", text,
                              re.MULTILINE | re.DOTALL)  # the flag's help, over however many lines
            shown = " ".join(entry.group(0).split()) if entry else ""  # argparse wraps lines anywhere
            assert "(default: " in shown, f"phalanx {' '.join(path)} --help, {action.option_strings}: {shown}"


def test_each_benchmark_takes_exactly_its_configs_options_and_out():
    from phalanx.bench.cli import BENCHMARKS, BenchOutput
    from phalanx.options import flags

    found = dict(_commands(build_parser(["bench"])))
    for name, benchmark in BENCHMARKS.items():
        taken = {a.option_strings[0] for a in found[("bench", name)]._actions if a.option_strings} - {"-h"}
        assert taken == {flag.name for flag in flags(benchmark.config)} | {flag.name for flag in flags(BenchOutput)}
        assert found[("bench", name)].description == benchmark.summary == benchmark.config.__doc__.splitlines()[0]
