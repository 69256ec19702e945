"""What a valid upload of one round can hold (docs/robustness.md), as data, checked in one place
(:meth:`dturbo.algorithms.server.ServerBase.receive`) after an upload decodes and before anything of it is stored.

Each algorithm states its round's :class:`UploadBounds` from the global model (:meth:`ServerBase.bounds`): a
:class:`Limit` per vector its uploads carry (an upload names its vectors, :meth:`Upload.vectors`); the runner adds who
sent each upload and the partition sizes the server knows. An upload is refused, with the reason, when

* a value lies outside its limit: ``|value| <= GROWTH * max(1, the largest magnitude of the global layer)``, at most
  :data:`VALUE_CAP` (an update is checked as the weights it makes, global + update); a sigma must be > 0 and at most
  ``GROWTH`` times the layer's largest global sigma;
* its training loss is not a finite number in ``0..LOSS_MAX``;
* its n_t is not the sample count of the client's partition (1..n when the partitions are unknown);
* it claims another client id than the client the server asked, or a client answers twice in a round.

The limits leave an honest client far inside (local training moves weights by a few learning rates a step), keep
every aggregate representable in float16 (a weighted mean of values inside a limit is inside it), and refuse the
values that break a run (3e38) or poison it outright (65504).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

GROWTH = 16.0  # an upload's values may reach this times the global layer's largest magnitude (at least 1)
VALUE_CAP = 1e4  # and never more: every aggregate stays far inside float16 (65504)
SIGMA_FLOOR = 1e-6  # the smallest global sigma the sigma limit scales from
LOSS_MAX = 1e6  # the largest training loss (a mean cross-entropy) an upload may report


def magnitude(*global_values: np.ndarray) -> float:
    """The largest magnitude a layer's uploaded values may take, from its global values."""
    top = max((float(np.max(np.abs(v))) for v in global_values if np.size(v)), default=0.0)
    return min(GROWTH * max(1.0, top), VALUE_CAP)


def sigma_limit(global_sigma: np.ndarray) -> float:
    """The largest sigma a layer's upload may hold, from its global sigma."""
    top = float(np.max(global_sigma)) if np.size(global_sigma) else 0.0
    return min(GROWTH * max(SIGMA_FLOOR, top), VALUE_CAP)


@dataclass(frozen=True)
class Limit:
    """What one vector of an upload may hold: ``|reference + value| <= largest`` (``reference``: the global values
    an update applies to; None: the values themselves), and > 0 everywhere when ``positive``."""

    largest: float
    reference: np.ndarray | None = None
    positive: bool = False

    def refusal(self, name: str, values: np.ndarray) -> str | None:
        v = np.asarray(values, dtype=np.float64).reshape(-1)
        if not v.size:
            return None
        if not np.all(np.isfinite(v)):
            return f"{name} contains NaN or Inf"
        if self.positive and float(v.min()) <= 0:
            return f"{name} holds {float(v.min()):.3g}, must be > 0"
        made = v if self.reference is None else v + np.asarray(self.reference, dtype=np.float64).reshape(-1)
        top = float(np.max(np.abs(made)))
        if top > self.largest:
            what = "makes weights of magnitude" if self.reference is not None else "holds a value of magnitude"
            return f"{name} {what} {top:.4g}, beyond the bound {self.largest:.4g} of this round"
        return None


@dataclass
class UploadBounds:
    """The bounds of one round's uploads: ``limits`` by vector name (those an upload lists in
    :meth:`~dturbo.algorithms.server.Upload.vectors`); ``partitions``: each client's sample count, where the server
    knows them (else n_t only has to lie in 1..n, checked at decoding)."""

    limits: dict[str, Limit] = field(default_factory=dict)
    partitions: Sequence[int] | None = None

    def refusal(self, vectors: dict[str, np.ndarray], losses: dict[str, float], n_t: int, claimed: int,
                sender: int | None) -> str | None:
        """Why an upload (its vectors, training losses, n_t and claimed client id) from ``sender`` (None: unknown)
        is refused, or None when it is inside the bounds."""
        if sender is not None:
            if claimed != sender:
                return f"the upload claims to be client {claimed}'s, it came from client {sender} (spoofed or copied)"
            if self.partitions is not None and 0 <= sender < len(self.partitions) \
                    and n_t != self.partitions[sender]:
                return f"n_t = {n_t}, client {sender} holds {self.partitions[sender]} samples"
        for key, value in losses.items():
            low = 0.0 if key == "nll" else -LOSS_MAX
            if not (math.isfinite(value) and low <= value <= LOSS_MAX):
                return f"training loss {key} = {value!r}, outside {low:g}..{LOSS_MAX:g}"
        for name, values in vectors.items():
            limit = self.limits.get(name)
            if limit is not None and (why := limit.refusal(name, values)) is not None:
                return why
        return None
