"""Splitting a training set among clients: Dirichlet label skew (non-IID) or IID, and a skew measure."""

from __future__ import annotations

import numpy as np

from .readers import DataError


def _check_clients(num_clients: int, num_samples: int) -> None:
    if isinstance(num_clients, bool) or not isinstance(num_clients, int | np.integer):
        raise ValueError(f"num_clients must be an integer, got {num_clients!r}")
    if not 1 <= num_clients <= num_samples:
        raise ValueError(f"num_clients must be in [1, number of samples={num_samples}], got {num_clients}")


def _check_labels(labels: np.ndarray) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be a 1-d integer array, got {labels.dtype} {labels.shape}")
    if labels.size and labels.min() < 0:
        raise ValueError("labels must be non-negative")
    return labels


def partition_iid(num_samples: int, num_clients: int, *, seed: int) -> list[np.ndarray]:
    """A seeded random split of ``range(num_samples)`` into ``num_clients`` parts whose sizes differ by at
    most one. Returns sorted int64 index arrays."""
    _check_clients(num_clients, num_samples)
    perm = np.random.default_rng(seed).permutation(num_samples)
    return [np.sort(p).astype(np.int64) for p in np.array_split(perm, num_clients)]


def partition_dirichlet(
    labels: np.ndarray, num_clients: int, alpha: float, *, seed: int, min_size: int = 10, max_tries: int = 100
) -> list[np.ndarray]:
    """The per-class Dirichlet(alpha) split of the FL literature (Hsu et al., 2019).

    For each class, proportions over the clients are drawn from Dir(alpha) and that class's shuffled
    indices are cut accordingly, so every sample goes to exactly one client. Smaller alpha means stronger
    label skew; alpha -> infinity approaches an IID split. The whole draw is repeated (at most
    ``max_tries`` times) until every client holds at least ``min_size`` samples.

    Args:
        labels: (N,) non-negative integer labels.
        num_clients: number of parts, 1 <= num_clients <= N.
        alpha: Dirichlet concentration, > 0.
        seed: seed of ``np.random.default_rng``; the split is a function of (labels, arguments, seed).
        min_size: smallest acceptable part.
        max_tries: draws before giving up.

    Returns:
        ``num_clients`` sorted int64 index arrays into ``labels``, pairwise disjoint, covering all of it.

    Raises:
        ValueError: an argument is out of range (the message names it).
        DataError: no draw within ``max_tries`` gave every client ``min_size`` samples.
    """
    labels = _check_labels(labels)
    n = labels.shape[0]
    if not alpha > 0 or not np.isfinite(alpha):
        raise ValueError(f"alpha must be a finite number > 0, got {alpha}")
    _check_clients(num_clients, n)
    if min_size < 0:
        raise ValueError(f"min_size must be >= 0, got {min_size}")
    if max_tries < 1:
        raise ValueError(f"max_tries must be >= 1, got {max_tries}")
    if num_clients * min_size > n:
        raise DataError(f"{num_clients} clients with at least min_size={min_size} samples each need "
                        f"{num_clients * min_size} samples but there are {n}; use fewer clients or a smaller "
                        f"min_partition_size")
    rng = np.random.default_rng(seed)
    order = np.argsort(labels, kind="stable")
    classes, starts = np.unique(labels[order], return_index=True)
    by_class = np.split(order, starts[1:])  # each class's indices, ascending
    alphas = np.full(num_clients, float(alpha))
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        ok = True
        for idx in by_class:
            idx = rng.permutation(idx)
            props = rng.dirichlet(alphas)
            if not np.all(np.isfinite(props)):
                ok = False
                break
            cuts = np.minimum((np.cumsum(props)[:-1] * len(idx)).astype(np.int64), len(idx))
            for client, chunk in enumerate(np.split(idx, cuts)):
                parts[client].append(chunk)
        if not ok:
            continue
        out = [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
        if min(len(p) for p in out) >= min_size:
            return out
    raise DataError(
        f"could not give every one of {num_clients} clients at least {min_size} samples with Dirichlet "
        f"alpha={alpha} ({len(classes)} classes, {n} samples) in {max_tries} tries; use a larger alpha, "
        f"fewer clients or a smaller min_partition_size"
    )


def label_skew(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> float:
    """Heterogeneity of a split: the mean, over non-empty clients (unweighted), of the total-variation
    distance between the client's label distribution and the global one.

    0 means every client has exactly the global label mix; the value approaches
    ``1 - 1/num_classes`` (balanced classes) when every client holds a single class.
    """
    labels = _check_labels(labels)
    if len(labels) == 0:
        raise ValueError("labels is empty")
    if labels.max() >= num_classes:
        raise ValueError(f"labels must be < num_classes={num_classes}, found {labels.max()}")
    glob = np.bincount(labels, minlength=num_classes) / len(labels)
    tvs = [0.5 * np.abs(np.bincount(labels[p], minlength=num_classes) / len(p) - glob).sum()
           for p in map(np.asarray, parts) if len(p)]
    if not tvs:
        raise ValueError("parts holds no samples")
    return float(np.mean(tvs))
