"""Unbiased stochastic quantisation of the values on a support, for messages below 16 bits (issue: fewer bits per
value).

A vector v is sent as ``bits``-bit symbols on L = 2**bits levels spread evenly over [-scale, scale], with
scale = max |v| (one float32 per vector, e.g. per layer): level k is scale * (2k - (L - 1)) / (L - 1). L - 1 is
odd, so no level is 0: a value on the support never decodes to 0 and the support survives quantisation.
Each value is rounded to one of its two neighbouring levels at random, with the probabilities that make the
decoded value's expectation exactly v (stochastic rounding): E[dequantise(quantise(v))] = v, and the error of
one value is below one level spacing, 2 * scale / (L - 1).

The QSGD quantiser (Alistarh et al. 2017; FedPAQ's, REFERENCE.md) scales by the norm instead: s levels
||v|| * l / s, l = 0..s, each sign, 0 among them, also unbiased. Most values of a long vector round to 0, so its
symbols range-code to well under a bit each; ``bits`` bits hold s = 2**(bits - 1) - 1 (2s + 1 symbols).

``nearest``: for a sender that sends what it rounds off again (an error-feedback downlink), the 2**bits - 1 levels
of the same span, 0 among them, and each value to its nearest level: deterministic and biased, the error of one
value at most half a spacing, and the many small values of an update on the one symbol 0, which range-codes cheaply.
"""

from __future__ import annotations

import numpy as np

from .codec import _MAX_LEVELS, CodecError, _Reader, decode_quantized, encode_quantized
from .coding.values import decode_symbols, encode_symbols

MIN_BITS, MAX_BITS = 1, 12


def _levels(bits: int) -> int:
    if not MIN_BITS <= int(bits) <= MAX_BITS:
        raise ValueError(f"quantisation bits must be in {MIN_BITS}..{MAX_BITS}, got {bits}")
    return 1 << int(bits)


def quantize(values: np.ndarray, bits: int, rng: np.random.Generator, clip: float | None = None,
             nearest: bool = False) -> tuple[np.ndarray, float]:
    """(symbols in 0..L-1, scale): unbiased stochastic rounding of ``values`` onto the 2**bits levels. ``clip``:
    the scale is at most ``clip`` times the values' root mean square, and larger values round to the end levels
    (biased; for a sender that sends what it rounds off again, an error-feedback downlink). ``nearest``: onto
    :func:`level_count`'s 2**bits - 1 levels, each value to its nearest (module docstring)."""
    levels = level_count(bits, nearest)
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    largest = float(np.abs(v).max()) if v.size else 0.0
    if clip is not None and v.size:
        largest = min(largest, clip * float(np.sqrt(np.mean(v * v))))
    scale = float(np.float32(largest))  # the receiver sees a float32 scale
    if scale == 0.0 or not np.isfinite(scale):
        if v.size and not np.isfinite(scale):
            raise ValueError("cannot quantise NaN or Inf")
        return np.zeros(v.size, np.int64), scale
    # position on the level axis, in [0, L - 1] (clipped: max |v| may round up to the float32 scale)
    t = np.clip((v / scale + 1.0) * (levels - 1) / 2.0, 0.0, levels - 1)
    if nearest:
        return np.rint(t).astype(np.int64), scale
    low = np.floor(t)
    up = rng.random(v.size) < (t - low)
    return np.minimum(low + up, levels - 1).astype(np.int64), scale


def level_count(bits: int, nearest: bool = False) -> int:
    """The levels of ``bits``-bit symbols: 2**bits, or with ``nearest`` 2**bits - 1 (odd: 0 among them; bits >= 2)."""
    if nearest and int(bits) < 2:
        raise ValueError(f"nearest rounding needs at least 2 bits (3 levels), got {bits}")
    return _levels(bits) - int(nearest)


def level_values(symbols: np.ndarray, levels: int, scale: float) -> np.ndarray:
    """The values (float64) of ``symbols`` on ``levels`` levels spread evenly over [-scale, scale]: symbol k at
    scale * (2k - (L - 1)) / (L - 1), the max-scaled levels and QSGD's (L = 2s + 1, 0 among them) alike."""
    return float(scale) * (2.0 * np.asarray(symbols, dtype=np.float64) - (levels - 1)) / (levels - 1)


def encode_stochastic(values: np.ndarray, bits: int, rng: np.random.Generator, coded: bool = False,
                      clip: float | None = None, nearest: bool = False) -> bytes:
    """``values`` as ``bits``-bit symbols plus one float32 scale: written at ``bits`` bits each (codec layout
    ``quantized``), or range-coded (``coded``: layout ``coded``, :mod:`dturbo.coding.values`; the same symbols, so
    the same decoded values, in fewer bytes). ``clip``, ``nearest``: :func:`quantize`'s."""
    symbols, scale = quantize(values, bits, rng, clip, nearest)
    return (encode_symbols if coded else encode_quantized)(symbols, level_count(bits, nearest), [scale])


def encode_sign(values: np.ndarray, coded: bool = False) -> bytes:
    """``values`` as their signs times their mean magnitude m (one float32): 1 bit each, deterministic and biased.
    What it rounds off is never more than the values: |v - m sign(v)|^2 = |v|^2 - d m^2 for d values, so a sender
    that adds it to its next message (error feedback; Karimireddy et al. 2019) loses nothing for good. Decoded by
    :func:`decode_stochastic` at 1 bit (levels -m and +m)."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(v)):
        raise ValueError("cannot quantise NaN or Inf")
    scale = float(np.float32(np.abs(v).mean())) if v.size else 0.0
    return (encode_symbols if coded else encode_quantized)((v >= 0).astype(np.int64), 2, [scale])


def encode_top_ternary(values: np.ndarray, share: float, coded: bool = False) -> bytes:
    """``values`` as STC's sparse ternary vector (Sattler et al. 2019): the ``share`` of them largest in magnitude
    (ceil(share n), nonzero ones only) as their signs times their mean magnitude m (one float32), every other value
    0; symbols 0, 1, 2 on the 3 levels -m, 0, +m. Deterministic and biased; what it leaves out is never more than
    the values: |v - t|^2 = |v|^2 - k m^2 for the k values kept, so a sender that sends it again (error feedback)
    loses nothing for good. Most symbols are the middle one, so range-coded (``coded``) they cost about the
    entropy of the share, well under a bit each. Decoded by :func:`decode_top_ternary`."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"the ternary share must be in (0, 1], got {share}")
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(v)):
        raise ValueError("cannot quantise NaN or Inf")
    symbols = np.ones(v.size, np.int64)
    k = min(int(np.ceil(share * v.size)), int(np.count_nonzero(v)))
    scale = 0.0
    if k:
        top = np.argpartition(-np.abs(v), k - 1)[:k]
        scale = float(np.float32(np.abs(v[top]).mean()))
        symbols[top] = np.where(v[top] > 0, 2, 0)
    return (encode_symbols if coded else encode_quantized)(symbols, 3, [scale])


def decode_top_ternary(payload: bytes, count: int, coded: bool = False) -> np.ndarray:
    """Inverse of :func:`encode_top_ternary` (up to what it leaves out): exactly ``count`` values in {-m, 0, +m}, or
    CodecError."""
    symbols, scale = _read(payload, 3, 2, count, coded, ("ternary", "levels", "magnitude"))
    return level_values(symbols, 3, scale)


def decode_stochastic(payload: bytes, bits: int, count: int, coded: bool = False, nearest: bool = False
                      ) -> np.ndarray:
    """Inverse of :func:`encode_stochastic` (up to the rounding): exactly ``count`` values on 2**bits levels (with
    ``nearest`` 2**bits - 1) with a finite, non-negative scale, or CodecError. ``coded`` and ``nearest`` must be
    what the sender used."""
    levels = level_count(bits, nearest)
    symbols, scale = _read(payload, levels, bits, count, coded, ("quantised", "levels", "scale"))
    return level_values(symbols, levels, scale)


def payload_levels(payload: bytes) -> int:
    """The level count a quantised payload starts with (fixed-length and range-coded alike), or CodecError: which
    of two schemes wrote it, when they differ in levels."""
    return _Reader(payload).varint(limit=_MAX_LEVELS, what="level count")  # as decode_quantized reads it


def _read(payload: bytes, levels: int, bits: int, count: int, coded: bool, words: tuple[str, str, str]
          ) -> tuple[np.ndarray, float]:
    """(symbols, scale) of a payload of ``count`` symbols on ``levels`` levels and one finite, non-negative float
    parameter, or CodecError; ``words``: what the payload, its levels and its parameter are called."""
    what, unit, param = words
    symbols, got, params = (decode_symbols if coded else decode_quantized)(payload, max_elements=count)
    if got != levels:
        raise CodecError(f"{what} payload has {got} {unit}, expected {levels} ({bits} bits)")
    if params.shape != (1,) or not np.isfinite(params[0]) or params[0] < 0:
        raise CodecError(f"{what} payload needs one finite, non-negative {param}")
    if symbols.shape != (count,):
        raise CodecError(f"{what} payload has {symbols.size} values, expected {count}")
    return symbols, float(params[0])


def qsgd_encode(v: np.ndarray, s: int, rng: np.random.Generator) -> tuple[np.ndarray, float]:
    """Symbols in 0..2s and the norm of QSGD with s levels (unbiased stochastic rounding); a vector of zeros or of
    non-finite norm gives s everywhere (0) and norm 0."""
    norm = float(np.linalg.norm(v))
    if norm == 0.0 or not np.isfinite(norm):
        return np.full(v.size, s, dtype=np.int64), 0.0
    scaled = s * np.abs(v) / norm
    low = np.floor(scaled)
    level = low + (rng.random(v.size) < scaled - low)
    return (s + np.sign(v) * level).astype(np.int64), norm


def qsgd_decode(symbols: np.ndarray, s: int, norm: float) -> np.ndarray:
    """The values of QSGD ``symbols`` (float64)."""
    return level_values(symbols, 2 * s + 1, norm)


def norm_levels(bits: int) -> int:
    """QSGD's s that ``bits`` bits hold: 2s + 1 <= 2**bits symbols, s >= 1 (so bits >= 2)."""
    if not 2 <= int(bits) <= MAX_BITS:
        raise ValueError(f"norm-scaled quantisation needs bits in 2..{MAX_BITS}, got {bits}")
    return (1 << (int(bits) - 1)) - 1


def encode_norm(values: np.ndarray, bits: int, rng: np.random.Generator, coded: bool = True) -> bytes:
    """``values`` by QSGD with s = :func:`norm_levels` (``bits``): 2s + 1 symbols plus the float32 norm, written
    at ``bits`` bits each or range-coded (``coded``)."""
    s = norm_levels(bits)
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(v)):
        raise ValueError("cannot quantise NaN or Inf")
    symbols, norm = qsgd_encode(v, s, rng)
    return (encode_symbols if coded else encode_quantized)(symbols, 2 * s + 1, [norm])


def decode_norm(payload: bytes, bits: int, count: int, coded: bool = True) -> np.ndarray:
    """Inverse of :func:`encode_norm` (up to the rounding): exactly ``count`` values, or CodecError."""
    s = norm_levels(bits)
    symbols, norm = _read(payload, 2 * s + 1, bits, count, coded, ("norm-scaled", "symbols", "norm"))
    return qsgd_decode(symbols, s, norm)
