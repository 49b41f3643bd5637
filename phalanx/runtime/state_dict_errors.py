"""torch's error for a state dict whose keys differ from the model's by DDP's `module.` prefix, in one line.

`DistributedDataParallel(model).state_dict()` names every key `module.<name>`. A checkpoint saved
that way and loaded into the bare model (to evaluate, to fine-tune on one device), or a bare
model's checkpoint loaded into the wrapper, stops in `load_state_dict` with every key listed twice,
as missing and as unexpected, and no word of the prefix: the commonest question DDP users ask.
Where the unexpected keys are exactly the missing ones with `module.` added (or taken away),
`prefix_line` names the prefix, the script's line and the fix. phalanx's own replica
(`dp.load_state_dict`) takes either form (data_parallel/ddp_keys.py).
"""

from __future__ import annotations

import re

PREFIX = "module."
_KEYS = re.compile(r"\t(Missing|Unexpected) key\(s\) in state_dict: ((?:\"[^\"]*\"(?:, )?)+)")


def prefix_line(text: str, at: str) -> str | None:
    """The one line for torch's load_state_dict error `text` (`at`: " at train.py:12 (...)" or ""),
    when its keys differ by DDP's prefix alone; None for any other difference."""
    if not text.startswith("Error(s) in loading state_dict for "):
        return None
    found = {kind: re.findall(r"\"([^\"]*)\"", keys) for kind, keys in _KEYS.findall(text)}
    missing, unexpected = set(found.get("Missing", [])), set(found.get("Unexpected", []))
    if not missing or not unexpected:
        return None
    if _by_prefix(missing, unexpected):
        return (f"the checkpoint's keys carry DDP's \"module.\" prefix and the model's do not{at} (e.g. "
                f"\"{PREFIX + min(missing)}\" for \"{min(missing)}\"): it was saved from a DistributedDataParallel's "
                "state_dict(); strip the prefix before loading (torch.nn.modules.utils."
                "consume_prefix_in_state_dict_if_present(state, \"module.\")), or save ddp.module.state_dict() "
                "instead (phalanx's replica, dp.load_state_dict, takes either)")
    if _by_prefix(unexpected, missing):
        return (f"the model's keys carry DDP's \"module.\" prefix and the checkpoint's do not{at} (e.g. "
                f"\"{min(unexpected)}\" for \"{PREFIX + min(unexpected)}\"): load it into the model inside the "
                "wrapper (ddp.module.load_state_dict(state)), or before wrapping it")
    return None


def _by_prefix(bare: set[str], prefixed: set[str]) -> bool:
    """Whether the `prefixed` keys are the `bare` ones with DDP's prefix. A BatchNorm's
    `num_batches_tracked` may stand on the unexpected side alone: torch fills it in when it is
    missing (checkpoints from before it existed), so it is never listed as missing."""
    stripped = {key[len(PREFIX):] for key in prefixed if key.startswith(PREFIX)}
    return len(stripped) == len(prefixed) and bool(bare & stripped) and \
        all(key.rsplit(".", 1)[-1] == "num_batches_tracked" for key in stripped ^ bare)
