"""``dead_units = "cut"``: the weights joined to a unit that carries nothing leave the support.

A conv channel or neuron whose weights are all off the support outputs a constant (its bias, through the ops after
it); the next layer's weights that read it add that constant and nothing else, and export folds them into a bias
(:mod:`dturbo.export.compaction`). A unit the next layer does not read at all computes for nothing. Both kinds of
weight cost every message that carries the support. With the option they leave S when the server decides it
(docs/algorithm.md §7.5), on the links export compacts (:func:`dturbo.export.graph.unit_links`: a layer feeding
exactly one next layer through channel-wise ops), until no link changes: a cut may empty a unit, whose links are cut
in turn. A model whose graph torch.fx cannot capture keeps every weight, with a warning. The calibration of the
density (docs/sparsity.md §2) counts the support before the cut, so a layer's rows are chosen as without it and the
model ends below ``target_density`` by the weights cut.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from functools import cached_property

import numpy as np
import torch
from torch import nn

from .turbo import LayerInfo


class DeadUnits:
    """The links between the Bayesian layers ``layers`` of ``model`` (by index: producer, consumer, units), read from
    the model's graph when first needed (a server built only to check a configuration never traces it)."""

    def __init__(self, model: nn.Module, layers: Sequence[LayerInfo]) -> None:
        self.model = model
        self.layers = list(layers)

    @cached_property
    def links(self) -> list[tuple[int, int, int]]:
        # imported here: the export package's __init__ reads run directories, whose settings import the registry and
        # so this package
        from ...export.format import ExportError
        from ...export.graph import unit_links

        shape = getattr(self.model, "input_shape", None)
        try:
            if not shape:
                raise ExportError("the model records no input_shape: dturbo.bayesianize(..., input_shape=...) or the "
                                  "Flower strategy's input_shape records it")
            links = unit_links(self.model, torch.zeros(2, *shape))
        except ExportError as err:
            # the cut saves bits; a model whose graph cannot be read trains as with "kept", and says so
            warnings.warn(f"dturbo.dead_units = 'cut' cuts nothing: it needs the model's graph ({err})", UserWarning,
                          stacklevel=2)
            links = []
        index = {info.name: i for i, info in enumerate(self.layers)}
        return [(index[p], index[c], units) for p, c, units in links if p in index and c in index
                and self.layers[index[p]].grid[0] == units and self.layers[index[c]].grid[1] % units == 0]

    def cut(self, mus: list[np.ndarray]) -> list[np.ndarray]:
        """The layers' mu_G (grids) with every weight of a unit that carries nothing set to 0, to a fixed point
        (the given arrays are not modified). A link that no unit joins (one layer empty) is left alone: the cut never
        empties a layer."""
        mus = [m.copy() for m in mus]
        changed = True
        while changed:
            changed = False
            for p, c, units in self.links:
                produced = (mus[p] != 0).any(axis=1)  # a unit with a weight on S
                read = mus[c].reshape(mus[c].shape[0], units, -1)  # the consumer's columns by input unit
                used = (read != 0).any(axis=(0, 2))
                if not (produced & used).any():  # no unit joins the two: the link is left as it is
                    continue
                dead_in = ~produced & used
                dead_out = produced & ~used
                if dead_in.any():
                    read[:, dead_in, :] = 0.0
                    changed = True
                if dead_out.any():
                    mus[p][dead_out] = 0.0
                    changed = True
        return mus
