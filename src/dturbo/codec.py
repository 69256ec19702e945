"""Bytes of every message (docs/algorithm.md §9): cluster-coded grids, dense / sparse / value tensors, message framing.

§9: "every message is encoded into bytes by the project's codec and decoded by the receiver; bits = 8 x
bytes actually produced". Values are float16 unless asked otherwise ("16-bit transmission for all methods").

Formats
-------
Integers in byte headers are unsigned LEB128 ``varint``\\ s. Bit-packed parts are MSB-first, written as one
bit stream and padded with zero bits to a whole byte once, at its end. Value payloads are little-endian IEEE
floats. dtype codes: 1 = float16, 2 = float32, 3 = float64.

* **values**  ``dtype(1) varint(n) values``: no shape, no positions -- a client's upload of the values on the
  common support in the canonical (row-major) order (docs/algorithm.md §7.2, 9).
* **dense**   ``dtype(1) ndim(1) varint(dim)* values``.
* **sparse**  ``flags(1) ndim(1) varint(dim)* varint(C) bits[positions] values[C]``.
* **grid** (cluster coding, docs/algorithm.md §9) ``flags(1) varint(K) varint(M) varint(R) varint(C) bits values`` with
  ``bits`` = R rectangle records ``row, col, height-1, width-1`` of ``ceil(log2 K), ceil(log2 M),
  ceil(log2 K), ceil(log2 M)`` bits, then the positions of the C scattered nonzeros; ``values`` = every
  rectangle's h*w values row-major (zeros inside a rectangle included), rectangles in record order, then the C
  scattered values in increasing row-major position.
* ``flags`` (sparse, grid): bits 0-1 the dtype code, bits 2-3 the position scheme, bits 4-7 zero.
* **positions** of C sorted distinct flat row-major indices in ``0..N-1``, the cheapest of (ties: lower code)

  - 0 *index list*: C fields of ``ceil(log2 N)`` bits;
  - 1 *bitmap*: N bits;
  - 2 *Rice-coded gaps*: a 6-bit parameter k, then for every gap v (the first index, then
    ``index[i] - index[i-1] - 1``) its low k bits, then all quotients ``v >> k`` in unary (q one-bits and a
    zero). Both halves are separate sub-streams so that decoding is vectorised.

* **support delta** (``[dturbo.transmission] positions = "delta"``, docs/communication.md) ``flag(1) rest``: flag 0,
  ``rest`` = a **support** payload (the full positions); flag ``1 | scheme << 2``, ``rest`` = ``varint(C)`` and the
  C flat row-major positions where the support differs from the one the receiver holds (the flips, schemes as
  below), no shape (the receiver's own support gives it). The encoder sends whichever is smaller.
* **quantized** ``varint(levels) varint(n) varint(P) params(float32 * P) bits`` with n symbols of
  ``ceil(log2 levels)`` bits each (FedPAQ's QSGD levels, log-scale prior stds).
* **ternary** ``flags(1) varint(n) varint(C) mu bits`` (STC's {-mu, 0, +mu} updates): ``bits`` = the C positions
  (schemes as below) then C sign bits (1 = -mu), one stream.
* **message** ``b"DT" version(1) len(1) kind varint(#fields) { len(1) name varint(len) payload }*``.

Cluster coding (§9, "a cluster larger than 3x3 is regarded as an entirety"): the support (entries nonzero
*after* rounding to the value dtype) is covered by disjoint axis-aligned rectangles of at least
``min_cluster x min_cluster`` (``min(min_cluster, K, M)`` on grids thinner than that, so that a dense 1 x M grid
is one rectangle too); every other nonzero is a scattered point. Rule: with ``F`` the bits of one rectangle
record, ``b`` the value bits and ``p`` an estimate of the position bits of one scattered point, a rectangle of
area ``h*w`` holding ``nnz`` nonzeros is sent whole when ``F + b*h*w < nnz * (b + p)``, i.e. when the zeros it
carries (b bits each) cost less than the positions it saves. The search (:func:`_find_rectangles`,
:class:`_Search`) cuts the "core" of the support (the union of its all-nonzero min_cluster x min_cluster
windows) into rectangles by guillotine cuts chosen with a one-level look-ahead of the rule above, vectorised
over all boxes and all cuts at once: no Python loop runs over weights (nor boxes). ``p`` is re-estimated from
the scattered points a first search leaves; the cheapest plan by exact bit count wins, "no rectangle" included,
so a grid never costs more than its nonzeros as scattered points (up to a header byte).

Decoders are bounds-checked: malformed input raises :class:`CodecError` (a ``ValueError``) with a reason and never
another exception; no output larger than ``max_elements`` (default :data:`DEFAULT_MAX_ELEMENTS`) is allocated
and no intermediate array larger than what the bytes present could describe. NaN / Inf and float16 overflow
(|v| > 65504) are refused at encode time; at decode, NaN / Inf found in a payload are returned as they are and
the caller validates. -0.0 counts as zero (not sent in grids and sparse tensors; decoded as +0.0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .coding.bits import (
    _CHUNK_BITS,
    _DTYPES,
    _MAX_DIM,
    _MAX_NDIM,
    DEFAULT_MAX_ELEMENTS,
    CodecError,
    _as_real,
    _BitReader,
    _bits_for,
    _BitWriter,
    _cast_values,
    _check_limit,
    _dtype_code,
    _read_dtype_code,
    _read_values,
    _Reader,
    _varint,
)
from .coding.grid import (
    _DELTA_FULL,
    _support_head,
    decode_grid,
    decode_support,
    decode_support_delta,
    encode_grid,
    encode_support,
    encode_support_delta,
    support_delta_needs_base,
)
from .coding.positions import _flags, _position_plan, _read_flags, _read_positions, _write_positions

__all__ = [
    "DEFAULT_MAX_ELEMENTS",
    "MAGIC",
    "VERSION",
    "CodecError",
    "decode_dense",
    "decode_grid",
    "decode_message",
    "decode_quantized",
    "decode_sparse",
    "decode_support",
    "decode_support_delta",
    "decode_ternary",
    "decode_values",
    "encode_dense",
    "encode_grid",
    "encode_message",
    "encode_quantized",
    "encode_sparse",
    "encode_support",
    "encode_support_delta",
    "encode_ternary",
    "encode_values",
    "payload_bits",
    "support_delta_needs_base",
]

MAGIC = b"DT"
VERSION = 1
# An all-zero grid or sparse tensor is a few bytes whatever its shape, so its size cannot be bounded by the bytes
# present: without a caller's ``max_elements``, decoders allocate at most this many output elements.

def encode_values(vec: np.ndarray, dtype: str = "float16") -> bytes:
    """Values in a fixed (canonical) order, no shape and no positions (§7.2, 9: the upstream of a client,
    "values on the common support in a canonical order"). ``vec`` must be 1-D (or 0-D: one value)."""
    a = _as_real(vec)
    if a.ndim > 1:
        raise ValueError(f"encode_values takes a 1-D vector, got shape {a.shape}")
    a = a.reshape(-1)
    code = _dtype_code(dtype)
    return bytes([code]) + _varint(a.size) + _cast_values(a, code).tobytes()


def decode_values(data: bytes, *, max_elements: int | None = None) -> np.ndarray:
    """Inverse of :func:`encode_values` (docs/algorithm.md §9): a 1-D float32 array (float64 for a float64 payload).
    The count is checked against the bytes present and ``max_elements`` before anything is allocated."""
    r = _Reader(data)
    dt = _read_dtype_code(r.byte())
    n = r.varint(limit=r.left // dt.itemsize if r.left else 0, what="value count")
    if max_elements is not None:
        _check_limit(n, max_elements, "values")
    out = _read_values(r, dt, n)
    r.end()
    return out


# ======================================================================= dense
def _encode_shape(shape: tuple[int, ...]) -> bytes:
    if len(shape) > _MAX_NDIM:
        raise ValueError(f"at most {_MAX_NDIM} dimensions, got {len(shape)}")
    return bytes([len(shape)]) + b"".join(_varint(int(s)) for s in shape)


def _decode_shape(r: _Reader) -> tuple[int, ...]:
    ndim = r.byte()
    if ndim > _MAX_NDIM:
        raise CodecError(f"{ndim} dimensions (at most {_MAX_NDIM})")
    shape = tuple(r.varint(limit=_MAX_DIM, what="dimension") for _ in range(ndim))
    if math.prod(max(d, 1) for d in shape) > _MAX_DIM:  # numpy refuses such shapes even when empty
        raise CodecError(f"shape {shape} is too large")
    return shape


def encode_dense(array: np.ndarray, dtype: str = "float16") -> bytes:
    """A dense tensor of any shape (§9 baselines, biases): dtype, ndim, shape, then every value (C order)."""
    a = _as_real(array)
    code = _dtype_code(dtype)
    return bytes([code]) + _encode_shape(a.shape) + _cast_values(a.reshape(-1), code).tobytes()


def decode_dense(data: bytes, *, max_elements: int | None = None) -> np.ndarray:
    """Inverse of :func:`encode_dense` (§9); float32 (float64 for a float64 payload). The element count must
    match the bytes present exactly, and not exceed ``max_elements``, before anything is allocated."""
    r = _Reader(data)
    dt = _read_dtype_code(r.byte())
    shape = _decode_shape(r)
    n = math.prod(shape)
    if max_elements is not None:
        _check_limit(n, max_elements, f"shape {shape}")
    if n * dt.itemsize != r.left:
        raise CodecError(f"shape {shape} needs {n * dt.itemsize} value bytes, {r.left} present (truncated?)")
    return _read_values(r, dt, n).reshape(shape)


# ====================================================================== sparse
def encode_sparse(array: np.ndarray, dtype: str = "float16") -> bytes:
    """A sparse tensor of any shape (§9 baselines: "sparse tensors with positions"): shape, the nonzeros'
    positions (the cheapest of index list / bitmap / Rice-coded gaps, flagged) and their values. Entries that round
    to zero in ``dtype`` are not sent."""
    a = _as_real(array)
    code = _dtype_code(dtype)
    flat = _cast_values(a.reshape(-1), code)
    idx = np.flatnonzero(flat)
    scheme, _, k = _position_plan(idx, flat.size)
    bw = _BitWriter()
    _write_positions(bw, idx, flat.size, scheme, k)
    head = bytes([_flags(code, scheme)]) + _encode_shape(a.shape) + _varint(idx.size)
    return head + bw.getvalue() + flat[idx].tobytes()


def decode_sparse(data: bytes, *, max_elements: int | None = None) -> np.ndarray:
    """Inverse of :func:`encode_sparse` (§9); float32 (float64 for a float64 payload). The dense output
    (at most ``max_elements``, default :data:`DEFAULT_MAX_ELEMENTS`) is allocated only after every check."""
    r = _Reader(data)
    dt, scheme = _read_flags(r)
    shape = _decode_shape(r)
    n = math.prod(shape)
    _check_limit(n, max_elements, f"shape {shape}")
    count = r.varint(limit=min(n, r.left // dt.itemsize), what="nonzero count")
    split = r.left - count * dt.itemsize
    br = _BitReader(r.take(split))
    idx = _read_positions(br, count, n, scheme)
    br.finish()
    vals = _read_values(r, dt, count)
    r.end()
    out = np.zeros(n, dtype=vals.dtype)
    out[idx] = vals
    return out.reshape(shape)


# ===================================================================== ternary
def encode_ternary(idx: np.ndarray, negative: np.ndarray, mu: float, n: int, dtype: str = "float32") -> bytes:
    """A sparse ternary vector of length ``n`` (STC, Sattler et al. 2019: entries in {-mu, 0, +mu}):
    ``flags(1) varint(n) varint(C) mu(dtype) bits[positions, C sign bits]``. The positions (sorted distinct
    ``idx``) use the same cheapest-of index list / bitmap / Rice-coded gaps as :func:`encode_sparse` (Rice = the
    Golomb code with a power-of-two parameter, the paper's position coding); then one bit per position, 1 for
    ``-mu``. ``mu`` must be finite and >= 0 (ValueError / CodecError otherwise)."""
    idx = np.asarray(idx, dtype=np.int64).reshape(-1)
    neg = np.asarray(negative, dtype=bool).reshape(-1)
    n = int(n)
    if n < 0 or neg.shape != idx.shape:
        raise ValueError(f"need n >= 0 and one sign per position (n={n}, {idx.size} positions, {neg.size} signs)")
    if idx.size and (idx[0] < 0 or idx[-1] >= n or np.any(np.diff(idx) <= 0)):
        raise ValueError(f"positions must be sorted, distinct and in 0..{n - 1}")
    code = _dtype_code(dtype)
    m = _cast_values(np.array([float(mu)]), code)
    if not m[0] >= 0:
        raise ValueError(f"mu must be >= 0, got {mu}")
    scheme, _, k = _position_plan(idx, n)
    bw = _BitWriter()
    _write_positions(bw, idx, n, scheme, k)
    bw.bits(neg.astype(np.uint8))
    return bytes([_flags(code, scheme)]) + _varint(n) + _varint(idx.size) + m.tobytes() + bw.getvalue()


def decode_ternary(data: bytes, *, max_elements: int | None = None) -> tuple[np.ndarray, np.ndarray, float, int]:
    """Inverse of :func:`encode_ternary`: (positions int64, negative bool, mu, n). Bounds-checked: n <=
    ``max_elements``, the count fits n and the bytes present, positions sorted, distinct and below n, no trailing
    bytes. mu is returned as sent (NaN / Inf included: the caller validates)."""
    r = _Reader(data)
    dt, scheme = _read_flags(r)
    n = r.varint(limit=_MAX_DIM, what="length")
    _check_limit(n, max_elements, f"ternary vector of {n}")
    count = r.varint(limit=min(n, 8 * r.left), what="nonzero count")
    mu = float(_read_values(r, dt, 1)[0])
    br = _BitReader(r.take(r.left))
    idx = _read_positions(br, count, n, scheme)
    negative = br.take(count).astype(bool)
    br.finish()
    return idx, negative, mu, n


# =================================================================== quantized
_MAX_LEVELS = 1 << 32
_MAX_PARAMS = 16


def encode_quantized(symbols: np.ndarray, levels: int, params: Sequence[float] = ()) -> bytes:
    """Integer symbols in ``0..levels-1`` packed at ``ceil(log2 levels)`` bits each (fixed-length code), with a few
    float32 parameters that give them meaning (a QSGD norm; the range of a log-scale quantiser):
    ``varint(levels) varint(n) varint(#params) params(float32) bits``. docs/algorithm.md §9: bits = real bytes."""
    sym = np.asarray(symbols).reshape(-1)
    levels = int(levels)
    if not 2 <= levels <= _MAX_LEVELS:
        raise ValueError(f"levels must be in 2..{_MAX_LEVELS}, got {levels}")
    if sym.size and (sym.dtype.kind not in "iu" or sym.min() < 0 or sym.max() >= levels):
        raise ValueError(f"symbols must be integers in 0..{levels - 1}")
    p = np.asarray(params, dtype=np.float64).reshape(-1)
    if p.size > _MAX_PARAMS:
        raise ValueError(f"at most {_MAX_PARAMS} parameters")
    head = _varint(levels) + _varint(sym.size) + _varint(p.size) + _cast_values(p, 2).tobytes()
    bw = _BitWriter()
    bw.fields(sym.reshape(-1, 1), [_bits_for(levels)])
    return head + bw.getvalue()


def decode_quantized(data: bytes, *, max_elements: int | None = None) -> tuple[np.ndarray, int, np.ndarray]:
    """Inverse of :func:`encode_quantized`: (symbols as int64, levels, float32 params). Bounds-checked: the
    symbol count must fit the bytes present and ``max_elements``; every symbol must be below ``levels``."""
    r = _Reader(data)
    levels = r.varint(limit=_MAX_LEVELS, what="level count")
    if levels < 2:
        raise CodecError(f"level count {levels} < 2")
    width = _bits_for(levels)
    n = r.varint(limit=8 * r.left // width, what="symbol count")
    _check_limit(n, max_elements, "quantized vector")
    n_params = r.varint(limit=_MAX_PARAMS, what="parameter count")
    params = _read_values(r, _DTYPES[2], n_params)
    br = _BitReader(r.take(r.left))
    sym = br.fields(n, [width])[:, 0]
    br.finish()
    if sym.size and sym.max() >= levels:
        raise CodecError(f"symbol {int(sym.max())} out of range for {levels} levels")
    return sym, levels, params


# The ``coded`` layout (dturbo.coding.values, which writes and reads it): the fixed-length head above, then a model
# byte; every model but CODED_FIXED (the fixed-length bits follow) carries CODED_MODEL_BYTES of float32 numbers.
CODED_FIXED = 2
CODED_MODEL_BYTES = 8


# ================================================================== accounting
PAYLOAD_LAYOUTS = ("header", "values", "dense", "sparse", "grid", "quantized", "coded", "support", "support_delta",
                   "mask")


def payload_bits(payload: bytes, layout: str) -> dict[str, int]:
    """Bits of one encoded payload split into ``headers`` (types, shapes, counts, padding-free metadata),
    ``positions`` (where the nonzeros are: bitmaps, index lists, Rice gaps, rectangle records, with the bit
    stream's padding) and ``values``; they sum to ``8 * len(payload)``. ``layout`` names the encoder that made it
    (``header``: a payload that is metadata as a whole, e.g. round and sample counters)."""
    total = 8 * len(payload)
    r = _Reader(payload)
    if layout == "header":
        head = total
    elif layout == "values":
        dt = _read_dtype_code(r.byte())
        r.varint(limit=r.left // dt.itemsize if r.left else 0)
        head = 8 * r.pos
    elif layout == "dense":
        _read_dtype_code(r.byte())
        _decode_shape(r)
        head = 8 * r.pos
    elif layout == "sparse":
        dt, _ = _read_flags(r)
        _decode_shape(r)
        count = r.varint(limit=r.left // dt.itemsize)
        head = 8 * r.pos
        values = 8 * count * dt.itemsize
        return {"headers": head, "positions": total - head - values, "values": values}
    elif layout == "grid":  # the rectangles' areas summed record by record: memory bounded, not the claims
        dt, _ = _read_flags(r)
        k, m = r.varint(limit=_MAX_DIM, what="rows"), r.varint(limit=_MAX_DIM, what="columns")
        if k == 0 or m == 0:
            raise CodecError(f"empty grid {k}x{m}")
        max_vals = r.left // dt.itemsize
        n_rect = r.varint(limit=min(k * m, max_vals), what="rectangle count")
        count = r.varint(limit=min(k * m, max_vals), what="scattered count")
        head = 8 * r.pos
        wk, wm = _bits_for(k), _bits_for(m)
        if (n_rect * 2 * (wk + wm) + 7) // 8 > r.left:
            raise CodecError(f"truncated: {n_rect} rectangle records do not fit in {r.left} bytes")
        br = _BitReader(memoryview(r.data)[r.pos :])
        areas = 0
        step = max(1, _CHUNK_BITS // (2 * (wk + wm) or 1))
        for lo in range(0, n_rect, step):
            f = br.fields(min(step, n_rect - lo), [wk, wm, wk, wm])
            areas += int(((f[:, 2] + 1) * (f[:, 3] + 1)).sum(dtype=np.float64))
            if areas + count > max_vals:
                raise CodecError("rectangles and points hold more values than the bytes")
        values = 8 * (areas + count) * dt.itemsize
        return {"headers": head, "positions": total - head - values, "values": values}
    elif layout in ("support", "support_delta"):
        # a delta's flag byte and flip count are headers, its flips positions (as the full positions are)
        if layout == "support" or r.byte() & 3 == _DELTA_FULL:
            _support_head(r, _MAX_DIM)
        else:
            r.varint(limit=_MAX_DIM)
        head = 8 * r.pos
        return {"headers": head, "positions": total - head, "values": 0}
    elif layout == "ternary":  # values: mu and the sign bits; positions: the rest of the bit stream
        dt, _ = _read_flags(r)
        r.varint(limit=_MAX_DIM)
        count = r.varint(limit=8 * r.left)
        head = 8 * r.pos
        values = 8 * dt.itemsize + count
        return {"headers": head, "positions": total - head - values, "values": values}
    elif layout in ("quantized", "coded"):
        # the counts are headers; the parameters (e.g. the quantiser's float32 scale) count as values
        r.varint(limit=_MAX_LEVELS)
        r.varint(limit=_MAX_DIM if layout == "coded" else 8 * r.left)
        n_params = r.varint(limit=_MAX_PARAMS)
        head = 8 * r.pos
        if layout == "coded":  # range-coded symbols: the model byte and its numbers are headers too
            r.take(4 * n_params)
            head += 8 * (1 if r.byte() == CODED_FIXED else 1 + CODED_MODEL_BYTES)
    elif layout == "mask":
        # FedPM's range-coded mask (coding/masks.py): a model byte, for model 1 a varint count of ones, then
        # the coder's words. The words count as "values", not "positions": the mask is FedPM's trained quantity
        # itself (a sample of the keep probabilities; the frozen weights it selects never travel), not the
        # addresses of values sent elsewhere.
        if r.byte() == 1:
            r.varint(limit=_MAX_DIM)
        head = 8 * r.pos
    else:
        raise ValueError(f"layout must be one of {', '.join(PAYLOAD_LAYOUTS)}, got {layout!r}")
    return {"headers": head, "positions": 0, "values": total - head}


# ===================================================================== message
def encode_message(kind: str, fields: list[tuple[str, bytes]]) -> bytes:
    """Frame named payloads into one versioned message (docs/algorithm.md §9: messages cross as bytes):
    ``MAGIC, VERSION, kind, #fields, {name, varint length, payload}*``. Names and kind are UTF-8, <= 255 bytes."""
    kb = kind.encode()
    if len(kb) > 255:
        raise ValueError("message kind longer than 255 bytes")
    parts = [MAGIC, bytes([VERSION, len(kb)]), kb, _varint(len(fields))]
    for name, payload in fields:
        nb = name.encode()
        if len(nb) > 255:
            raise ValueError(f"field name longer than 255 bytes: {name[:40]}...")
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise TypeError(f"field {name!r}: payload must be bytes, got {type(payload).__name__}")
        parts += [bytes([len(nb)]), nb, _varint(len(payload)), bytes(payload)]
    return b"".join(parts)


def decode_message(
    data: bytes, *, expected_kind: str | None = None, max_bytes: int | None = None
) -> tuple[str, list[tuple[str, bytes]]]:
    """Inverse of :func:`encode_message` (§9). Raises CodecError on bad magic, unknown version, a kind other
    than ``expected_kind``, a message longer than ``max_bytes``, truncation or trailing bytes."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CodecError(f"expected bytes, got {type(data).__name__}")
    if max_bytes is not None and len(data) > max_bytes:
        raise CodecError(f"message of {len(data)} bytes exceeds the bound of {max_bytes}")
    r = _Reader(data)
    if r.take(2) != MAGIC:
        raise CodecError("not a dturbo message (bad magic)")
    version = r.byte()
    if version != VERSION:
        raise CodecError(f"unsupported message version {version} (this build reads {VERSION})")
    try:
        kind = r.take(r.byte()).decode()
    except UnicodeDecodeError:
        raise CodecError("message kind is not UTF-8") from None
    if expected_kind is not None and kind != expected_kind:
        raise CodecError(f"expected a {expected_kind!r} message, got {kind!r}")
    count = r.varint(limit=r.left // 2, what="field count")
    fields = []
    for _ in range(count):
        try:
            name = r.take(r.byte()).decode()
        except UnicodeDecodeError:
            raise CodecError("field name is not UTF-8") from None
        length = r.varint(limit=r.left, what=f"length of field {name!r}")
        fields.append((name, r.take(length)))
    r.end()
    return kind, fields

