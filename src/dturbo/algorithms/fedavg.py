"""FedAvg (McMahan et al. 2017): the uncompressed reference. Every client (or
``federation.clients_per_round``) trains from the global model and uploads its weights; the server averages
them weighted by n_t. ``fedavg.dtype`` = float32 (the 32-bit reference) or float16
(docs/algorithm.md §9: 16-bit transmission)."""

from __future__ import annotations

import numpy as np

from ..codec import encode_dense
from .point import PointClient, PointServer


class FedAvgServer(PointServer):
    name = "fedavg"
    semantics = "weights"
    weighting = "samples"
    up_layout = "dense"

    @property
    def dtype(self) -> str:
        return self.cfg.fedavg.dtype


class FedAvgClient(PointClient):
    name = "fedavg"

    def encode_theta(self, local: np.ndarray, start: np.ndarray, rng: np.random.Generator) -> bytes:
        return encode_dense(local, dtype=self.cfg.fedavg.dtype)
