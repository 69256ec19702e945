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
