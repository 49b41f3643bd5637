"""LeNet-BN: phalanx's LeNet with batch normalization, as D2L's "Batch Normalization" (8.5) adds it.

The chapter inserts a BatchNorm layer after every convolutional and fully connected layer except
the output, between the layer and its activation (BatchNorm2d for conv maps: one mean/variance per
channel over batch and space; BatchNorm1d for the hidden linear layer). Applied to the LeNet
variant of "Training on Multiple GPUs" (`lenet.py`):

    conv 1->20 3x3, BN(20), ReLU, avg-pool 2; conv 20->50 5x5, BN(50), ReLU, avg-pool 2;
    linear 800->128, BN(128), ReLU; linear 128->10.

The convolutions keep their biases (redundant before BN, as in the book's code) so the layer
names and the first-layer shapes match `LeNet`. This is the model that makes the choice of
BatchNorm policy across devices (`phalanx.data_parallel.sync_batchnorm`) visible.
"""

from torch import nn


class LeNetBN(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 20, kernel_size=3)
        self.bn1 = nn.BatchNorm2d(20)
        self.conv2 = nn.Conv2d(20, 50, kernel_size=5)
        self.bn2 = nn.BatchNorm2d(50)
        self.fc1 = nn.Linear(800, 128)
        self.bn3 = nn.BatchNorm1d(128)
        self.fc2 = nn.Linear(128, num_classes)
        self.pool = nn.AvgPool2d(kernel_size=2, stride=2)
        self.relu = nn.ReLU()

    def forward(self, x):
        x = self.pool(self.relu(self.bn1(self.conv1(x))))
        x = self.pool(self.relu(self.bn2(self.conv2(x))))
        x = self.relu(self.bn3(self.fc1(x.flatten(1))))
        return self.fc2(x)
