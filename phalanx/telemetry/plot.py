"""The book's animator, after the fact: test (and train) accuracy per epoch as a PNG."""

from __future__ import annotations

import io
import os
from typing import Sequence

from phalanx.atomic import atomic_write_bytes


def plot_accuracy(
    path: str | os.PathLike,
    *,
    epochs: Sequence[int],
    test_acc: Sequence[float],
    train_acc: Sequence[float] | None = None,
    title: str = "",
) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=100)
    ax.plot(list(epochs), list(test_acc), marker="o", label="test acc")
    if train_acc is not None:
        ax.plot(list(epochs), list(train_acc), linestyle="--", label="train acc")
    ax.set_xlabel("epoch")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0.0, 1.0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())
