"""The federation: a run's data, its training set split among the clients (seeded), the test and validation sets."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .algorithms.base import ClientData
from .config import Config
from .data import Dataset, load_dataset, partition_dirichlet, partition_iid


@dataclass
class Federation:
    dataset: Dataset
    clients: list[ClientData]
    x_test: torch.Tensor
    y_test: torch.Tensor
    x_val: torch.Tensor | None = None  # held out of the training set (data.validation), never trained on
    y_val: torch.Tensor | None = None

    @property
    def total_samples(self) -> int:
        return sum(len(c) for c in self.clients)


def build_federation(cfg: Config, dataset: Dataset | None = None) -> Federation:
    """Load the data and split the training set among the clients (seeded)."""
    ds = dataset or load_dataset(
        cfg.data.name, cfg.data.path, limit_train=cfg.data.limit_train, limit_test=cfg.data.limit_test,
        seed=cfg.experiment.seed, standardize=cfg.data.standardize, layout=cfg.data.layout,
    )
    f = cfg.federation
    x_train, y_train, val = ds.x_train, ds.y_train, None
    if cfg.data.validation > 0:
        # Carved before the clients' split, seeded apart from it: hyperparameters are chosen on it, never on test.
        order = np.random.default_rng([cfg.experiment.seed, 0x7A1]).permutation(len(y_train))
        n_val = max(1, round(cfg.data.validation * len(y_train)))
        held, kept = np.sort(order[:n_val]), np.sort(order[n_val:])
        val = (torch.from_numpy(x_train[held]), torch.from_numpy(y_train[held]))
        x_train, y_train = x_train[kept], y_train[kept]
    if f.clients > len(y_train):
        raise ValueError(f"federation.clients ({f.clients}) exceeds the number of training samples ({len(y_train)})")
    if f.partition == "dirichlet":
        parts = partition_dirichlet(y_train, f.clients, f.alpha, seed=cfg.experiment.seed,
                                    min_size=min(f.min_partition_size, len(y_train) // f.clients))
    else:
        parts = partition_iid(len(y_train), f.clients, seed=cfg.experiment.seed)
    x = torch.from_numpy(x_train)
    y = torch.from_numpy(y_train)
    clients = [ClientData(x[idx], y[idx]) for idx in (torch.from_numpy(p) for p in parts)]
    return Federation(ds, clients, torch.from_numpy(ds.x_test), torch.from_numpy(ds.y_test), *(val or (None, None)))
