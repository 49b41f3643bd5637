"""torch.distributed.launch's `--local_rank` argument for a script under `phalanx run`, said once.

Scripts written for `python -m torch.distributed.launch` (before torchrun) read each worker's GPU
from an argument that launcher appended, `--local_rank=N` (`--local-rank=N` from torch 2.0):
`parser.add_argument("--local_rank", type=int, required=True)`, or `default=-1` with "-1 means
not distributed". torchrun sets LOCAL_RANK in the environment and passes no such argument, so under
it the first kind stops at argparse's "the following arguments are required: --local_rank" (exit 2
on every rank) and the second trains each rank alone, or every rank on GPU 0. While a script runs
under `phalanx run`, a parse of the command line (`parse_args()`, `parse_known_args()`, with no
list given) by a parser that defines either spelling and was not given it gets this worker's
`--local_rank=LOCAL_RANK`, as that launcher passed it, and rank 0 warns once at the script's line,
naming the line that runs under torchrun too. A list handed to the parser, an argument given on the
command line, and a parse an installed library makes (transformers' HfArgumentParser, whose
TrainingArguments read LOCAL_RANK themselves) are left as they are.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from typing import Iterator

from phalanx.errors import PhalanxWarning, script_line

NAMES = ("--local_rank", "--local-rank")


def passed_line(option: str) -> str:
    """What rank 0 says when the script's parser took `option` from phalanx run."""
    return (f"the script's parser takes {option}, which torch.distributed.launch appended to each worker's command "
            "line and torchrun does not pass (it sets LOCAL_RANK: there the script stops at argparse's \"required\" "
            f"error, or every rank takes the argument's default); phalanx run passed each worker {option}=LOCAL_RANK: "
            "read int(os.environ[\"LOCAL_RANK\"]) instead and the script runs under torchrun too")


@contextlib.contextmanager
def passing_local_rank(*, local_rank: int, rank: int) -> Iterator[None]:
    """While held, a command-line parse by a parser that defines `--local_rank` (or `--local-rank`)
    and was not given it gets `--local_rank=local_rank` first (module docstring); said once on rank 0."""
    original = argparse.ArgumentParser.parse_known_args
    said = [rank != 0]

    def parse_known_args(self, args=None, namespace=None):
        action = _action(self) if args is None else None
        if action is not None and not _given(action, sys.argv[1:]):
            option = next(name for name in action.option_strings if name in NAMES)
            path, line_number, library = script_line(sys._getframe(1))
            if not library:  # the script's own parse, not an installed library's (transformers' reads LOCAL_RANK)
                args = [f"{option}={local_rank}", *sys.argv[1:]]
                if not said[0]:
                    said[0] = True
                    warnings.warn_explicit(passed_line(option), PhalanxWarning, path, line_number)
        return original(self, args, namespace)

    argparse.ArgumentParser.parse_known_args = parse_known_args
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_known_args = original


def _action(parser: argparse.ArgumentParser) -> argparse.Action | None:
    """The action of `parser` that takes torch.distributed.launch's argument, if any."""
    return next((action for action in parser._actions if set(NAMES) & set(action.option_strings)), None)


def _given(action: argparse.Action, argv: list[str]) -> bool:
    """Whether `argv` (up to a "--") names `action` by any of its spellings."""
    before = argv[:argv.index("--")] if "--" in argv else argv
    return any(arg == name or arg.startswith(name + "=") for arg in before for name in action.option_strings)
