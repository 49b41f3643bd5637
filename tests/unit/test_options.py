"""phalanx/options.py: a config field declares its flag once; the parser, the help and the checks follow.

A small config of two components stands in for a command's: flags stay flat, a switch that is on
by default turns off with --no-..., a text parser ('none') and a flag named unlike its field work,
every help ends in its default, a None default must say what it means, a bad value is one line.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from phalanx.errors import UsageError
from phalanx.options import CommandParser, add_options, at_least, build, check_options, component, flags, option


def _cap(text: str) -> float | None:
    return None if text == "none" else float(text)


@dataclass(frozen=True, kw_only=True)
class Exchange:
    """exchange: how gradients travel"""

    overlap: bool = option(True, flag="--no-overlap", help="one allreduce after backward")
    cap_mb: float | None = option(0.25, flag="--cap", parse=_cap, help="bucket cap")
    algorithm: str = option("ring", choices=("ring", "tree"), help="the algorithm")

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True, kw_only=True)
class Job:
    """the job"""

    global_batch_size: int = option(256, flag="--batch-size", check=at_least(1), help="global batch")
    out_dir: str | None = option(None, flag="--out", default_text="nothing written", help="outputs here")
    quiet: bool = option(False, help="say less")
    unflagged: int = 7  # a field that is no flag: left at its default
    exchange: Exchange = component(Exchange)

    def __post_init__(self) -> None:
        check_options(self)
        if self.exchange.cap_mb is None and self.global_batch_size > 512:
            raise ValueError(f"--cap none with --batch-size {self.global_batch_size}: too big for one bucket")


def _parser() -> CommandParser:
    parser = CommandParser(prog="job")
    add_options(parser, Job)
    return parser


def _job(*argv: str) -> Job:
    return build(Job, _parser().parse_args(list(argv)))


def test_flags_are_flat_and_fill_the_nested_config():
    assert _job() == Job()
    job = _job("--batch-size", "64", "--no-overlap", "--cap", "none", "--algorithm", "tree", "--quiet", "--out", "o")
    assert job == Job(global_batch_size=64, out_dir="o", quiet=True, unflagged=7,
                      exchange=Exchange(overlap=False, cap_mb=None, algorithm="tree"))
    assert [flag.name for flag in flags(Job)] == ["--batch-size", "--out", "--quiet", "--no-overlap", "--cap",
                                                   "--algorithm"]
    assert [flag.dest for flag in flags(Job)][-1] == "exchange.algorithm"


def test_help_shows_every_default_and_heads_each_component():
    text = _parser().format_help()
    for shown in ("--batch-size BATCH_SIZE\n                        global batch (default: 256)",
                  "--out OUT             outputs here (default: nothing written)", "bucket cap (default: 0.25)",
                  "--algorithm {ring,tree}", "the algorithm (default: ring)", "\nexchange:\n"):
        assert shown in text, text
    assert "say less\n" in text and "one allreduce after backward\n" in text  # switches: no default to show


@pytest.mark.parametrize("argv, line", [
    (["--batch-size", "0"], "--batch-size 0 must be at least 1"),
    (["--algorithm", "star"], "--algorithm 'star' is unknown; choose one of ring, tree"),
    (["--cap", "none", "--batch-size", "1024"], "--cap none with --batch-size 1024: too big for one bucket"),
    (["--batch-size", "x"], "argument --batch-size: invalid int value: 'x' (see `job --help`)"),
    (["--quiet=yes"], "argument --quiet: ignored explicit argument 'yes' (see `job --help`)"),
    (["--overlap"], "unrecognized arguments: --overlap (see `job --help`)"),
])
def test_a_bad_flag_or_value_is_one_usage_error_line(argv, line):
    with pytest.raises(UsageError) as info:
        _job(*argv)
    assert str(info.value) == line


def test_a_config_checks_its_declared_options_on_construction_too():
    with pytest.raises(ValueError, match="--batch-size -3 must be at least 1"):
        Job(global_batch_size=-3)
    with pytest.raises(ValueError, match="--algorithm 'star' is unknown"):
        Exchange(algorithm="star")


def test_a_default_of_none_must_say_what_it_means():
    @dataclass(frozen=True, kw_only=True)
    class Vague:
        """vague"""

        threads: int | None = option(None, help="threads")

    with pytest.raises(TypeError, match="--threads defaults to None; give it default_text="):
        add_options(CommandParser(prog="vague"), Vague)


def test_a_switch_on_by_default_is_named_to_turn_it_off():
    @dataclass(frozen=True, kw_only=True)
    class Backwards:
        """backwards"""

        progress: bool = option(True, help="a progress bar")

    with pytest.raises(TypeError, match="switch --progress is on by default; name it --no-"):
        add_options(CommandParser(prog="backwards"), Backwards)
