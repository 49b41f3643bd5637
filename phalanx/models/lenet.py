"""The LeNet variant of D2L's "Training on Multiple GPUs" (section 13.5), as an `nn.Module`.

conv 1->20 3x3, ReLU, avg-pool 2; conv 20->50 5x5, ReLU, avg-pool 2; linear 800->128, ReLU;
linear 128->10. On a 28x28 input: 26 -> 13 -> 9 -> 4, so the flattened size is 50*4*4 = 800.
The chapter builds it from raw tensors; here it is a module so DDP and phalanx see the same
parameters in the same registration order (which fixes the bucket order).
"""

from torch import nn


class LeNet(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 20, kernel_size=3)
        self.conv2 = nn.Conv2d(20, 50, kernel_size=5)
        self.fc1 = nn.Linear(800, 128)
        self.fc2 = nn.Linear(128, num_classes)
        self.pool = nn.AvgPool2d(kernel_size=2, stride=2)
        self.relu = nn.ReLU()

    def forward(self, x):
        x = self.pool(self.relu(self.conv1(x)))
        x = self.pool(self.relu(self.conv2(x)))
        x = self.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def book_init(model: nn.Module, *, scale: float = 0.01) -> nn.Module:
    """The chapter's initialisation: weights ~ normal(0, scale), biases zero.

    It trains slowly (the loss stays at chance for a few hundred steps) - kept for fidelity with
    the book; PyTorch's default (Kaiming-uniform) init is the CLI default. Normalization layers
    keep their identity start (scale 1, shift 0): a BatchNorm scale drawn from normal(0, 0.01)
    would multiply every normalized activation by ~0.01, which no chapter intends.
    """
    for module in model.modules():
        if isinstance(module, _NORM_LAYERS):
            continue
        for name, param in module.named_parameters(recurse=False):
            if name.endswith("bias"):
                nn.init.zeros_(param)
            else:
                nn.init.normal_(param, mean=0.0, std=scale)
    return model


_NORM_LAYERS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
