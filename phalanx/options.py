"""Each option declared once: a config field carries its flag, help, default and check; parsers are generated.

A command's configuration is a kw_only dataclass whose fields are either `option(...)`s (one flag
each: the field's name, type and default are the flag's; its metadata adds the help, the flag's
name where it differs from the field's, the allowed values and `Rule`s) or `component(Cls)`s (a
nested config beside the code it configures, as torchtitan composes its job config). Flags stay
flat on the command line (`--no-overlap`, not `--data_parallel.overlap`).

- `add_options(parser, Cls)`: one argparse argument per option of Cls and of its components (one
  help group per component, headed by its docstring's first words), every help ending in its default.
- `build(Cls, namespace)`: the config from parsed arguments; a config's `ValueError` becomes a
  `UsageError` (one line on stderr, exit 2).
- `check_options(config)`: the declared checks of one config's own options, with the messages
  `{flag} {value} must be ...` / `{flag} 'x' is unknown; choose one of ...`; each config's
  `__post_init__` calls it first, then checks what spans several options. The refusal is an
  `OptionError`, which an API that builds a config from its keywords re-words in their names.
- `CommandParser`: argparse whose own errors (a bad number, an unknown flag) are a `UsageError`, and
  whose help shows every default (`HelpFormatter`), hand-written arguments' too.

Standard library only: importing it costs no torch, so `phalanx --help` stays fast. tyro,
jsonargparse and simple-parsing were weighed and not taken: each names a flag after the field's
path (`--exchange.overlap`, `--exchange.no-overlap`, `--nooverlap`) unless told otherwise field by
field, where phalanx keeps its own names (`--batch-size` fills `global_batch_size`, `--no-overlap`
clears `overlap`, `--timeout` is `timeout_s`); tyro reports a bad value in a multi-line panel; each
costs 60-75 ms to import (argparse: 7 ms). HF's HfArgumentParser is the closest shape (several
flat dataclasses, help in field metadata) but lives inside transformers.
"""

from __future__ import annotations

import argparse
import math
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Callable, Iterator, Sequence

from phalanx.errors import UsageError

_KEY = "phalanx.option"


@dataclass(frozen=True, kw_only=True)
class Rule:
    """A check of one option's value: `ok(value)`, else the message `{flag} {value} {problem}`."""

    ok: Callable[[Any], bool]
    problem: str


def at_least(low: float, *, problem: str | None = None) -> Rule:
    return Rule(ok=lambda value: value >= low, problem=problem or f"must be at least {low}")


def positive(what: str) -> Rule:
    """Above zero (NaN is refused too): `must be a positive {what}`."""
    return Rule(ok=lambda value: value > 0, problem=f"must be a positive {what}")


def finite(rule: Rule) -> Rule:
    """`rule`, and refusing inf and NaN as well."""
    return Rule(ok=lambda value: math.isfinite(value) and rule.ok(value), problem=rule.problem)


@dataclass(frozen=True, kw_only=True)
class Option:
    """How one config field appears on the command line (a field's `metadata[_KEY]`)."""

    help: str
    flag: str | None = None  # None: "--" + the field's name with dashes
    metavar: str | None = None
    default_text: str | None = None  # how --help shows the default (needed where it is None)
    choices: tuple[str, ...] | None = None
    rules: tuple[Rule, ...] = ()
    parse: Callable[[str], Any] | None = None  # text -> value, where the field's type is not enough


def option(default: Any, *, help: str, flag: str | None = None, metavar: str | None = None,
           default_text: str | None = None, choices: Sequence[str] | None = None,
           check: Rule | Sequence[Rule] = (), parse: Callable[[str], Any] | None = None) -> Any:
    """A config field that is a flag. A bool is a switch: default False turns on with `--name`,
    default True turns off with `--no-name` (its `flag`)."""
    rules = (check,) if isinstance(check, Rule) else tuple(check)
    spec = Option(help=help, flag=flag, metavar=metavar, default_text=default_text,
                  choices=None if choices is None else tuple(choices), rules=rules, parse=parse)
    return field(default=default, metadata={_KEY: spec})


def component(cls: type) -> Any:
    """A config field holding a component's own config (its defaults unless given)."""
    return field(default_factory=cls)


@dataclass(frozen=True)
class _Flag:
    path: tuple[str, ...]  # attribute path from the command's config: ("data_parallel", "overlap")
    name: str  # "--no-overlap"
    spec: Option
    kind: type  # int, float, str or bool (None removed from an optional type)
    default: Any
    group: type  # the config class that declares it

    @property
    def dest(self) -> str:
        return ".".join(self.path)


def flags(cls: type, path: tuple[str, ...] = ()) -> Iterator[_Flag]:
    """Every option of `cls` and of its components, depth first, in declaration order."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        kind = hints[f.name]
        if _KEY in f.metadata:
            yield _Flag((*path, f.name), flag_name(f), f.metadata[_KEY], _plain(kind), f.default, cls)
        elif is_dataclass(kind):
            yield from flags(kind, (*path, f.name))


def _plain(kind: Any) -> type:
    """`int | None` -> int: the type a flag's text is converted to."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        (kind,) = [arg for arg in typing.get_args(kind) if arg is not type(None)]
    return kind


def help_text(flag: _Flag) -> str:
    """The flag's help with its default: `(default: 0.2)`; a switch shows none (it is off until given)."""
    if flag.kind is bool:
        return flag.spec.help.replace("%", "%%")
    shown = flag.spec.default_text if flag.spec.default_text is not None else flag.default
    if shown is None:
        raise TypeError(f"option {flag.name} defaults to None; give it default_text= saying what that means")
    return f"{flag.spec.help} (default: {shown})".replace("%", "%%")


def add_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """One argument per option of `cls` and its components; each component's under its own heading."""
    groups: dict[type, Any] = {cls: parser}
    for flag in flags(cls):
        if flag.group not in groups:
            # The heading: the docstring's first words, up to a colon ("data parallelism: ...").
            title = (flag.group.__doc__ or flag.group.__name__).strip().splitlines()[0].split(":")[0]
            groups[flag.group] = parser.add_argument_group(title)
        target, help_ = groups[flag.group], help_text(flag)
        if flag.kind is bool:
            if flag.default and not flag.name.startswith("--no-"):
                raise TypeError(f"switch {flag.name} is on by default; name it --no-... to turn it off")
            target.add_argument(flag.name, dest=flag.dest, action="store_false" if flag.default else "store_true",
                                default=flag.default, help=help_)
            continue
        metavar = flag.spec.metavar or ("{" + ",".join(flag.spec.choices) + "}" if flag.spec.choices
                                        else flag.name.removeprefix("--").upper().replace("-", "_"))
        target.add_argument(flag.name, dest=flag.dest, type=flag.spec.parse or flag.kind, default=flag.default,
                            metavar=metavar, help=help_)


def build(cls: type, namespace: argparse.Namespace) -> Any:
    """`cls` (and its components) from `namespace`, as parsed by a parser `add_options` made."""
    try:
        return _build(cls, namespace, ())
    except ValueError as exc:  # a config's own check: the user's to fix, in one line
        raise UsageError(str(exc)) from None


def _build(cls: type, namespace: argparse.Namespace, path: tuple[str, ...]) -> Any:
    hints = typing.get_type_hints(cls)
    values = {}
    for f in fields(cls):
        if _KEY in f.metadata:
            values[f.name] = getattr(namespace, ".".join((*path, f.name)))
        elif is_dataclass(hints[f.name]):
            values[f.name] = _build(hints[f.name], namespace, (*path, f.name))
    return cls(**values)


class OptionError(ValueError):
    """A config's refusal of its own options' values, naming each option by its flag
    (`--shard 'x' is unknown; ...`). `named(names)` is the same refusal naming them as a caller's
    API does instead (`prepare(shard=...)`: `shard 'x' is unknown; ...`), so the check is written
    once, where the config is made, whoever makes it. `template` holds `{field}` per option named."""

    def __init__(self, template: str, *, config: Any) -> None:
        self.template, self.flags = template, {f.name: flag_name(f) for f in fields(config) if _KEY in f.metadata}
        super().__init__(template.format_map(self.flags))

    def named(self, names: dict[str, str] | None = None) -> ValueError:
        """The message with each option named `names[field]`, or its field's name (a keyword)."""
        return ValueError(self.template.format_map({f: (names or {}).get(f, f) for f in self.flags}))


def flag_name(f: Any) -> str:
    """The flag of option field `f`: its declared one, else "--" and the field's name with dashes."""
    return f.metadata[_KEY].flag or "--" + f.name.replace("_", "-")


def _text(value: Any) -> str:  # a value inside an OptionError's template: braces kept literal
    return str(value).replace("{", "{{").replace("}", "}}")


def check_options(config: Any) -> None:
    """Raise OptionError (a ValueError) for the first own option of `config` whose value breaks its declaration."""
    for f in fields(config):
        spec = f.metadata.get(_KEY)
        value = getattr(config, f.name)
        if spec is None or value is None:  # None: "not given", whatever it then means
            continue
        if spec.choices is not None and value not in spec.choices:
            raise OptionError(f"{{{f.name}}} {_text(repr(value))} is unknown; choose one of "
                              f"{_text(', '.join(spec.choices))}", config=config)
        for rule in spec.rules:
            if not rule.ok(value):
                raise OptionError(f"{{{f.name}}} {_text(value)} {_text(rule.problem)}", config=config)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (examples keep their lines); every flag's help ends with its default.

    Options made by `add_options` say theirs already (a None default in words); this adds it to
    a hand-written argument (bench, verify, predict, sweep until theirs are generated) that has a
    value and whose help does not mention one. A switch has none to show: it is off until given."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.nargs == 0 or "default" in text
                or action.default is None or action.default is argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


class CommandParser(argparse.ArgumentParser):
    """argparse whose own errors (an unknown flag, `--epochs x`) are one line: a `UsageError`."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise UsageError(f"{message} (see `{self.prog} --help`)")


__all__ = ["Option", "OptionError", "Rule", "CommandParser", "HelpFormatter", "add_options", "at_least", "build",
           "check_options", "component", "finite", "flag_name", "flags", "help_text", "option", "positive"]
