"""FedPAQ (Reisizadeh et al. 2020; REFERENCE.md): r = ``federation.clients_per_round`` of n clients per round,
tau = the local steps of ``[train]``, each uploads Q(x_local - x) with the QSGD quantiser of s = ``fedpaq.levels``
levels (per layer); the server adds the mean quantised update; the download is unquantised.

QSGD: Q_i(v) = ||v|| sign(v_i) xi_i / s with xi_i = l + 1 with probability s|v_i|/||v|| - l, else l, where
l = floor(s|v_i|/||v||): unbiased. On the wire, per layer, the float32 norm and one symbol ``s + sign * xi`` in
``0..2s`` per coordinate at ceil(log2(2s + 1)) bits (fixed-length: s = 1 costs 2 bits, s = 32767 costs 16 bits,
the paper's "16-bit transmission"), or range-coded with ``values_code = "range"`` (layout ``coded``,
:mod:`dturbo.coding.values`: the same symbols in fewer bits, as QSGD's own Elias coding of its levels). ``levels = 0``
sends the update unquantised in ``fedpaq.dtype``.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from ..codec import decode_dense, decode_quantized, encode_dense, encode_quantized
from ..coding.values import decode_symbols, encode_symbols
from ..config import Config, Section, ValuesCode
from ..protocol import AlgorithmSpec
from ..quantize import qsgd_decode, qsgd_encode
from .base import MessageError
from .point import PointClient, PointLayer, PointMessages, PointServer, sigma_options


class FedPaqConfig(Section):
    """FedPAQ (REFERENCE.md): r = federation.clients_per_round clients, tau = the local steps of [train],
    the QSGD quantiser with ``levels`` = s levels on the update; unquantised download."""

    levels: int = Field(32767, ge=0, le=2**31 - 1, description="QSGD s; 0 = no quantisation (dtype values)")
    dtype: Literal["float16", "float32"] = Field("float16", description="download, and the upload when levels = 0")
    weighting: Literal["uniform", "samples"] = Field("uniform", description="mean of updates (paper) or by n_t")
    values_code: ValuesCode = Field("fixed", description=(
        "how the QSGD symbols are written: fixed, ceil(log2(2s + 1)) bits each; range, range-coded under a "
        "discretised Gaussian or Laplace fitted per layer (lossless, as QSGD's own Elias coding; "
        "dturbo.coding.values)"))

    @model_validator(mode="after")
    def _coded_levels(self) -> FedPaqConfig:
        if self.values_code == "range" and not 1 <= self.levels <= 32767:
            raise ValueError(f"values_code = 'range' codes QSGD symbols with levels in 1..32767, got {self.levels}")
        return self


class FedPaqMessages(PointMessages):
    """The dense download in ``fedpaq.dtype``; per layer the QSGD-quantised update (``levels`` > 0) or the dense
    update."""

    @property
    def coded(self) -> bool:
        return self.cfg.fedpaq.values_code == "range"

    @property
    def up_layout(self) -> str:  # type: ignore[override]
        if self.cfg.fedpaq.levels == 0:
            return "dense"
        return "coded" if self.coded else "quantized"

    @property
    def dtype(self) -> str:
        return self.cfg.fedpaq.dtype

    def encode_theta(self, local: np.ndarray, start: np.ndarray, rng: np.random.Generator) -> bytes:
        s = self.cfg.fedpaq.levels
        update = local - start
        if s == 0:
            return encode_dense(update, dtype=self.cfg.fedpaq.dtype)
        symbols, norm = qsgd_encode(update, s, rng)
        return (encode_symbols if self.coded else encode_quantized)(symbols, 2 * s + 1, [norm])

    def decode_theta(self, payload: bytes, info: PointLayer) -> np.ndarray:
        s = self.cfg.fedpaq.levels
        if s == 0:
            return decode_dense(payload, max_elements=info.size).reshape(-1)
        symbols, levels, params = (decode_symbols if self.coded else decode_quantized)(payload, max_elements=info.size)
        if levels != 2 * s + 1 or params.shape != (1,):
            raise MessageError(f"{info.name}: expected QSGD with {2 * s + 1} levels and one norm")
        norm = float(params[0])
        if not (np.isfinite(norm) and norm >= 0):
            raise MessageError(f"{info.name}: invalid QSGD norm {norm}")
        return qsgd_decode(symbols, s, norm)


class FedPaqServer(PointServer):
    name = "fedpaq"
    semantics = "update"
    messages_type = FedPaqMessages

    def configure(self, cfg: Config) -> None:
        self.weighting = cfg.fedpaq.weighting


class FedPaqClient(PointClient):
    name = "fedpaq"
    messages_type = FedPaqMessages


def describe(f: FedPaqConfig) -> str:
    return f"FedPAQ (s={f.levels})" if f.levels else "FedPAQ (unquantised)"

SPEC = AlgorithmSpec("fedpaq", FedPaqConfig, FedPaqServer, FedPaqClient,
                     default_lr=2e-3, label="FedPAQ", model_options=sigma_options,
                     describe=describe)
