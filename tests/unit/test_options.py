"""phalanx/options.py: a config field declares its flag once; the parser, the help and the checks follow.

A small config of two components stands in for a command's: flags stay flat, a switch that is on
by default turns off with --no-..., a text parser ('none') and a flag named unlike its field work,
every help ends in its default, a None default must say what it means, a bad value is one line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from phalanx.command_parser import CommandParser
from phalanx.errors import UsageError
from phalanx.options import add_options, at_least, build, check_options, component, flags, option


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


def test_a_list_option_reads_commas_checks_each_item_and_shows_its_default():
    @dataclass(frozen=True, kw_only=True)
    class Sizes:
        """sizes"""

        world_sizes: tuple[int, ...] = option((2, 3), items=int, check=at_least(2), help="counts")
        kinds: tuple[str, ...] = option(("a",), items=str, choices=("a", "b"), help="kinds")

        def __post_init__(self) -> None:
            check_options(self)

    parser = CommandParser(prog="sizes")
    add_options(parser, Sizes)
    assert build(Sizes, parser.parse_args(["--world-sizes", "2, 4,", "--kinds", "b,a"])) == Sizes(
        world_sizes=(2, 4), kinds=("b", "a"))
    text = parser.format_help()
    assert "counts (default: 2,3)" in text and "--kinds {a,b}[,...]" in text
    for argv, line in ((["--world-sizes", "2,x"], "--world-sizes '2,x' is not a comma-separated list of int"),
                       (["--world-sizes", ","], "--world-sizes is empty; give at least one value"),
                       (["--world-sizes", "2,1"], "--world-sizes 2,1: 1 must be at least 2"),
                       (["--kinds", "c"], "--kinds 'c' is unknown; choose one of a, b")):
        with pytest.raises(UsageError) as info:
            build(Sizes, parser.parse_args(argv))
        assert str(info.value) == line
    with pytest.raises(ValueError, match="--world-sizes is empty"):
        Sizes(world_sizes=())


def test_a_component_made_into_another_value_shows_its_own_options():
    @dataclass(frozen=True, kw_only=True)
    class Link:
        """link: a preset's numbers"""

        gbps: float = option(10.0, help="bandwidth")

        def seconds_per_gb(self) -> float:
            return 1 / self.gbps

    @dataclass(frozen=True, kw_only=True)
    class Plan:
        """plan"""

        link: float = component(Link, into=Link.seconds_per_gb)

    parser = CommandParser(prog="plan")
    add_options(parser, Plan)
    assert Plan().link == 0.1 and build(Plan, parser.parse_args(["--gbps", "4"])).link == 0.25
    assert "\nlink:\n  --gbps GBPS  bandwidth (default: 10.0)" in parser.format_help()


def test_a_new_field_of_a_commands_config_is_a_flag_with_no_other_edit(monkeypatch, capsys):
    """A field added to a benchmark's config (its table entry) or to a command's config appears in
    that command's parser and help, with its default, and reaches the config."""
    from phalanx.bench import cli as bench_cli
    from phalanx.bench.allreduce import AllreduceBenchConfig
    from phalanx.cli import build_parser, main
    from phalanx.sweep import cli as sweep_cli
    from phalanx.sweep.grid import SweepConfig

    @dataclass(frozen=True, kw_only=True)
    class WithKnob(AllreduceBenchConfig):
        """allreduce, with one knob more"""

        knob_mb: float = option(1.5, check=at_least(0), help="a knob added later")

    @dataclass(frozen=True, kw_only=True)
    class SweepWithKnob(SweepConfig):
        """the grid, with one knob more"""

        knob: str = option("low", choices=("low", "high"), help="a knob added later")

    monkeypatch.setitem(bench_cli.BENCHMARKS, "allreduce",
                        dataclasses.replace(bench_cli.BENCHMARKS["allreduce"], config=WithKnob))
    monkeypatch.setattr(sweep_cli, "SweepConfig", SweepWithKnob)
    for words, cls, argv, field, value, shown in (
            (["bench", "allreduce"], WithKnob, ["--knob-mb", "2"], "knob_mb", 2.0,
             "--knob-mb KNOB_MB a knob added later (default: 1.5)"),
            (["sweep"], SweepWithKnob, ["--knob", "high"], "knob", "high",
             "--knob {low,high} a knob added later (default: low)")):
        parser = build_parser(words[:1])
        assert getattr(build(cls, parser.parse_args([*words, *argv])), field) == value
        assert build(cls, parser.parse_args(words)) == cls()
        with pytest.raises(SystemExit):
            main([*words, "--help"])
        assert shown in " ".join(capsys.readouterr().out.split())
    with pytest.raises(UsageError, match="--knob-mb -1.0 must be at least 0"):
        build(WithKnob, build_parser(["bench"]).parse_args(["bench", "allreduce", "--knob-mb", "-1"]))


@dataclass(frozen=True, kw_only=True)
class Switches:
    """switches"""

    fused: bool | None = option(None, default_text="decided per host", help="fuse the exchange")


def test_a_switch_defaulting_to_none_has_three_states():
    parser = CommandParser(prog="job")
    add_options(parser, Switches)
    assert [build(Switches, parser.parse_args(argv)).fused for argv in ([], ["--fused"], ["--no-fused"])] == \
        [None, True, False]
    assert [flag.name for flag in flags(Switches)] == ["--fused"]
    assert "--fused, --no-fused" in parser.format_help() and "(default: decided per host)" in parser.format_help()
    with pytest.raises(UsageError, match="ignored explicit argument 'yes'"):
        parser.parse_args(["--no-fused=yes"])


@pytest.mark.parametrize("argv, line", [
    (["train", "--epoch", "1"], "unrecognized arguments: --epoch 1; did you mean --epochs? (see `phalanx train --help`)"),
    (["train", "--bach-size=8"], "unrecognized arguments: --bach-size=8; did you mean --batch-size? "
                                  "(see `phalanx train --help`)"),
    (["bench", "allreduce", "--world-size", "2"],
     "unrecognized arguments: --world-size 2; did you mean --world-sizes? (see `phalanx bench allreduce --help`)"),
    (["train", "--no-such-thing"], "unrecognized arguments: --no-such-thing (see `phalanx train --help`)"),
    # one command's name for the device counts named where another command spells them otherwise
    (["predict", "--devices", "1,2"],
     "unrecognized arguments: --devices 1,2; did you mean --world-sizes? (see `phalanx predict --help`)"),
    (["bench", "scaling", "--world-sizes", "1,2"],
     "unrecognized arguments: --world-sizes 1,2; did you mean --devices? (see `phalanx bench scaling --help`)"),
])
def test_no_prefixes_and_an_unknown_flag_names_the_closest(argv, line):
    # argparse took `--epoch` for `--epochs` silently, so a flag added later could change what a
    # command line meant; now it is refused, naming the flag meant, and the innermost command's help
    from phalanx.cli import build_parser

    with pytest.raises(UsageError) as info:
        build_parser([argv[0]]).parse_args(argv)
    assert str(info.value) == line


def test_a_switch_is_not_offered_its_own_negation():
    from phalanx.command_parser import closest_flag

    parser = CommandParser(prog="job")
    parser.add_argument("--no-shuffle", action="store_true")  # --shuffle is the default, not a typo of it
    parser.add_argument("--epochs")
    parser.add_argument("--epsilon")
    close = closest_flag(parser)
    assert close("--shuffle") is None and close("--no-shufle") == "--no-shuffle"
    assert close("--epoch") == "--epochs" and close("--eps") == "--epsilon" and close("--ep") == "--epochs or --epsilon"
