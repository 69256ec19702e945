"""Shared test fixtures."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest


@pytest.fixture(scope="session")
def make_toy(tmp_path_factory) -> Callable[[int], Path]:
    """A factory of small 4-class npz datasets (12 features, labels from the features, seeded): n training
    samples, the first 200 of them also the test set."""

    def make(n: int) -> Path:
        path = tmp_path_factory.mktemp("data") / "toy.npz"
        rng = np.random.default_rng(0)
        x = rng.normal(size=(n, 12)).astype(np.float32)
        y = (x[:, :3].sum(1) > 0).astype(np.int64) + 2 * (x[:, 3] > 0)
        np.savez(path, x_train=x, y_train=y, x_test=x[:200], y_test=y[:200])
        return path

    return make


@pytest.fixture(scope="session")
def tiny_config() -> Callable[..., dict]:
    """A factory of small, fast D-Turbo-VBI configs (an mlp on flat data, 3 clients, a few local steps) as dicts:
    ``tiny_config(rounds=2, data={...}, dturbo={...})``; sections given replace the defaults' keys they name."""

    def make(rounds: int = 2, **sections: dict) -> dict:
        cfg: dict = {
            "experiment": {"name": "tiny", "seed": 0, "rounds": rounds, "threads": 1},
            "data": {"name": "arrays"},
            "federation": {"clients": 3, "partition": "iid"},
            "model": {"name": "mlp", "hidden": [16]},
            "train": {"local_steps": 3, "batch_size": 32, "lr": 0.01},
            "dturbo": {"sparsity": {"target_density": 0.5, "warmup_rounds": 0, "ramp_rounds": 1}},
        }
        for name, keys in sections.items():
            cfg[name] = {**cfg.get(name, {}), **keys}
        return cfg

    return make
