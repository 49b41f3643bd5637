"""Plain `nn.Module`s and their initialisations; nothing here knows about devices or ranks.

`build_model(name)` for 1x28x28 inputs: `lenet` (the multi-GPU chapter's LeNet), `lenet-bn`
(it, with BatchNorm as in the BatchNorm chapter), `resnet` (D2L's ResNet-18, reduced), `mlp`
(the benchmarks' wide 784-2048-2048-10 MLP).
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from phalanx.models.lenet import LeNet, book_init
from phalanx.models.lenet_bn import LeNetBN
from phalanx.models.mlp import WideMLP
from phalanx.models.resnet import ResNet, Residual

_BUILDERS: dict[str, Callable[[int], nn.Module]] = {
    "lenet": lambda num_classes: LeNet(num_classes=num_classes),
    "lenet-bn": lambda num_classes: LeNetBN(num_classes=num_classes),
    "resnet": lambda num_classes: ResNet(num_classes=num_classes),
    "mlp": lambda num_classes: WideMLP(num_classes=num_classes),
}
MODELS = tuple(_BUILDERS)
INITS = ("pytorch", "book")


def build_model(name: str, *, init: str = "pytorch", num_classes: int = 10) -> nn.Module:
    """Construct a model by name; `init="book"` applies the chapter's normal(0, 0.01) weights."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    if init not in INITS:
        raise ValueError(f"unknown init {init!r}; choose one of {', '.join(INITS)}")
    model = _BUILDERS[name](num_classes)
    if init == "book":
        book_init(model)
    return model


def has_batchnorm(module: nn.Module) -> bool:
    """True when `module` holds a BatchNorm layer (whose statistics depend on how a batch is split)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


__all__ = ["LeNet", "LeNetBN", "ResNet", "Residual", "WideMLP", "book_init", "build_model", "has_batchnorm",
           "MODELS", "INITS"]
