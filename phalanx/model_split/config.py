"""The options that pick how one network is spread over the devices: --split, and the pipeline's own.

`SplitConfig` declares each flag once (phalanx/options.py makes the parser from it); `check_split`
and `build_split` (splits.py) take its values. What depends on the rest of the run (the global
batch, the model, the device count) is checked by the job's composed config and `check_split`.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.model_split.pipeline import SCHEDULES
from phalanx.model_split.splits import SPLITS
from phalanx.options import check_options, option


@dataclass(frozen=True, kw_only=True)
class SplitConfig:
    """model split: how the work is spread over the devices"""

    kind: str = option("data", flag="--split", choices=SPLITS,
                       help="data (replicas), layers (a pipeline of LeNet's layers) or channels (every layer's "
                            "output channels split over the devices)")
    micro_batches: int | None = option(None, default_text="2 x devices",
                                       help="--split layers: micro-batches each global batch is cut into")
    schedule: str = option("gpipe", choices=SCHEDULES, help="--split layers: gpipe (all forwards, then all "
                           "backwards) or 1f1b (one forward, one backward: fewer activations held)")

    def __post_init__(self) -> None:
        check_options(self)
