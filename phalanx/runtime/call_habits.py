"""Calls made in another tool's way where a phalanx function stands, each a one-line TypeError naming
phalanx's call before Python's own binding error (which names a count or a keyword, not the fix).

Three habits: another tool's keyword (`CALL_KEYWORDS`: torch.distributed's `init_process_group(backend=,
timeout=)` and `all_reduce(op=)`, Fabric's `reduce_op=`, `clip_val=`, `Fabric(devices=)`); the World handed
by position (`barrier(world)`, `gather(t, world)`: torch.distributed passes its group so) or not at all; and
another tool's order of arguments (`CALL_ORDERS`: Fabric's `clip_gradients(model, optimizer, ...)`,
`save(path, state)`). `phalanx_call` wraps a public function or a public class's `__init__`; a call made
phalanx's way costs a length check, a lookup and a subset test before the function runs.
"""

from __future__ import annotations

import functools
import inspect

from phalanx.runtime.foreign_names import CALLBACKS_WAY, TRACKER_WAY
from phalanx.runtime.world import World

# Keywords another tool's call takes where phalanx's own call stands: (phalanx's function, keyword) ->
# (whose, phalanx's way); Fabric(...)'s, Accelerator(...)'s and init_process_group's are init's, the rest
# their methods'.
_DEVICES = "the devices come from phalanx run --devices cpu:2 script.py or phalanx.launch(fn, devices='cpu:2')"
_INIT_LATER = "phalanx.prepare(model, world=world, precision='bf16-mixed') or dtype='float64'"
_BY_VALUE = "phalanx.clip_grad_value_(dp, value), after dp.finish_gradient_sync(): no optimizer"
_BY_NORM = "phalanx.clip_grad_norm_(dp, max_norm), after dp.finish_gradient_sync(): no optimizer"
_INIT_PROCESS_GROUP = "torch.distributed.init_process_group's"
_FROM_LAUNCHER = ("phalanx.init() reads the rendezvous, the rank and the world size from phalanx run's or torchrun's "
                  "environment (RANK, WORLD_SIZE, MASTER_ADDR), and adopts a group the script opened before it")
_ALL_REDUCE = "torch.distributed.all_reduce's"
CALL_KEYWORDS: dict[tuple[str, str], tuple[str, str]] = {
    ("init", "accelerator"): ("Fabric's", f"{_DEVICES}; init(device='cpu'|'cuda') picks the kind"),
    ("init", "devices"): ("Fabric's", _DEVICES),
    ("init", "num_nodes"): ("Fabric's", "many hosts through torchrun --nnodes H ... script.py"),
    ("init", "strategy"): ("Fabric's", "data parallel always: phalanx.prepare(model, world=world), with shard= "
                                       "for ZeRO's stages"),
    ("init", "precision"): ("Fabric's", _INIT_LATER),
    ("init", "mixed_precision"): ("Accelerator's", _INIT_LATER),
    ("init", "cpu"): ("Accelerator's", "init(device='cpu')"),
    ("init", "gradient_accumulation_steps"): ("Accelerator's", "for piece in dp.accumulate(n): ..."),
    ("init", "callbacks"): ("Fabric's", CALLBACKS_WAY),
    ("init", "loggers"): ("Fabric's", TRACKER_WAY),
    ("init", "log_with"): ("Accelerator's", TRACKER_WAY),
    ("init", "plugins"): ("Fabric's", "none: precision and sharding are prepare's keywords"),
    ("init", "backend"): (_INIT_PROCESS_GROUP, "phalanx.init() picks it: gloo for CPU workers, nccl for GPUs "
                                               "(world.backend says which); init(device='cpu') keeps a GPU host's "
                                               "workers on the CPU"),
    ("init", "timeout"): (_INIT_PROCESS_GROUP, "timeout_s= in seconds, phalanx.init(timeout_s=60) for "
                                               "timedelta(seconds=60); under phalanx run its --timeout sets it"),
    **{("init", name): (_INIT_PROCESS_GROUP, _FROM_LAUNCHER)
       for name in ("init_method", "store", "rank", "world_size", "group_name")},
    ("init", "device_id"): (_INIT_PROCESS_GROUP, "phalanx.init() binds each GPU worker to cuda:LOCAL_RANK itself, "
                                                 "and a CPU worker to none"),
    ("allreduce", "op"): (_ALL_REDUCE, "phalanx.allreduce sums (the chapter's allreduce); a mean, max or min of "
                                       "a value: phalanx.reduce(value, op='mean', world=world)"),
    ("allreduce", "group"): (_ALL_REDUCE, "the world's group: phalanx.allreduce(tensor, world=world)"),
    ("allreduce", "async_op"): (_ALL_REDUCE, "phalanx.allreduce returns with the sum in place; a replica's "
                                             "buckets go out beside backward (phalanx.prepare(model, world=world, "
                                             "overlap=True))"),
    ("reduce", "reduce_op"): ("Fabric's all_reduce", "op=: phalanx.reduce(value, op='sum', world=world) "
                                                     "(op='mean' unless given, as Fabric's)"),
    ("main_first", "local"): ("Fabric's rank_zero_first", "per_host=True for local=True: "
                                                          "with phalanx.main_first(world=world, per_host=True): ..."),
    ("clip_grad_value_", "clip_val"): ("Fabric's clip_gradients", f"clip_value=: {_BY_VALUE}"),
    ("clip_grad_norm_", "clip_val"): ("Fabric's clip_gradients", f"a clip by value is {_BY_VALUE}"),
    ("clip_grad_value_", "max_norm"): ("Fabric's clip_gradients", f"a clip by norm is {_BY_NORM}"),
}

# Calls another tool makes with its own order of arguments where phalanx's function stands:
# phalanx's function -> (the other tools' calls, phalanx's way).
_PARTS = "epoch=epoch, step=step, global_batch_size=..., seed=...): each part by keyword, no state dict"
CALL_ORDERS: dict[str, tuple[str, str]] = {
    "clip_grad_norm_": ("Fabric's clip_gradients(model, optimizer, max_norm=...), Accelerate's "
                        "clip_grad_norm_(parameters, max_norm)", "phalanx.clip_grad_norm_(dp, max_norm), after "
                                                                 "dp.finish_gradient_sync(): no optimizer"),
    "clip_grad_value_": ("Fabric's clip_gradients(model, optimizer, clip_val=...), Accelerate's "
                         "clip_grad_value_(parameters, value)", "phalanx.clip_grad_value_(dp, value), after "
                                                                "dp.finish_gradient_sync(): no optimizer"),
    "checkpoint": ("Fabric's save(path, state), torch.save(state, path)",
                   f"phalanx.checkpoint(path, world=world, model=dp, optimizer=optimizer, {_PARTS}"),
    "resume": ("Fabric's load(path, state), torch.load(path)",
               "position = phalanx.resume(path, world=world, model=dp, optimizer=optimizer, global_batch_size=..., "
               "seed=...): restores each part in place"),
}


def call_keywords_error(call: str, names: list[str]) -> TypeError:
    """The TypeError for keywords `call` does not take: another tool's named with phalanx's way, in one line."""
    name = next((name for name in names if (call, name) in CALL_KEYWORDS), None)
    if name is None:
        return TypeError(f"{call}() got an unexpected keyword argument {names[0]!r}")
    whose, way = CALL_KEYWORDS[call, name]
    return TypeError(f"{call}() takes no {name}= ({whose} keyword): in phalanx, {way}")


def phalanx_call(fn=None, *, first: type | tuple[type, ...] | None = None):
    """`fn` as it is, but called in another tool's way a one-line TypeError naming phalanx's call: a
    keyword of `CALL_KEYWORDS` it does not take; a World among the positional arguments, or none given,
    where `fn` takes `world=` by keyword; and, with `first` (for a name of `CALL_ORDERS`), more positional
    arguments than it takes, a keyword one of them already fills, or a first argument not a `first`.
    Other mistakes reach `fn`, and Python's own error."""
    if fn is None:
        return functools.partial(phalanx_call, first=first)
    sig = inspect.signature(fn)
    method = fn.__name__ == "__init__"  # a class's: named by the instance's class at the call
    params = list(sig.parameters.values())[1 if method else 0:]
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    named = frozenset(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    world = sig.parameters.get("world")
    by_keyword = world is not None and world.kind == world.KEYWORD_ONLY
    needs_world = by_keyword and world.default is world.empty
    required = [p.name if p.kind != p.KEYWORD_ONLY else f"{p.name}=..." for p in params
                if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "world"]
    arguments = ", ".join([*required[:len(positional)], "world=world", *required[len(positional):]])

    def another_way(name: str, args: tuple, kwargs: dict) -> TypeError | None:
        foreign = [key for key in kwargs if key not in named and (name, key) in CALL_KEYWORDS]
        if foreign:
            return call_keywords_error(name, foreign)
        if by_keyword and any(isinstance(arg, World) for arg in args):
            return TypeError(f"{name}() takes the World by keyword: phalanx.{name}({arguments})")
        if first is not None and (len(args) > len(positional) or not kwargs.keys().isdisjoint(positional[:len(args)])
                                  or (args and not isinstance(args[0], first))):
            whose, way = CALL_ORDERS[name]
            given = ", ".join([*(type(arg).__name__ for arg in args), *(f"{key}=" for key in kwargs)])
            return TypeError(f"{name}({given}) is another tool's order ({whose}): in phalanx, {way}")
        if needs_world and "world" not in kwargs:
            return TypeError(f"{name}() needs world=: world = phalanx.init() once, then phalanx.{name}({arguments})")
        return None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        own = args[1:] if method else args
        if (first is not None or len(own) > len(positional) or (needs_world and "world" not in kwargs)
                or not named.issuperset(kwargs)):
            error = another_way(type(args[0]).__name__ if method else fn.__name__, own, kwargs)
            if error is not None:
                raise error
        return fn(*args, **kwargs)
    return call
