"""Splitting a training set among clients: Dirichlet label skew (non-IID) or IID."""

from __future__ import annotations

import numpy as np

from .readers import DataError


def partition_iid(num_samples: int, num_clients: int, *, seed: int) -> list[np.ndarray]:
    """A seeded random split into ``num_clients`` parts whose sizes differ by at most one."""
    if not 1 <= num_clients <= num_samples:
        raise ValueError(f"num_clients must be in [1, num_samples={num_samples}], got {num_clients}")
    perm = np.random.default_rng(seed).permutation(num_samples)
    return [np.sort(p).astype(np.int64) for p in np.array_split(perm, num_clients)]


def partition_dirichlet(
    labels: np.ndarray, num_clients: int, alpha: float, *, seed: int, min_size: int = 10, max_tries: int = 100
) -> list[np.ndarray]:
    """The per-class Dirichlet(alpha) split of the FL literature (Hsu et al., 2019).

    For each class, proportions over the clients are drawn from Dir(alpha) and that class's shuffled
    indices are cut accordingly. Smaller alpha means stronger label skew. The draw is repeated (bounded)
    until every client holds at least ``min_size`` samples.
    """
    labels = np.asarray(labels)
    n = labels.shape[0]
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if not 1 <= num_clients <= n:
        raise ValueError(f"num_clients must be in [1, number of samples={n}], got {num_clients}")
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            props = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(props)[:-1] * len(idx)).astype(np.int64)
            for client, chunk in enumerate(np.split(idx, cuts)):
                parts[client].append(chunk)
        out = [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
        if min(len(p) for p in out) >= min_size:
            return out
    raise DataError(
        f"could not give every one of {num_clients} clients at least {min_size} samples with Dirichlet "
        f"alpha={alpha} in {max_tries} tries; use a larger alpha, fewer clients or a smaller min_partition_size"
    )


def label_skew(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> float:
    """Mean total-variation distance between each client's label distribution and the global one."""
    labels = np.asarray(labels)
    glob = np.bincount(labels, minlength=num_classes) / len(labels)
    tvs = []
    for p in parts:
        if len(p) == 0:
            continue
        local = np.bincount(labels[p], minlength=num_classes) / len(p)
        tvs.append(0.5 * np.abs(local - glob).sum())
    return float(np.mean(tvs))
