"""How a `phalanx train` run outlives a failure: its checkpoints, what it continues from, its restarts.

`CheckpointConfig` (--checkpoint-every, --checkpoint-dir, --resume) and `RestartConfig`
(--max-restarts, --elastic) declare each flag once (phalanx/options.py makes the parser from
them). resume.py and step_hook.py read the first, elastic.py the second; what needs the rest of
the run (a place to write, a checkpoint to restart from) is checked by the composed TrainConfig.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.options import at_least, check_options, option


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """checkpoints: when and where a run saves itself, and what it continues from"""

    # None (off), "epoch", or a number of steps as text ("50").
    every: str | None = option(None, flag="--checkpoint-every", metavar="N|epoch", default_text="never",
                               help="save a checkpoint every N steps (and at every epoch end), or at epoch ends only")
    directory: str | None = option(None, flag="--checkpoint-dir", metavar="DIR", default_text="OUT/checkpoints",
                                   help="where checkpoints go")
    # A checkpoint dir/file, or "auto": the checkpoint dir's checkpoint when there is one (what a
    # torchrun restart uses).
    resume: str | None = option(None, metavar="DIR|auto", default_text="a fresh start",
                                help="continue from a checkpoint (dir or file); auto: the checkpoint dir's, if any")

    def __post_init__(self) -> None:
        check_options(self)
        if self.every is not None and self.every != "epoch" and (not self.every.isdigit() or int(self.every) < 1):
            raise ValueError(f"--checkpoint-every {self.every} is neither 'epoch' nor a positive number of steps; "
                             "use e.g. --checkpoint-every 50")

    @property
    def steps(self) -> int | None:
        """Steps between checkpoints, or None (only at epoch ends, or never)."""
        return int(self.every) if self.every not in (None, "epoch") else None


@dataclass(frozen=True, kw_only=True)
class RestartConfig:
    """restarts: what happens when a worker fails"""

    max_restarts: int = option(0, metavar="N", check=at_least(0, problem="must be 0 (no restarts) or more"),
                               help="restart the workers from the last checkpoint after a worker fails, up to N "
                                    "times (needs --checkpoint-every)")
    elastic: bool = option(False, help="with --max-restarts: go on without a device whose worker fails again "
                                       "before the run gets past the checkpoint it restarted from")

    def __post_init__(self) -> None:
        check_options(self)
        if self.elastic and not self.max_restarts:
            raise ValueError("--elastic goes on without a device that fails again after a restart; "
                             "add --max-restarts N")
