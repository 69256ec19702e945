"""What several methods read of a model's layers: each layer's support grid (docs/algorithm.md §2) and the
Erdos-Renyi-kernel spread of a density budget over layers (D-Turbo-VBI's layer targets, FedDST's masks).

A layer's support grid is its weight matrix *as its GEMM uses it*: Linear is (out_features x in_features); Conv2d is
(out_channels x in_channels/groups * kh * kw) (Conv1d / Conv3d alike). With this choice a cluster in the grid is a
block of the computation.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch
from torch import nn


def grid_shape(layer: nn.Module) -> tuple[int, int]:
    """(K, M) of a layer's support grid (docs/algorithm.md §2)."""
    weight = getattr(layer, "weight_mu", None)
    if weight is None:
        weight = getattr(layer, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(layer).__name__} has no weight tensor")
    return int(weight.shape[0]), int(weight[0].numel())


def layer_kind(layer: nn.Module) -> Literal["conv", "dense"]:
    """'conv' for convolutional layers (1-, 2- or 3-D), 'dense' for fully connected ones (prior settings are per
    kind)."""
    weight = getattr(layer, "weight_mu", getattr(layer, "weight", None))
    return "conv" if weight is not None and weight.dim() >= 3 else "dense"


def erk_densities(shapes: list[tuple[int, ...]], sizes: np.ndarray, density: float,
                  fixed: np.ndarray | None = None) -> np.ndarray:
    """Densities by the Erdos-Renyi-kernel rule (Evci et al. 2020): layer l keeps eps * sum(shape_l) / prod(shape_l),
    capped at 1, with eps such that sum(d_l * sizes_l) = density * sum(sizes) (``sizes``: what a layer counts in the
    budget; a layer at the cap is dense and eps is solved again without it). ``fixed``: the layers' densities set
    beforehand, NaN for those the rule spreads."""
    raw = np.array([sum(s) / math.prod(s) for s in shapes], dtype=np.float64)
    fixed = np.full(raw.size, np.nan) if fixed is None else np.asarray(fixed, dtype=np.float64)
    free = np.isnan(fixed)
    dense = np.zeros(raw.size, dtype=bool)
    budget = density * sizes.sum() - (fixed[~free] * sizes[~free]).sum()
    while True:  # at most one pass per layer: each pass caps at least one more
        spread = free & ~dense
        eps = (budget - sizes[free & dense].sum()) / max((raw[spread] * sizes[spread]).sum(), 1e-300)
        over = spread & (eps * raw > 1.0)
        if not over.any():
            break
        dense |= over
    return np.where(free, np.where(dense, 1.0, np.clip(eps * raw, 0.0, 1.0)), fixed)
