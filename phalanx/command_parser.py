"""The parser every `phalanx` command uses: argparse whose own errors are one line.

argparse prints its usage block and exits itself on a bad flag; a `CommandParser` raises a
`UsageError` instead, which the command line turns into one `phalanx: error: ...` line and exit
code 2, as every other refusal. It takes no prefixes (argparse's default accepts `--epoch` for
`--epochs`, so adding a flag later could break a command line that worked), and an unknown flag
close to a real one is answered with it: `unrecognized arguments: --epoch 1; did you mean
--epochs?`. Standard library only, so `phalanx --help` loads no torch.
"""

from __future__ import annotations

import argparse
import difflib
import sys

from phalanx.errors import UsageError


class CommandParser(argparse.ArgumentParser):
    """argparse with one-line errors (a `UsageError`), no prefixes, the closest flag named for an
    unknown one, and a description's lines kept as written (examples stay on their own lines)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        self.reached = True  # argparse hands a subcommand's words to its parser through this call
        self.words = list(sys.argv[1:] if args is None else args)  # what it was given (launcher_flags reads them)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        owner = self  # the innermost parser this command line reached: `phalanx bench allreduce`'s
        while chosen := [p for p in _subcommands(owner) if getattr(p, "reached", False)]:
            owner = chosen[0]
        hint = ""
        if message.startswith("unrecognized arguments: "):
            unknown = [word for word in message.split()[2:] if word.startswith("--")]
            hint = "".join(f"; did you mean {close}?" for close in map(closest_flag(owner), unknown) if close)
        raise UsageError(f"{message}{hint} (see `{owner.prog} --help`)")


# One command's flag for what another command calls otherwise: the device counts a benchmark or a
# prediction runs (`bench scaling --devices 1,2,4` beside `predict --world-sizes 1,2,4`).
SAME_MEANING = {"--devices": ("--world-sizes",), "--world-sizes": ("--devices",)}


def closest_flag(parser: argparse.ArgumentParser):
    """A function from an unknown `--flag[=value]` to the parser's flag it most likely meant, or None:
    the one another command spells otherwise for the same thing (SAME_MEANING), the flags it begins
    (the prefix argparse no longer takes; up to three, "--a or --b"), else one spelled within a
    letter or two. A switch's `--no-x` is not offered for `--x`: that is its default, not a typo."""
    names = [name for action in parser._actions for name in action.option_strings
             if name.startswith("--") and name != "--help"]

    def close(word: str) -> str | None:
        word = word.split("=", 1)[0]
        same = [name for name in SAME_MEANING.get(word, ()) if name in names]
        if same:
            return same[0]
        longer = [name for name in names if name.startswith(word)]
        if longer:
            return " or ".join(longer) if len(longer) <= 3 else None
        near = difflib.get_close_matches(word, [n for n in names if n != "--no-" + word[2:]], n=1, cutoff=0.8)
        return near[0] if near else None

    return close


def _subcommands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    return [p for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for p in dict.fromkeys(action.choices.values())]


__all__ = ["CommandParser", "closest_flag"]
