"""Each option declared once: a config field carries its flag, help, default and check; parsers are generated.

A command's configuration is a kw_only dataclass whose fields are either `option(...)`s (one flag
each: the field's name, type and default are the flag's; its metadata adds the help, the flag's
name where it differs from the field's, the allowed values and `Rule`s) or `component(Cls)`s (a
nested config beside the code it configures, as torchtitan composes its job config). Flags stay
flat on the command line (`--no-overlap`, not `--data_parallel.overlap`). A list flag
(`--world-sizes 2,3,4`) is an option with `items=`: its text is split at commas, each item read
by `items`, and the field holds the tuple; choices and rules apply to every item. A component
made with `into=` shows its own options and holds what `into` makes of them (predict's link
flags become an `Interconnect`).

- `add_options(parser, Cls)`: one argparse argument per option of Cls and of its components (one
  help group per component, headed by its docstring's first words), every help ending in its
  default. A parser may take several configs' options (`bench`: the kind's, then `--out`).
- `build(Cls, namespace)`: the config from parsed arguments; a config's `ValueError` becomes a
  `UsageError` (one line on stderr, exit 2).
- `check_options(config)`: the declared checks of one config's own options, with the messages
  `{flag} {value} must be ...` / `{flag} 'x' is unknown; choose one of ...`; each config's
  `__post_init__` calls it first, then checks what spans several options. The refusal is an
  `OptionError`, which an API that builds a config from its keywords re-words in their names.
- The parsers are `command_parser.CommandParser`s: argparse whose own errors are one line.

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
import functools
import math
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterator, Sequence, TypeVar

from phalanx.errors import UsageError

_KEY = "phalanx.option"
_COMPONENT = "phalanx.component"
T = TypeVar("T")
_PLAIN = (int, float, str)  # their ValueError speaks Python ("invalid literal for int()"), not to a user


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


def wait_seconds() -> Rule:
    """A --timeout: finite (inf overflowed the process group's timedelta) and at least 1 s (it bounds
    the start-up's rendezvous too, which took a traceback below that)."""
    return Rule(ok=lambda value: math.isfinite(value) and value >= 1,
                problem="must be a finite number of seconds, at least 1 (it bounds the start-up and every "
                        "collective wait)")


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
    choices: tuple[Any, ...] | None = None
    rules: tuple[Rule, ...] = ()
    parse: Callable[[str], Any] | None = None  # text -> value, where the field's type is not enough
    items: Callable[[str], Any] | None = None  # a comma-separated list of these; the field holds a tuple


def option(default: Any, *, help: str, flag: str | None = None, metavar: str | None = None,
           default_text: str | None = None, choices: Sequence[Any] | None = None,
           check: Rule | Sequence[Rule] = (), parse: Callable[[str], Any] | None = None,
           items: Callable[[str], Any] | None = None) -> Any:
    """A config field that is a flag. A bool is a switch: default False turns on with `--name`,
    default True turns off with `--no-name` (its `flag`), default None (decided later, as its
    `default_text` says) is `--name` / `--no-name`. `items=int`: a list flag (`2,3,4`)
    whose field holds a tuple; `choices` and `check` then apply to each item."""
    if parse is not None and items is not None:
        raise TypeError("an option reads its text with parse= or, for a list, items=; not both")
    rules = (check,) if isinstance(check, Rule) else tuple(check)
    spec = Option(help=help, flag=flag, metavar=metavar, default_text=default_text,
                  choices=None if choices is None else tuple(choices), rules=rules, parse=parse, items=items)
    return field(default=default, metadata={_KEY: spec})


def component(cls: type, *, into: Callable[[Any], Any] | None = None) -> Any:
    """A config field holding a component's own config (its defaults unless given); with `into`,
    the field holds `into(options)` instead, and the command line shows `cls`'s options."""
    make = cls if into is None else (lambda: into(cls()))
    return field(default_factory=make, metadata={_COMPONENT: (cls, into)})


def device_count(text: str) -> int:
    """One item of a list of device counts (--devices 1,2,4): N, or cpu:N as `train --devices` writes it."""
    try:
        return int(text.removeprefix("cpu:"))
    except ValueError:
        raise ValueError(f"--devices item {text!r} is not a device count; give counts, e.g. --devices 2,4 "
                         "(or cpu:2,cpu:4)") from None


def parse_list(text: str, item: Callable[[str], T], *, flag: str) -> tuple[T, ...]:
    """A comma-separated flag value as a tuple (blank items skipped). A bad item is one line: for
    int / float, naming the flag and the type; for a parser of its own, that parser's ValueError
    (which names the flag and the fix); an empty list asks for at least one value."""
    try:
        values = tuple(item(part.strip()) for part in str(text).split(",") if part.strip())
    except ValueError as exc:
        if item in _PLAIN:
            raise UsageError(f"{flag} {text!r} is not a comma-separated list of {item.__name__}") from None
        raise UsageError(str(exc)) from None
    if not values:
        raise UsageError(f"{flag} is empty; give at least one value")
    return values


@dataclass(frozen=True)
class _Flag:
    path: tuple[str, ...]  # attribute path from the command's config: ("data_parallel", "overlap")
    name: str  # "--no-overlap"
    spec: Option
    kind: Any  # the field's type, None removed: int, float, str, bool, tuple[int, ...]
    default: Any
    group: type  # the config class that declares it

    @property
    def dest(self) -> str:
        return ".".join(self.path)


def flags(cls: type, path: tuple[str, ...] = ()) -> Iterator[_Flag]:
    """Every option of `cls` and of its components, depth first, in declaration order."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if _KEY in f.metadata:
            spec = f.metadata[_KEY]
            yield _Flag((*path, f.name), _flag_name(f.name, spec), spec, _plain(hints[f.name]), f.default, cls)
        elif _COMPONENT in f.metadata:
            yield from flags(f.metadata[_COMPONENT][0], (*path, f.name))


def _flag_name(field_name: str, spec: Option) -> str:
    return spec.flag or "--" + field_name.replace("_", "-")


def _plain(kind: Any) -> Any:
    """`int | None` -> int: the type a flag's text is converted to (of several, the first)."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        kind = [arg for arg in typing.get_args(kind) if arg is not type(None)][0]
    return kind


def _shown(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def help_text(flag: _Flag) -> str:
    """The flag's help with its default: `(default: 0.2)`, a list's as `2,3,4`; a switch shows
    none (it is off until given)."""
    if flag.kind is bool and flag.default is not None:
        return flag.spec.help.replace("%", "%%")
    shown = flag.spec.default_text if flag.spec.default_text is not None else flag.default
    if shown is None:
        raise TypeError(f"option {flag.name} defaults to None; give it default_text= saying what that means")
    return f"{flag.spec.help} (default: {_shown(shown)})".replace("%", "%%")


def _metavar(flag: _Flag) -> str:
    if flag.spec.metavar:
        return flag.spec.metavar
    if flag.spec.choices:
        listed = "{" + ",".join(map(str, flag.spec.choices)) + "}"
        return listed + "[,...]" if flag.spec.items else listed
    return flag.name.removeprefix("--").upper().replace("-", "_")


def _reader(flag: _Flag) -> Callable[[str], Any]:
    """What turns the flag's text into the field's value."""
    if flag.spec.items is not None:
        return functools.partial(parse_list, item=flag.spec.items, flag=flag.name)
    if flag.spec.parse is not None:
        return flag.spec.parse
    if typing.get_origin(flag.kind) is tuple:
        raise TypeError(f"option {flag.name} holds a tuple; give it items= (the type of each listed value)")
    return flag.kind


def add_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """One argument per option of `cls` and its components; each component's under its own heading."""
    groups: dict[type, Any] = {cls: parser}
    for flag in flags(cls):
        if flag.group not in groups:
            # The heading: the docstring's first words, up to a colon ("data parallelism: ...").
            title = (flag.group.__doc__ or flag.group.__name__).strip().splitlines()[0].split(":")[0]
            groups[flag.group] = parser.add_argument_group(title)
        target, help_ = groups[flag.group], help_text(flag)
        # The three add_argument calls below are the only ones a generated parser makes.
        if flag.kind is bool and flag.default is None:  # three states: --name, --no-name, neither
            target.add_argument(flag.name, dest=flag.dest, action=argparse.BooleanOptionalAction, default=None,
                                help=help_)
            continue
        if flag.kind is bool:
            if flag.default and not flag.name.startswith("--no-"):
                raise TypeError(f"switch {flag.name} is on by default; name it --no-... to turn it off")
            target.add_argument(flag.name, dest=flag.dest, action="store_false" if flag.default else "store_true",
                                default=flag.default, help=help_)
            continue
        target.add_argument(flag.name, dest=flag.dest, type=_reader(flag), default=flag.default,
                            metavar=_metavar(flag), help=help_)


def build(cls: type, namespace: argparse.Namespace) -> Any:
    """`cls` (and its components) from `namespace`, as parsed by a parser `add_options` made."""
    try:
        return _build(cls, namespace, ())
    except ValueError as exc:  # a config's own check: the user's to fix, in one line
        raise UsageError(str(exc)) from None


def _build(cls: type, namespace: argparse.Namespace, path: tuple[str, ...]) -> Any:
    values = {}
    for f in fields(cls):
        if _KEY in f.metadata:
            values[f.name] = getattr(namespace, ".".join((*path, f.name)))
        elif _COMPONENT in f.metadata:
            component_cls, into = f.metadata[_COMPONENT]
            made = _build(component_cls, namespace, (*path, f.name))
            values[f.name] = made if into is None else into(made)
    return cls(**values)


class OptionError(ValueError):
    """A config's refusal of its own options' values, naming each option by its flag
    (`--shard 'x' is unknown; ...`). `named(names)` is the same refusal naming them as a caller's
    API does instead (`prepare(shard=...)`: `shard 'x' is unknown; ...`), so the check is written
    once, where the config is made, whoever makes it. `template` holds `{field}` per option named."""

    def __init__(self, template: str, *, config: Any) -> None:
        self.template = template
        self.flags = {f.name: _flag_name(f.name, f.metadata[_KEY]) for f in fields(config) if _KEY in f.metadata}
        super().__init__(template.format_map(self.flags))

    def named(self, names: dict[str, str] | None = None) -> ValueError:
        """The message with each option named `names[field]`, or its field's name (a keyword)."""
        return ValueError(self.template.format_map({f: (names or {}).get(f, f) for f in self.flags}))


def _text(value: Any) -> str:  # a value inside an OptionError's template: braces kept literal
    return str(value).replace("{", "{{").replace("}", "}}")


def check_options(config: Any) -> None:
    """Raise OptionError (a ValueError) for the first own option of `config` whose value breaks its
    declaration (of a list option: the first item that does, or an empty list)."""
    for f in fields(config):
        spec = f.metadata.get(_KEY)
        value = getattr(config, f.name)
        if spec is None or value is None:  # None: "not given", whatever it then means
            continue
        if spec.items is None:
            _check_value(f"{{{f.name}}}", spec, value, config)
            continue
        if not value:
            raise OptionError(f"{{{f.name}}} is empty; give at least one value", config=config)
        for item in value:
            named = f"{{{f.name}}}" if len(value) == 1 else f"{{{f.name}}} {_text(_shown(tuple(value)))}:"
            _check_value(named, spec, item, config)


def _check_value(name: str, spec: Option, value: Any, config: Any) -> None:
    """`name`: the option as an OptionError's template names it (`{field}`, and a list's items)."""
    if spec.choices is not None and value not in spec.choices:
        raise OptionError(f"{name} {_text(repr(value))} is unknown; choose one of "
                          f"{_text(', '.join(map(str, spec.choices)))}", config=config)
    for rule in spec.rules:
        if not rule.ok(value):
            raise OptionError(f"{name} {_text(value)} {_text(rule.problem)}", config=config)


__all__ = ["Option", "OptionError", "Rule", "add_options", "at_least", "build", "check_options",
           "component", "finite", "flags", "help_text", "option", "parse_list", "positive"]
