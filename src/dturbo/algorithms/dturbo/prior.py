"""The hierarchical prior of docs/algorithm.md §2: Gamma hyperparameters per layer, and the grid MRF's transitions.

A layer's support grid (:func:`dturbo.nn.shapes.grid_shape`) is its weight matrix as its GEMM uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .spmp import Transitions

if TYPE_CHECKING:
    from .config import PriorConfig


@dataclass(frozen=True)
class LayerPrior:
    """Resolved (absolute) prior of one layer: Gamma(a, b) active, Gamma(a_bar, b_bar) inactive
    (shape/rate), and the grid MRF's transitions (docs/algorithm.md §2)."""

    a: float
    b: float
    a_bar: float
    b_bar: float
    transitions: Transitions
    tie_rows: bool = False  # each row is one support variable (the p11_row -> 1 limit of the row chain)

    def gamma_kwargs(self) -> dict[str, float]:
        return {"a": self.a, "b": self.b, "a_bar": self.a_bar, "b_bar": self.b_bar}


def ties_rows(pc: PriorConfig, normalised: bool) -> bool:
    """Whether a layer's rows are tied: ``tie_rows = true`` in every layer of the section's kind,
    ``"without_batchnorm"`` in those BatchNorm does not follow (``normalised``: under BatchNorm a removed channel
    still outputs its shift, so export cannot remove it, and whole channels cost accuracy there:
    benchmarks/results/batchnorm.md)."""
    return pc.tie_rows is True or (pc.tie_rows == "without_batchnorm" and not normalised)


def resolve_prior(pc: PriorConfig, layer_scale: float, normalised: bool = False) -> LayerPrior:
    """Turn a per-kind prior section (``[dturbo.prior.conv]`` or ``[dturbo.prior.dense]``) into a layer's absolute
    prior. ``layer_scale`` is the layer's own s_l (its initial weight std), used unless the section sets
    ``layer_scale``.

    ``scale="matched"`` (the default, docs/algorithm.md §2): b = a * s_l^2 and b_bar = a_bar * s_l^2 / r, so that the
    active prior variance matches the layer's weight scale s_l and the inactive one is r times smaller.
    ``scale="absolute"``: b and b_bar are used as given (the reference demo's a=b=a_bar=1, b_bar=0.01).
    The transitions' start factor ``start`` applies to the first node of every row chain and every column chain.
    ``normalised``: BatchNorm follows the layer (:func:`ties_rows`).
    """
    a, b, a_bar, b_bar = pc.a, pc.b, pc.a_bar, pc.b_bar
    if pc.scale == "matched":
        scale = pc.layer_scale or layer_scale
        s2 = float(scale) ** 2
        if not s2 > 0:
            raise ValueError(f"layer scale must be positive for scale-matched priors, got {scale}")
        b, b_bar = a * s2, a_bar * s2 / pc.r
    elif pc.scale != "absolute":
        raise ValueError(f"prior scale must be 'matched' or 'absolute', got {pc.scale!r}")
    transitions = Transitions(pc.p01_row, pc.p11_row, pc.p01_col, pc.p11_col, start_row=pc.start, start_col=pc.start)
    return LayerPrior(a, b, a_bar, b_bar, transitions, ties_rows(pc, normalised))
