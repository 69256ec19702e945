"""DSSM (Ji et al. 2022; REFERENCE.md): dynamic sampling + selective masking.

Round t samples ``max(round(c0 * exp(-decay * t) * n), min_clients)`` clients uniformly. After local training a
client keeps, per layer, the top-k entries by magnitude (k = floor(gamma * size), at least 1) of its update
(``mode = "update"``, default) or of its weights (``mode = "weights"``, the variant of the D-Turbo-VBI authors'
demo) and uploads them as a sparse tensor with positions. The server rebuilds the sparse vectors, averages them
over the participants (no error feedback) and, in update mode, adds the mean to the global model; the download
is dense.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from pydantic import Field

from ..codec import decode_sparse, encode_sparse
from ..config import Config, Probability, Section
from ..protocol import AlgorithmSpec
from .base import sample_uniform
from .point import PointClient, PointLayer, PointMessages, PointServer, sigma_options


def dssm_count(round_idx: int, n: int, c0: float, decay: float, min_clients: int) -> int:
    """Participants of round ``round_idx``: c_t = c0 * exp(-decay * t), floored at ``min_clients``."""
    return min(n, max(int(round(c0 * math.exp(-decay * round_idx) * n)), min_clients))


def top_k(v: np.ndarray, ratio: float) -> np.ndarray:
    """v with all but its k = max(1, floor(ratio * size)) largest-magnitude entries set to 0 (stable ties)."""
    k = max(1, int(math.floor(ratio * v.size)))
    if k >= v.size:
        return v.copy()
    keep = np.argsort(-np.abs(v), kind="stable")[:k]
    out = np.zeros_like(v)
    out[keep] = v[keep]
    return out


class DssmConfig(Section):
    """DSSM (REFERENCE.md): clients sampled with fraction c_t = c0 * exp(-decay * t) (count floored at
    min_clients), per-layer top-k upload with ratio gamma of the update (or of the weights); dense download."""

    c0: Probability = Field(1.0, gt=0, le=1)
    decay: float = Field(0.1, ge=0)
    min_clients: int = Field(2, ge=1)
    gamma: Probability = Field(0.1, gt=0, le=1)
    mode: Literal["update", "weights"] = "update"
    dtype: Literal["float16", "float32"] = "float16"
    weighting: Literal["uniform", "samples"] = Field("uniform", description="mean of updates (paper) or by n_t")


class DssmMessages(PointMessages):
    """The dense download in ``dssm.dtype``; per layer the top-k of the update (or of the weights) as a sparse
    tensor with positions."""

    up_layout = "sparse"

    @property
    def dtype(self) -> str:
        return self.cfg.dssm.dtype

    def encode_theta(self, local: np.ndarray, start: np.ndarray, rng: np.random.Generator) -> bytes:
        d = self.cfg.dssm
        v = local - start if d.mode == "update" else local
        return encode_sparse(top_k(v, d.gamma), dtype=d.dtype)

    def decode_theta(self, payload: bytes, info: PointLayer) -> np.ndarray:
        return decode_sparse(payload, max_elements=info.size).reshape(-1)


class DssmServer(PointServer):
    name = "dssm"
    messages_type = DssmMessages

    def configure(self, cfg: Config) -> None:
        self.semantics = cfg.dssm.mode
        self.weighting = cfg.dssm.weighting

    def select_clients(self, round_idx: int) -> list[int]:
        d, n = self.cfg.dssm, self.cfg.federation.clients
        k = dssm_count(round_idx, n, d.c0, d.decay, d.min_clients)
        return sample_uniform(self.cfg.experiment.seed, round_idx, n, k)


class DssmClient(PointClient):
    name = "dssm"
    messages_type = DssmMessages


def describe(d: DssmConfig) -> str:
    return f"DSSM (gamma={d.gamma:g}{', weights' if d.mode == 'weights' else ''})"


class HostileMajorityWarning(UserWarning):
    """DSSM's smallest rounds may hold as many hostile uploads as honest ones: no robust rule tells them apart."""


def run_warnings(cfg: Config, fed: object) -> list[Warning]:
    """With a robust rule assuming ``byzantine`` attackers, the rounds that shrink to ``min_clients`` need an honest
    majority: at least 2 byzantine + 1 uploads."""
    f, least = cfg.robust.byzantine, cfg.dssm.min_clients
    if cfg.robust.rule == "mean" or least >= 2 * f + 1:
        return []
    return [HostileMajorityWarning(f"dssm.min_clients = {least}: DSSM's rounds shrink to {least} uploads, which may "
                                   f"hold as many of the robust.byzantine = {f} hostile clients as honest ones; set "
                                   f"dssm.min_clients = {2 * f + 1} (2 byzantine + 1)")]


SPEC = AlgorithmSpec("dssm", DssmConfig, DssmServer, DssmClient,
                     default_lr=2e-3, label="DSSM", model_options=sigma_options,
                     describe=describe, run_warnings=run_warnings)
