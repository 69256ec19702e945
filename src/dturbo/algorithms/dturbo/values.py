"""How D-Turbo-VBI writes the weights on a support (``[dturbo.transmission]``: ``up_bits``, ``down_bits``,
``quantizer``, ``values_code``), one small class a scheme; :func:`scheme` picks it. An upload in a quantised scheme
carries the update from the weights the client received (the server adds it to its own mu_G), one in float16 the
weights."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...codec import decode_values, encode_values
from ...quantize import (
    decode_norm,
    decode_stochastic,
    decode_top_ternary,
    encode_norm,
    encode_sign,
    encode_stochastic,
    encode_top_ternary,
    payload_levels,
)
from ..base import MessageError


class Float16:
    """16 bits: the values themselves in float16."""

    layout = "values"
    sends_update = False
    feedback = False  # whether the sender keeps what it rounds off and adds it to its next message

    def encode(self, values: np.ndarray, rng: np.random.Generator) -> bytes:
        return encode_values(np.asarray(values).astype(np.float32), dtype="float16")

    def decode(self, payload: bytes, count: int, name: str) -> np.ndarray:
        return _count(decode_values(payload, max_elements=count), count, name)

    def at(self, settled: bool) -> Float16:
        return self


@dataclass(frozen=True)
class Stochastic:
    """``bits`` < 16: 2**bits levels per layer, unbiased stochastic rounding (:mod:`dturbo.quantize`), written at a
    fixed length (layout ``quantized``) or range-coded (``coded``, :mod:`dturbo.coding.values`)."""

    bits: int
    coded: bool
    sends_update = True
    feedback = False

    @property
    def layout(self) -> str:
        return "coded" if self.coded else "quantized"

    def encode(self, values: np.ndarray, rng: np.random.Generator) -> bytes:
        return encode_stochastic(values, self.bits, rng, self.coded)

    def decode(self, payload: bytes, count: int, name: str) -> np.ndarray:
        return _count(decode_stochastic(payload, self.bits, count, self.coded), count, name)

    def at(self, settled: bool) -> Stochastic:
        """The scheme that encodes a round's downlink, ``settled``: the support has its target density."""
        return self


@dataclass(frozen=True)
class Norm(Stochastic):
    """``quantizer = "norm"``: QSGD's s = 2**(bits - 1) - 1 levels of the layer's norm, 0 among them
    (:mod:`dturbo.quantize`): an update's small values mostly round to 0, so range-coded it costs well under a bit
    a value."""

    def encode(self, values: np.ndarray, rng: np.random.Generator) -> bytes:
        return encode_norm(values, self.bits, rng, self.coded)

    def decode(self, payload: bytes, count: int, name: str) -> np.ndarray:
        return _count(decode_norm(payload, self.bits, count, self.coded), count, name)


@dataclass(frozen=True)
class Clipped(Stochastic):
    """``down_quantizer = "clipped"``: the max scheme with the scale at most :data:`CLIP` times the root mean square,
    larger values on the end levels. An update's few large values no longer spread the levels over a range most
    values never reach, so the rounding error stays a fraction of the update, and the error-feedback downlink
    (``down_mu = "update"``) sends what is clipped or rounded off again the next round. ``nearest`` (``down_rounding
    = "nearest"``): 2**bits - 1 levels, 0 among them, each value to its nearest (:func:`dturbo.quantize.quantize`)."""

    nearest: bool = False

    def encode(self, values: np.ndarray, rng: np.random.Generator) -> bytes:
        return encode_stochastic(values, self.bits, rng, self.coded, clip=CLIP, nearest=self.nearest)

    def decode(self, payload: bytes, count: int, name: str) -> np.ndarray:
        return _count(decode_stochastic(payload, self.bits, count, self.coded, self.nearest), count, name)


@dataclass(frozen=True)
class Sign(Stochastic):
    """``up_quantizer = "sign"`` (``bits`` = 1): each value's sign times the layer's mean magnitude
    (:func:`dturbo.quantize.encode_sign`), deterministic and biased; the client keeps what it rounds off and adds it
    to its next upload (``feedback``; :mod:`dturbo.algorithms.feedback`), which the unbiased levels' rounding error,
    larger than the update itself on most values, would not survive."""

    feedback = True

    def encode(self, values: np.ndarray, rng: np.random.Generator) -> bytes:
        return encode_sign(values, self.coded)


@dataclass(frozen=True)
class Settled(Clipped):
    """:class:`Clipped` levels while the sparsity ramp moves the support, and :meth:`after`'s scheme once it has
    settled (:meth:`at`). The payload's level count (``after_levels``: the later scheme's; the clipped levels are
    more) says which wrote it, so the receiver needs no schedule."""

    after_levels = 0

    def after(self) -> Stochastic:
        raise NotImplementedError

    def at(self, settled: bool) -> Stochastic:
        return self.after() if settled else self

    def decode(self, payload: bytes, count: int, name: str) -> np.ndarray:
        if payload_levels(payload) == self.after_levels:
            return self.after().decode(payload, count, name)
        return super().decode(payload, count, name)


@dataclass(frozen=True)
class SettledSign(Settled):
    """``down_quantizer = "settled_sign"``: :class:`Sign` once the support has settled, when the update is small and
    even (down_bits >= 2: the clipped levels are more than 2)."""

    after_levels = 2

    def after(self) -> Stochastic:
        return Sign(1, self.coded)


@dataclass(frozen=True)
class Ternary(Stochastic):
    """``down_quantizer = "ternary"``: STC's sparse ternary update, the ``share`` of the values largest in magnitude
    as their signs times their mean magnitude, the others 0 (:func:`dturbo.quantize.encode_top_ternary`):
    deterministic and biased, and the error-feedback downlink sends what it leaves out again the next round. A
    client's weights lag mu_G by the values not yet sent, where signs move every weight by the mean magnitude."""

    share: float = 0.1
    feedback = True

    def encode(self, values: np.ndarray, rng: np.random.Generator) -> bytes:
        return encode_top_ternary(values, self.share, self.coded)

    def decode(self, payload: bytes, count: int, name: str) -> np.ndarray:
        return _count(decode_top_ternary(payload, count, self.coded), count, name)


@dataclass(frozen=True)
class SettledTernary(Settled):
    """``down_quantizer = "settled_ternary"``: :class:`Ternary` once the support has settled."""

    share: float = 0.1
    after_levels = 3

    def after(self) -> Stochastic:
        return Ternary(1, self.coded, self.share)


CLIP = 3.0
ValueScheme = Float16 | Stochastic | Norm | Clipped | Sign | Ternary | Settled
QUANTIZERS = {"max": Stochastic, "norm": Norm, "clipped": Clipped, "sign": Sign, "settled_sign": SettledSign}


def scheme(bits: int, coded: bool, quantizer: str = "max", share: float = 0.1, nearest: bool = False
           ) -> ValueScheme:
    """The scheme of ``bits`` (16: float16) with ``values_code = "range"`` (``coded``) or ``"fixed"``, levels
    spread over the largest value (``quantizer = "max"``), the norm (``"norm"``) or at most 3 root mean squares
    (``"clipped"``), the signs times the mean magnitude (``"sign"``; ``"settled_sign"``: once the support has
    settled, clipped before), or the ``share`` of the values largest in magnitude as ternary values
    (``"ternary"``; ``"settled_ternary"``: once the support has settled, clipped before); ``nearest``: the clipped
    levels' rounding (:class:`Clipped`)."""
    if bits == 16:
        return Float16()
    if quantizer == "sign":
        return Sign(1, coded)
    if quantizer == "ternary":
        return Ternary(1, coded, share)
    if quantizer == "settled_ternary":
        return SettledTernary(bits, coded, nearest=nearest, share=share)
    if quantizer in ("clipped", "settled_sign"):
        return QUANTIZERS[quantizer](bits, coded, nearest=nearest)
    return QUANTIZERS[quantizer](bits, coded)


def _count(values: np.ndarray, count: int, name: str) -> np.ndarray:
    if values.shape != (count,):
        raise MessageError(f"{name} has {values.size} values, the support has {count}")
    return values
