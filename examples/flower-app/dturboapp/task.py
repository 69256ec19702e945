"""dturboapp: the model and the data, as in any Flower PyTorch app.

The model is the app's own small CNN. The data is Fashion-MNIST read by :func:`dturbo.data.load_dataset` (normalised
per channel), its training set split evenly among the nodes (a seeded IID split), each node's share split again
80 / 20 into training and validation data.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dturbo.data import Dataset, load_dataset, partition_iid


class Net(nn.Module):
    """A small CNN for 28 x 28 grey images: two 5 x 5 convolutions with max pooling, then two dense layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5, padding=2)
        self.conv2 = nn.Conv2d(16, 32, 5, padding=2)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(32 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


@lru_cache(maxsize=1)
def fashion_mnist(path: str) -> Dataset:
    """The whole dataset, read once per process."""
    return load_dataset("fashion-mnist", path)


def load_data(partition_id: int, num_partitions: int, path: str, batch_size: int,
              limit: int = 0) -> tuple[DataLoader, DataLoader]:
    """This node's training and validation loaders (``limit`` > 0: only the first ``limit`` samples of its share)."""
    ds = fashion_mnist(path)
    idx = partition_iid(len(ds.y_train), num_partitions, seed=42)[partition_id]
    if limit > 0:
        idx = idx[:limit]
    cut = int(0.8 * len(idx))
    x, y = torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train)
    train, val = np.sort(idx[:cut]), np.sort(idx[cut:])
    return (DataLoader(TensorDataset(x[train], y[train]), batch_size=batch_size, shuffle=True),
            DataLoader(TensorDataset(x[val], y[val]), batch_size=batch_size))


def load_test(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The test set, for the server's own evaluation."""
    ds = fashion_mnist(path)
    return torch.from_numpy(ds.x_test), torch.from_numpy(ds.y_test)


@torch.no_grad()
def test(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of ``model`` in eval mode."""
    model.eval()
    loss, correct = 0.0, 0
    for i in range(0, len(y), 1000):
        logits = model(x[i : i + 1000])
        loss += float(F.cross_entropy(logits, y[i : i + 1000], reduction="sum"))
        correct += int((logits.argmax(1) == y[i : i + 1000]).sum())
    return loss / len(y), correct / len(y)
