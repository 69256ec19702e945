"""Unbiased stochastic quantisation of the values on a support, for messages below 16 bits (issue: fewer bits per
value).

A vector v is sent as ``bits``-bit symbols on L = 2**bits levels spread evenly over [-scale, scale], with
scale = max |v| (one float32 per vector, e.g. per layer): level k is scale * (2k - (L - 1)) / (L - 1). L - 1 is
odd, so no level is 0: a value on the support never decodes to 0 and the support survives quantisation.
Each value is rounded to one of its two neighbouring levels at random, with the probabilities that make the
decoded value's expectation exactly v (stochastic rounding): E[dequantise(quantise(v))] = v, and the error of
one value is below one level spacing, 2 * scale / (L - 1).
"""

from __future__ import annotations

import numpy as np

from .codec import CodecError, decode_quantized, encode_quantized
from .coding.values import decode_symbols, encode_symbols

MIN_BITS, MAX_BITS = 1, 12


def _levels(bits: int) -> int:
    if not MIN_BITS <= int(bits) <= MAX_BITS:
        raise ValueError(f"quantisation bits must be in {MIN_BITS}..{MAX_BITS}, got {bits}")
    return 1 << int(bits)


def quantize(values: np.ndarray, bits: int, rng: np.random.Generator) -> tuple[np.ndarray, float]:
    """(symbols in 0..L-1, scale): unbiased stochastic rounding of ``values`` onto the 2**bits levels."""
    levels = _levels(bits)
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    scale = float(np.float32(np.abs(v).max())) if v.size else 0.0  # the receiver sees a float32 scale
    if scale == 0.0 or not np.isfinite(scale):
        if v.size and not np.isfinite(scale):
            raise ValueError("cannot quantise NaN or Inf")
        return np.zeros(v.size, np.int64), scale
    # position on the level axis, in [0, L - 1] (clipped: max |v| may round up to the float32 scale)
    t = np.clip((v / scale + 1.0) * (levels - 1) / 2.0, 0.0, levels - 1)
    low = np.floor(t)
    up = rng.random(v.size) < (t - low)
    return np.minimum(low + up, levels - 1).astype(np.int64), scale


def dequantize(symbols: np.ndarray, bits: int, scale: float) -> np.ndarray:
    """The level values of ``symbols`` (float64)."""
    levels = _levels(bits)
    return float(scale) * (2.0 * np.asarray(symbols, dtype=np.float64) - (levels - 1)) / (levels - 1)


def encode_stochastic(values: np.ndarray, bits: int, rng: np.random.Generator, coded: bool = False) -> bytes:
    """``values`` as ``bits``-bit symbols plus one float32 scale: written at ``bits`` bits each (codec layout
    ``quantized``), or range-coded (``coded``: layout ``coded``, :mod:`dturbo.coding.values`; the same symbols, so
    the same decoded values, in fewer bytes)."""
    symbols, scale = quantize(values, bits, rng)
    return (encode_symbols if coded else encode_quantized)(symbols, _levels(bits), [scale])


def decode_stochastic(payload: bytes, bits: int, count: int, coded: bool = False) -> np.ndarray:
    """Inverse of :func:`encode_stochastic` (up to the rounding): exactly ``count`` values on 2**bits levels with
    a finite, non-negative scale, or CodecError. ``coded`` must be what the sender used."""
    symbols, levels, params = (decode_symbols if coded else decode_quantized)(payload, max_elements=count)
    if levels != _levels(bits):
        raise CodecError(f"quantised payload has {levels} levels, expected {_levels(bits)} ({bits} bits)")
    if params.shape != (1,) or not np.isfinite(params[0]) or params[0] < 0:
        raise CodecError("quantised payload needs one finite, non-negative scale")
    if symbols.shape != (count,):
        raise CodecError(f"quantised payload has {symbols.size} values, expected {count}")
    return dequantize(symbols, bits, float(params[0]))
