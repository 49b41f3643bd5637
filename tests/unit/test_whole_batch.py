"""`for x, y in loader.epoch(e)` (DDP's `for x, y in loader:` with the loader swapped) makes x the
whole batch: the prepared model's forward then fails with torch's "must be Tensor, not list" (a
Linear), "invalid combination of arguments - got (list, ...)" (a conv) or a forward's own "'list'
object has no attribute", and phalanx names the loop and the fix in one line instead. A model that
takes a list, and other errors, pass as they were."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import phalanx
from phalanx.data_parallel.whole_batch import WholeBatchPassed
from phalanx.errors import UsageError
from tests.unit.test_input_dtype import WORLD1


class _Viewing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x):
        return self.linear(x.view(len(x), -1))


@pytest.mark.parametrize("model, shape", [(lambda: nn.Linear(4, 2), (4,)), (lambda: _Viewing(), (2, 2)),
                                          (lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten()), (1, 5, 5))])
def test_a_loaders_whole_batch_for_the_input_names_the_loop(model, shape):
    data = TensorDataset(torch.randn(10, *shape), torch.randint(0, 2, (10,)))
    loader = phalanx.ShardedLoader(data, world=WORLD1, global_batch_size=4)
    with phalanx.prepare(model(), world=WORLD1, memory_format="contiguous") as dp:
        for x, y in loader.epoch(0):  # the mistake: x is [inputs, labels], y the global size
            with pytest.raises(WholeBatchPassed) as info:
                dp(x)
            break
        message = str(info.value)
        assert message.startswith("the model's forward got a list of 2 tensors of 4 rows as its input 0 (a collated "
                                  "batch: inputs and labels) where it takes a tensor")
        assert "write `for (x, y), global_size in loader.epoch(e)`" in message and "\n" not in message
        assert isinstance(info.value, TypeError) and isinstance(info.value, UsageError)
        assert "list" in str(info.value.__cause__)  # torch's (or the forward's own) error, kept as the cause
        (X, labels), _ = next(iter(loader.epoch(0)))
        assert dp(X).shape[0] == 4  # the loop written right runs


def test_a_model_that_takes_a_list_and_other_errors_pass_as_they_were():
    class Pair(nn.Module):
        def forward(self, pair):
            return pair[0] + pair[1]

    class Broken(nn.Module):
        def forward(self, x):
            raise TypeError("something else went wrong")

    pair = [torch.ones(3, 2), torch.ones(3, 2)]
    with phalanx.prepare(Pair(), world=WORLD1) as dp:
        assert torch.equal(dp(pair), 2 * torch.ones(3, 2))
    with phalanx.prepare(Broken(), world=WORLD1) as dp:
        with pytest.raises(TypeError, match="^something else went wrong$"):
            dp(pair)  # a list handed, but the error is not about it
        with pytest.raises(TypeError, match="^something else went wrong$"):
            dp(torch.ones(3))
    with phalanx.prepare(nn.Linear(2, 2), world=WORLD1) as dp:
        with pytest.raises(TypeError, match="must be Tensor, not list") as info:
            dp([torch.ones(3, 2), torch.ones(2, 2)])  # rows differ: not a collated batch, torch's error as it is
        assert not isinstance(info.value, WholeBatchPassed)
