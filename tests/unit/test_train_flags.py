"""Every flag `phalanx train` had before its parser was generated from the configs still works, and means
what it meant: the same config value from the same words, the same default, and a default in --help.

tests/unit/data/train_help_before.txt is `phalanx train --help` as it was (9e2c01d);
train_flags_before.jsonl holds, per flag, a sample, the companions a sample needs (--elastic needs
--max-restarts ...), the TrainConfig field it filled, the value the old parser made of the sample and
the field's default - recorded by running the old parser. A field's new place is named below.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from phalanx.cli import build_parser
from phalanx.job.config import TrainConfig
from phalanx.options import build, flags

DATA = Path(__file__).parent / "data"
OLD_FLAGS = re.findall(r"^  (--[a-z-]+)", (DATA / "train_help_before.txt").read_text(), re.MULTILINE)
ROWS = [json.loads(line) for line in (DATA / "train_flags_before.jsonl").read_text().splitlines()]

# The old flat TrainConfig field (or `devices`, then the parser's own) -> its place in the composed config.
NEW_PLACE = {
    "devices": "launch.devices", "threads_per_device": "launch.threads_per_device",
    "bind_cores": "launch.bind_cores", "timeout_s": "launch.timeout_s",
    "dataset": "data.dataset", "data_dir": "data.directory",
    "lr": "optim.lr", "warmup_epochs": "optim.warmup_epochs",
    "allreduce": "data_parallel.allreduce", "overlap": "data_parallel.overlap",
    "bucket_cap_mb": "data_parallel.bucket_cap_mb", "grad_dtype": "data_parallel.grad_dtype",
    "grad_accum_steps": "data_parallel.grad_accum_steps", "memory_format": "data_parallel.memory_format",
    "batchnorm": "data_parallel.batchnorm",
    "split": "split.kind", "micro_batches": "split.micro_batches", "schedule": "split.schedule",
    "checkpoint_every": "checkpoint.every", "checkpoint_dir": "checkpoint.directory", "resume": "checkpoint.resume",
    "max_restarts": "restarts.max_restarts", "elastic": "restarts.elastic",
}


def _value(config: TrainConfig, field: str):
    value = config
    for name in NEW_PLACE.get(field, field).split("."):
        value = getattr(value, name)
    return value


def _config(argv: list[str]) -> TrainConfig:
    return build(TrainConfig, build_parser(["train"]).parse_args(["train", *argv]))


def test_the_record_covers_every_old_flag():
    assert len(OLD_FLAGS) == 35 and [row["flag"] for row in ROWS] == OLD_FLAGS


# Defaults changed on purpose since the record, and what they are now. --no-overlap still turns
# overlap off; left out, overlap is None (auto: off for the shm allreduce where the workers'
# threads fill the cores, on elsewhere), where it was on (docs/benchmarks.md says why). Left out,
# --bucket-cap-mb is "auto": 0.25 MB as before for shm and the others, 25 MB for native, whose
# every call pays a fixed cost (data_parallel/config.py's table says why).
DEFAULT_NOW = {"--no-overlap": None, "--bucket-cap-mb": "auto"}


@pytest.mark.parametrize("row", ROWS, ids=[row["flag"] for row in ROWS])
def test_an_old_flag_fills_the_same_value_as_before(row):
    row = {**row, "default": DEFAULT_NOW.get(row["flag"], row["default"])}
    assert _value(_config(row["argv"] + row["companions"]), row["field"]) == row["value"]
    assert _value(_config(row["companions"]), row["field"]) == row["default"]  # and its default is the same


def test_every_flag_with_a_value_shows_its_default_in_help():
    parser = build_parser(["train"])
    train = parser._subparsers._group_actions[0].choices["train"]
    # --overlap, --no-overlap; not the other launchers' flags --help hides (each is one line naming --devices)
    helps = {name: action for action in train._actions for name in action.option_strings
             if action.help != argparse.SUPPRESS}
    switches = {flag.name for flag in flags(TrainConfig) if flag.kind is bool}
    assert set(OLD_FLAGS) <= set(helps)
    for name in set(helps) - {"-h", "--help"} - switches:
        assert "(default: " in helps[name].help, f"{name}: {helps[name].help}"
    text = train.format_help()
    for shown in ("--epochs EPOCHS       passes over the training set (default: 10)", "(default: 256)",
                  "learning rate (default: 0.2 for sgd, 0.001 for adam\n", "(default: 120.0)"):
        assert shown in text, text


def test_docs_command_md_lists_exactly_the_flags_of_phalanx_train():
    table = (Path(__file__).parents[2] / "docs" / "command.md").read_text()
    documented = set(re.findall(r"^\| `(--[a-z-]+)", table, re.MULTILINE))
    assert documented == {flag.name for flag in flags(TrainConfig)}


def _table_defaults(page: Path) -> list[tuple[str, str]]:
    """(flag, its `backticked` default) for each flag row of `page`'s tables; a row of several flags
    (`--batch-size`, `--lr`, `--epochs` | `256`, `0.2`, `10`) pairs them in order."""
    found = []
    for flags_cell, default_cell in re.findall(r"^\| ((?:`--[a-z-]+[^`]*`(?:, )?)+) \| ([^|]*) \|", page.read_text(),
                                               re.MULTILINE):
        names, defaults = re.findall(r"`(--[a-z-]+)", flags_cell), re.findall(r"`([^`]+)`", default_cell)
        if len(defaults) == len(names):
            found += zip(names, defaults)
        elif len(defaults) >= 1 and len(names) == 1:
            found.append((names[0], defaults[0]))  # `0.2` (sgd), `0.001` (adam, adamw): the first
    return found


def _same(written: str, value) -> bool:
    try:
        return float(written) == float(value)
    except (TypeError, ValueError):
        return written == str(value)


@pytest.mark.parametrize("page", ["README.md", "docs/command.md"])
def test_the_flag_tables_defaults_are_the_parsers(page):
    """A default written in a table (README's short one, command.md's whole one) is the parser's or
    the one its help shows, and every flag a row starts with is phalanx train's (command.md's whole
    list: the test above)."""
    train = build_parser(["train"])._subparsers._group_actions[0].choices["train"]
    actions = {name: action for action in train._actions for name in action.option_strings}
    rows = _table_defaults(Path(__file__).parents[2] / page)
    assert len(rows) >= (10 if page == "README.md" else 25)  # a table the regex no longer reads would pass
    named = set(re.findall(r"^\| `(--[a-z-]+)", (Path(__file__).parents[2] / page).read_text(), re.MULTILINE))
    assert named - set(actions) == set(), f"{page} names flags phalanx train does not have"
    wrong = []
    for flag, written in rows:
        action = actions.get(flag)
        shown = re.search(r"\(default: ([^)\s,]+)", " ".join((action.help or "").split())) if action else None
        if action is None or not (_same(written, action.default) or (shown and _same(written, shown.group(1)))):
            wrong.append(f"{flag} `{written}` (parser: {action and action.default!r}, help: {shown and shown.group(1)})")
    assert not wrong, f"{page}'s flag table says another default than phalanx train: " + "; ".join(wrong)
