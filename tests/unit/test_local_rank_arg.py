"""torch.distributed.launch's `--local_rank` argument under phalanx run (runtime/local_rank_arg.py),
in this process: a command-line parse by a parser that defines it and was not given it gets this
worker's LOCAL_RANK, said once on rank 0 at the script's line; an argument given, a list handed to the
parser, another rank, a parser without it and an installed library's parse are left alone, and argparse
is put back.
End to end on 2 workers: tests/distributed/test_local_rank_arg.py."""

from __future__ import annotations

import argparse
import sys
import warnings

import pytest

from phalanx.errors import PhalanxWarning
from phalanx.runtime.local_rank_arg import passed_line, passing_local_rank


def _parser(*names: str, **kwargs) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument(*names, type=int, dest="local_rank", **kwargs)
    parser.add_argument("--lr", type=float, default=0.1)
    return parser


def _parsed(argv: list[str], parser: argparse.ArgumentParser, *, rank: int = 0, args=None):
    with warnings.catch_warnings(record=True) as caught, passing_local_rank(local_rank=3, rank=rank):
        warnings.simplefilter("always")
        sys.argv = ["train.py", *argv]
        parsed = parser.parse_args(args)  # the script's line
        parser.parse_known_args(args)  # a second parse: said once
    return parsed, [w for w in caught if issubclass(w.category, PhalanxWarning)]


@pytest.fixture(autouse=True)
def _argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))


@pytest.mark.parametrize("names, kwargs", [(("--local_rank",), {"required": True}),
                                           (("--local-rank",), {"default": -1}),
                                           (("--local-rank", "--local_rank"), {"default": 0})])
def test_a_parser_that_takes_the_launchers_argument_gets_this_workers_local_rank_said_once(names, kwargs):
    # `required=True` stopped every rank at argparse's error (exit 2), and `default=-1` ran each rank alone.
    original = argparse.ArgumentParser.parse_known_args
    parsed, said = _parsed(["--lr", "0.5"], _parser(*names, **kwargs))
    assert (parsed.local_rank, parsed.lr) == (3, 0.5)
    assert [str(w.message) for w in said] == [passed_line(names[0])]
    assert said[0].filename == __file__ and "torchrun does not pass" in passed_line(names[0])
    assert argparse.ArgumentParser.parse_known_args is original


def test_a_given_argument_a_list_another_rank_and_other_parsers_are_left_alone():
    assert _parsed(["--local_rank=7"], _parser("--local_rank", default=-1)) == (
        argparse.Namespace(local_rank=7, lr=0.1), [])
    assert _parsed(["--local-rank", "5"], _parser("--local-rank", "--local_rank")) == (
        argparse.Namespace(local_rank=5, lr=0.1), [])
    assert _parsed([], _parser("--local_rank", default=-1), args=[]) == (argparse.Namespace(local_rank=-1, lr=0.1), [])
    parsed, said = _parsed([], _parser("--local_rank", default=-1), rank=1)
    assert parsed.local_rank == 3 and said == []
    parsed, said = _parsed(["--lr", "2"], _parser("--rank", default=-1))
    assert parsed == argparse.Namespace(local_rank=-1, lr=2.0) and said == []


def test_a_parse_an_installed_library_makes_is_left_alone(tmp_path):
    # transformers' HfArgumentParser parses the command line itself, and its TrainingArguments read
    # LOCAL_RANK: no argument to add, and nothing for the script's author to change.
    library = tmp_path / "lib" / "site-packages" / "hf_argparser.py"
    library.parent.mkdir(parents=True)
    library.write_text("def parse(parser):\n    return parser.parse_known_args()[0]\n")
    namespace = {"__name__": "transformers.hf_argparser"}
    exec(compile(library.read_text(), str(library), "exec"), namespace)
    with warnings.catch_warnings(record=True) as caught, passing_local_rank(local_rank=3, rank=0):
        warnings.simplefilter("always")
        sys.argv = ["train.py", "--lr", "2"]
        parsed = namespace["parse"](_parser("--local_rank", default=-1))
    assert parsed == argparse.Namespace(local_rank=-1, lr=2.0)
    assert [w for w in caught if issubclass(w.category, PhalanxWarning)] == []
