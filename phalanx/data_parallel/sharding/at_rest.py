"""Stage 3's parameters between steps: a stand-in of each one's shape, and a refusal to read or write it there.

At rest (`shard="parameters"`, outside forward and backward) a parameter holds none of its values:
this rank keeps its range of the flat order apart (params.py), and the parameter is a stand-in of
its shape that holds one NaN seen through zero strides (`stand_in`). Read as it was, it gave NaN
without a word - a weight norm logged, an EMA updated from `dp.module` - and an in-place write went
into the stand-in (a 1-element bias's `fill_`) or died in torch's "more than one element of the
written-to tensor refers to a single memory location". So each parameter of such a replica is a
`ShardedParameter` while it is at rest: still an `nn.Parameter` (its shape, dtype, device,
`requires_grad` and `.grad` read as ever), whose `__torch_function__` refuses anything else, in one
line naming `dp.gathered_parameters()`, the block in which every rank holds the whole parameters
(FSDP2 makes its parameters DTensors for the same reason: a shard is not the whole tensor). Whole,
it is a plain `nn.Parameter` again (the same object: its class is swapped, as `to_rest` and `to_whole`
do), so forward and backward pay nothing for the check - a `__torch_function__` left on
while whole cost a 31-layer MLP's stage-3 step 20-100% - and `copy.deepcopy(dp.module)` or
`AveragedModel(dp.module)` inside that block is an ordinary model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._C import DisableTorchFunctionSubclass

CONTEXT = "with dp.gathered_parameters():"
_T = torch.Tensor
# What a parameter at rest still answers: its description and storage (what memory it holds, for
# a memory count), never its values; `.data` and `.grad` are set (the gathers, zero_grad), and
# hooks registered (the replica's own, at set-up).
_METADATA = frozenset({
    _T.shape.__get__, _T.dtype.__get__, _T.device.__get__, _T.requires_grad.__get__, _T.requires_grad.__set__,
    _T.grad.__get__, _T.grad.__set__, _T.is_leaf.__get__, _T.grad_fn.__get__, _T.ndim.__get__, _T.layout.__get__,
    _T.is_cuda.__get__, _T.is_sparse.__get__, _T.is_meta.__get__, _T._version.__get__,
    _T.data.__set__, _T.size, _T.dim, _T.numel, _T.nelement, _T.stride, _T.is_contiguous, _T.element_size,
    _T.is_floating_point, _T.is_complex, _T.requires_grad_, _T.register_hook, _T.register_post_accumulate_grad_hook,
    _T.get_device, _T.__hash__, _T.data_ptr, _T.untyped_storage, _T.storage_offset})


class ShardedParameter(nn.Parameter):
    """A parameter of a `shard="parameters"` replica while at rest: every torch call but metadata refused."""

    _phalanx_name = "a parameter"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func not in _METADATA:  # only a parameter at rest has this class
            for arg in (*args, *(kwargs or {}).values()):
                for tensor in arg if isinstance(arg, (list, tuple)) else (arg,):
                    if isinstance(tensor, ShardedParameter):
                        raise at_rest_error(tensor)
        with DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def __deepcopy__(self, memo: dict) -> nn.Parameter:
        raise at_rest_error(self, "copied")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise at_rest_error(self, "pickled")


def at_rest_error(param: ShardedParameter, what: str = "read or written") -> RuntimeError:
    """The one line for `param` touched at rest."""
    return RuntimeError(f"{param._phalanx_name} cannot be {what} between steps: shard=\"parameters\" keeps only "
                        f"each rank's range of it; on every rank, `{CONTEXT}` holds the whole parameters "
                        "(writeback=True keeps an edit), or read dp.full_state_dict() / load dp.load_state_dict()")


def to_rest(param: nn.Parameter, name: str) -> None:
    """`param` (named `name`) at rest: refused until `to_whole`; the same object, which optimizers and hooks hold."""
    param.__class__ = ShardedParameter
    param._phalanx_name = name


def to_whole(param: nn.Parameter) -> None:
    """`param` a plain parameter again (a no-op on one never at rest)."""
    if type(param) is ShardedParameter:
        param.__class__ = nn.Parameter
        del param._phalanx_name  # nothing of phalanx's travels in a copy or a pickle of the whole one


def stand_in(whole: torch.Tensor) -> torch.Tensor:
    """A stand-in of `whole`'s shape that holds no memory: one NaN, expanded (a 0-d one is that NaN)."""
    nan = torch.full((1,), float("nan"), dtype=whole.dtype, device=whole.device)
    return nan.expand(whole.shape) if whole.dim() else nan.view(())
