"""A batch whose dtype the prepared model cannot take is one line naming the cast, not torch's
"mat1 and mat2 must have the same dtype": a float32 batch into `prepare(dtype="float64")` (a
Fabric script's `precision="64-true"` ported by the table, whose plugin converted inputs itself),
a float64 batch under `precision="bf16-mixed"`, for a Linear and a conv; other errors, and the
batches the model takes, pass as they were."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx
from phalanx.data_parallel.input_dtype import InputDtypeMismatch
from phalanx.errors import UsageError
from phalanx.runtime.world import World

WORLD1 = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend="none",
               timeout_s=5.0)


@pytest.mark.parametrize("model, shape", [(lambda: nn.Linear(4, 2), (3, 4)),
                                          (lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(18, 2)),
                                           (3, 1, 5, 5))])
@pytest.mark.parametrize("keywords, given, want, how", [
    (dict(dtype="float64"), torch.float32, "torch.float64", "the model is float64 (prepare's dtype= casts the model"),
    (dict(precision="bf16-mixed"), torch.float64, "torch.float32", "torch.autocast (bfloat16, prepare's precision=) "
                                                                   "casts float32 inputs only"),
])
def test_an_input_the_model_cannot_take_names_the_cast(model, shape, keywords, given, want, how):
    with phalanx.prepare(model(), world=WORLD1, memory_format="contiguous", **keywords) as dp:
        with pytest.raises(InputDtypeMismatch) as info:
            dp(torch.randn(*shape, dtype=given))
        message = str(info.value)
        assert message.startswith(f"the model's forward took a {str(given)[6:]} input and {how}")
        assert f"pass x.to({want})" in message and "\n" not in message
        assert isinstance(info.value, RuntimeError) and isinstance(info.value, UsageError)
        assert "dtype" in str(info.value.__cause__) or "type" in str(info.value.__cause__)  # torch's, kept as the cause
        taken = torch.randn(*shape, dtype=torch.float64 if "dtype" in keywords else torch.float32)
        assert dp(taken).shape == (3, 2)  # what the model takes runs as before


class _Fails(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x):
        raise RuntimeError("expected scalar type of something else entirely")


def test_other_errors_pass_as_they_were():
    with phalanx.prepare(_Fails(), world=WORLD1) as dp:
        with pytest.raises(RuntimeError, match="^expected scalar type of something else entirely$") as info:
            dp(torch.randn(3, 4))  # the input's dtype is the model's: not the input's fault
        assert not isinstance(info.value, InputDtypeMismatch)
