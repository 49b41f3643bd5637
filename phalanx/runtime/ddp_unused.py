"""DDP's error for parameters a step's loss did not use, in one line naming them.

A model whose forward leaves some parameters out (a head used on some batches, a branch, a layer
built and never called) stops DistributedDataParallel at the next step's forward with "Expected to
have finished reduction in the prior iteration before starting a new one", a 12-line paragraph that
lists the parameters by index ("Parameter indices which did not receive grad for rank 0: 2 3"),
and by name only under TORCH_DISTRIBUTED_DEBUG: the error DDP users meet most. `unused_line` names
them (the index is the place in DDP's own list: each module's parameters that require grad, in
`named_modules` order, shared ones once, `_ddp_params_and_buffers_to_ignore` left out), with the
script's line and the fixes. phalanx's replica needs no setting for them (docs/ddp.md, habit 13).
"""

from __future__ import annotations

import re

import torch

_SAID = "Expected to have finished reduction in the prior iteration before starting a new one"
_INDICES = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")
_NAMES = re.compile(r"Parameters which did not receive grad for rank (\d+): ([^\n]+)")  # TORCH_DISTRIBUTED_DEBUG


def unused_line(text: str, ddp: object, at: str) -> str | None:
    """The one line for DDP's error `text` raised in `ddp`'s forward (`at`: " at train.py:12 (...)" or
    ""), or None where it names no parameter."""
    if _SAID not in text:
        return None
    named, indexed = _NAMES.search(text), _INDICES.search(text)
    if named is not None:
        rank, names = named.group(1), [name.strip() for name in named.group(2).split(",") if name.strip()]
    elif indexed is not None and isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        listed = reducer_names(ddp)
        rank, names = indexed.group(1), [listed[int(i)] if int(i) < len(listed) else f"#{i}"
                                         for i in indexed.group(2).split()]
    else:
        return None
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return (f"DistributedDataParallel stopped at the next step{at}: {len(names)} parameter"
            f"{'s' * (len(names) != 1)} got no gradient from the previous step's loss on rank {rank} ({shown}), and "
            "DDP waits for every parameter's unless told; pass find_unused_parameters=True to "
            "DistributedDataParallel(...), set requires_grad=False on parameters no step uses, or wrap the model "
            "with phalanx.prepare(model), which needs neither")


def reducer_names(ddp: torch.nn.parallel.DistributedDataParallel) -> list[str]:
    """The names of the parameters DDP's reducer holds, in its order (its _build_params_for_reducer)."""
    ignored = getattr(ddp, "parameters_to_ignore", set())
    names, seen = [], set()
    for module_name, module in ddp.module.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if param.requires_grad and f"{module_name}.{param_name}" not in ignored and param not in seen:
                seen.add(param)
                names.append(f"{module_name}.{param_name}" if module_name else param_name)
    return names
