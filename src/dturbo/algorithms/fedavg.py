"""FedAvg (McMahan et al. 2017): the uncompressed reference. Every client (or
``federation.clients_per_round``) trains from the global model and uploads its weights; the server averages
them weighted by n_t. ``fedavg.dtype`` = float32 (the 32-bit reference) or float16
(docs/algorithm.md §9: 16-bit transmission)."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from ..codec import encode_dense
from ..config import Section
from ..protocol import AlgorithmSpec
from .point import PointClient, PointMessages, PointServer, sigma_options


class FedAvgConfig(Section):
    """FedAvg: every client each round (or federation.clients_per_round), weights averaged by n_t."""

    dtype: Literal["float16", "float32"] = Field("float16", description="transmission dtype, both directions")


class FedAvgMessages(PointMessages):
    """Dense weights both ways in ``fedavg.dtype``."""

    up_layout = "dense"

    @property
    def dtype(self) -> str:
        return self.cfg.fedavg.dtype

    def encode_theta(self, local: np.ndarray, start: np.ndarray, rng: np.random.Generator) -> bytes:
        return encode_dense(local, dtype=self.dtype)


class FedAvgServer(PointServer):
    name = "fedavg"
    semantics = "weights"
    weighting = "samples"
    messages_type = FedAvgMessages


class FedAvgClient(PointClient):
    name = "fedavg"
    messages_type = FedAvgMessages


def describe(f: FedAvgConfig) -> str:
    return f"FedAvg {f.dtype.replace('float', '')}-bit"

SPEC = AlgorithmSpec("fedavg", FedAvgConfig, FedAvgServer, FedAvgClient,
                     default_lr=2e-3, label="FedAvg", model_options=sigma_options,
                     describe=describe)
