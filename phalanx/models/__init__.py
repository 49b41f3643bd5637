"""Plain `nn.Module`s and their initialisations; nothing here knows about devices or ranks."""

from phalanx.models.lenet import LeNet, book_init

MODELS = ("lenet",)
INITS = ("pytorch", "book")


def build_model(name: str, *, init: str = "pytorch", num_classes: int = 10):
    """Construct a model by name; `init="book"` applies the chapter's normal(0, 0.01) weights."""
    if name != "lenet":
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    if init not in INITS:
        raise ValueError(f"unknown init {init!r}; choose one of {', '.join(INITS)}")
    model = LeNet(num_classes=num_classes)
    if init == "book":
        book_init(model)
    return model


__all__ = ["LeNet", "book_init", "build_model", "MODELS", "INITS"]
