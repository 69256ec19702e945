"""How D-Turbo-VBI writes the weights on a support (``[dturbo.transmission]``: ``up_bits``, ``down_bits``,
``values_code``), one small class a scheme; :func:`scheme` picks it. An upload in a quantised scheme carries the
update from the weights the client received (the server adds it to its own mu_G), one in float16 the weights."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...codec import decode_values, encode_values
from ...quantize import decode_stochastic, encode_stochastic
from ..base import MessageError


class Float16:
    """16 bits: the values themselves in float16."""

    layout = "values"
    sends_update = False

    def encode(self, values: np.ndarray, rng: np.random.Generator) -> bytes:
        return encode_values(np.asarray(values).astype(np.float32), dtype="float16")

    def decode(self, payload: bytes, count: int, name: str) -> np.ndarray:
        return _count(decode_values(payload, max_elements=count), count, name)


@dataclass(frozen=True)
class Stochastic:
    """``bits`` < 16: 2**bits levels per layer, unbiased stochastic rounding (:mod:`dturbo.quantize`), written at a
    fixed length (layout ``quantized``) or range-coded (``coded``, :mod:`dturbo.coding.values`)."""

    bits: int
    coded: bool
    sends_update = True

    @property
    def layout(self) -> str:
        return "coded" if self.coded else "quantized"

    def encode(self, values: np.ndarray, rng: np.random.Generator) -> bytes:
        return encode_stochastic(values, self.bits, rng, self.coded)

    def decode(self, payload: bytes, count: int, name: str) -> np.ndarray:
        return _count(decode_stochastic(payload, self.bits, count, self.coded), count, name)


ValueScheme = Float16 | Stochastic


def scheme(bits: int, coded: bool) -> ValueScheme:
    """The scheme of ``bits`` (16: float16) with ``values_code = "range"`` (``coded``) or ``"fixed"``."""
    return Float16() if bits == 16 else Stochastic(bits, coded)


def _count(values: np.ndarray, count: int, name: str) -> np.ndarray:
    if values.shape != (count,):
        raise MessageError(f"{name} has {values.size} values, the support has {count}")
    return values
