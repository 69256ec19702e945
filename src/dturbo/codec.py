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
from typing import Any

import numpy as np
from scipy import ndimage
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

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
    "decode_support_delta",
    "decode_ternary",
    "decode_values",
    "encode_dense",
    "encode_grid",
    "encode_message",
    "encode_quantized",
    "encode_sparse",
    "encode_support_delta",
    "encode_ternary",
    "encode_values",
    "payload_bits",
]

MAGIC = b"DT"
VERSION = 1
# An all-zero grid or sparse tensor is a few bytes whatever its shape, so its size cannot be bounded by the bytes
# present: without a caller's ``max_elements``, decoders allocate at most this many output elements.
DEFAULT_MAX_ELEMENTS = 1 << 24

_DTYPES = {1: np.dtype("<f2"), 2: np.dtype("<f4"), 3: np.dtype("<f8")}
_DTYPE_CODES = {"float16": 1, "float32": 2, "float64": 3}
_FLOAT16_MAX = 65504.0
_SCHEME_INDEX, _SCHEME_BITMAP, _SCHEME_RICE = 0, 1, 2
_RICE_K_BITS = 6
_MAX_DIM = 1 << 40  # largest dimension a header may claim
_MAX_NDIM = 8
_CHUNK_BITS = 1 << 20  # bits a bit reader unpacks at once


class CodecError(ValueError):
    """Malformed or unsupported bytes, or values that cannot be encoded (docs/algorithm.md §9)."""


# ================================================================ byte primitives
def _varint(n: int) -> bytes:
    """Unsigned LEB128."""
    if n < 0:
        raise CodecError("varint must be non-negative")
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


class _Reader:
    """Bounds-checked cursor over bytes: every read past the end raises CodecError('truncated ...')."""

    def __init__(self, data: bytes) -> None:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise CodecError(f"expected bytes, got {type(data).__name__}")
        self.data = bytes(data)
        self.pos = 0

    @property
    def left(self) -> int:
        return len(self.data) - self.pos

    def take(self, n: int) -> bytes:
        if n < 0 or n > self.left:
            raise CodecError(f"truncated: need {n} bytes at offset {self.pos}, have {self.left}")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def byte(self) -> int:
        return self.take(1)[0]

    def varint(self, limit: int, what: str = "value") -> int:
        shift = n = 0
        while True:
            b = self.byte()
            n |= (b & 0x7F) << shift
            if not b & 0x80:
                break
            shift += 7
            if shift > 63:
                raise CodecError(f"{what}: varint too long")
        if n > limit:
            raise CodecError(f"{what} {n} exceeds the limit {limit} (truncated or corrupt data)")
        return n

    def end(self) -> None:
        if self.left:
            raise CodecError(f"{self.left} trailing bytes")


# ================================================================= bit primitives
def _bits_for(n: int) -> int:
    """Bits of a field holding 0..n-1: ceil(log2 n), 0 for n <= 1."""
    return (int(n) - 1).bit_length() if n > 1 else 0


def _field_bits(values: np.ndarray, widths: Sequence[int]) -> np.ndarray:
    """(R, F) unsigned ints -> (R * sum(widths),) bits, each field MSB first (vectorised)."""
    values = np.asarray(values, dtype=np.uint64).reshape(-1, len(widths))
    col = np.repeat(np.arange(len(widths)), widths)
    shifts = np.concatenate([np.arange(w - 1, -1, -1, dtype=np.uint64) for w in widths])
    return ((values[:, col] >> shifts) & np.uint64(1)).astype(np.uint8).reshape(-1)


class _BitWriter:
    """Collects bit arrays; :meth:`getvalue` packs them once, zero-padded to a byte."""

    def __init__(self) -> None:
        self._chunks: list[np.ndarray] = []
        self.nbits = 0

    def bits(self, bits: np.ndarray) -> None:
        bits = np.asarray(bits, dtype=np.uint8).reshape(-1)
        self._chunks.append(bits)
        self.nbits += bits.size

    def fields(self, values: np.ndarray, widths: Sequence[int]) -> None:
        if sum(widths) and np.asarray(values).size:
            self.bits(_field_bits(values, widths))

    def getvalue(self) -> bytes:
        if not self.nbits:
            return b""
        return np.packbits(np.concatenate(self._chunks)).tobytes()


class _BitReader:
    """Bounds-checked bit cursor over a byte string; unpacks only the bytes a read touches."""

    def __init__(self, data: bytes) -> None:
        self.buf = np.frombuffer(data, dtype=np.uint8)
        self.nbits = 8 * self.buf.size
        self.pos = 0

    def take(self, n: int) -> np.ndarray:
        if n < 0 or n > self.nbits - self.pos:
            raise CodecError(f"truncated bit stream: need {n} bits at bit {self.pos}, have {self.nbits - self.pos}")
        lo, hi = self.pos // 8, (self.pos + n + 7) // 8
        start = self.pos - 8 * lo
        self.pos += n
        return np.unpackbits(self.buf[lo:hi])[start : start + n]

    def fields(self, rows: int, widths: Sequence[int]) -> np.ndarray:
        """(rows, len(widths)) int64; zero-width fields read as 0. Read in chunks of about :data:`_CHUNK_BITS` bits,
        so the bits unpacked at once stay bounded whatever the row count."""
        total = sum(widths)
        out = np.zeros((rows, len(widths)), dtype=np.int64)
        if not total or not rows:
            return out
        if rows * total > self.nbits - self.pos:
            raise CodecError(f"truncated bit stream: need {rows * total} bits at bit {self.pos}, have "
                             f"{self.nbits - self.pos}")
        step = max(1, _CHUNK_BITS // total)
        for lo in range(0, rows, step):
            hi = min(rows, lo + step)
            bits = self.take((hi - lo) * total).reshape(hi - lo, total).astype(np.uint64)
            start = 0
            for j, w in enumerate(widths):
                if w:
                    weights = np.uint64(1) << np.arange(w - 1, -1, -1, dtype=np.uint64)
                    out[lo:hi, j] = (bits[:, start : start + w] * weights).sum(axis=1).astype(np.int64)
                    start += w
        return out

    def finish(self) -> None:
        """The stream must end here, up to fewer than 8 zero padding bits."""
        pad = self.nbits - self.pos
        if pad >= 8:
            raise CodecError(f"{pad // 8} unused bytes in a bit stream")
        if pad and self.take(pad).any():
            raise CodecError("nonzero padding bits")


# ====================================================================== values
def _dtype_code(dtype: str) -> int:
    if dtype not in _DTYPE_CODES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPE_CODES)}, got {dtype!r}")
    return _DTYPE_CODES[dtype]


def _as_real(array: np.ndarray) -> np.ndarray:
    """A real float64 view/copy of the input, or ValueError."""
    a = np.asarray(array)
    if a.dtype.kind not in "biuf":
        raise ValueError(f"expected a real numeric array, got dtype {a.dtype}")
    return a.astype(np.float64, copy=False)


def _cast_values(values: np.ndarray, code: int) -> np.ndarray:
    """float64 values -> the wire dtype; NaN / Inf / overflow raise CodecError (§9: no silent overflow)."""
    if values.size and not np.all(np.isfinite(values)):
        raise CodecError("cannot encode NaN or Inf")
    if code == 1 and values.size and np.abs(values).max() > _FLOAT16_MAX:
        raise CodecError(f"value {np.abs(values).max():g} overflows float16 (max {_FLOAT16_MAX:g})")
    with np.errstate(over="ignore"):
        out = values.astype(_DTYPES[code])
    if code == 2 and values.size and not np.all(np.isfinite(out)):
        raise CodecError("a value overflows float32")
    return out


def _read_dtype_code(code: int) -> np.dtype:
    if code not in _DTYPES:
        raise CodecError(f"unknown dtype code {code}")
    return _DTYPES[code]


def _read_values(r: _Reader, dt: np.dtype, n: int) -> np.ndarray:
    """n values of dtype dt -> float32 (float64 for a float64 payload). Checks the bytes exist first."""
    raw = r.take(n * dt.itemsize)
    return np.frombuffer(raw, dtype=dt).astype(np.float64 if dt.itemsize == 8 else np.float32)


def _check_limit(n: int, max_elements: int | None, what: str) -> None:
    bound = DEFAULT_MAX_ELEMENTS if max_elements is None else int(max_elements)
    if n > bound:
        raise CodecError(f"{what} claims {n} elements, more than the allowed {bound}")


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


# ================================================================== positions
def _rice_k_candidates(v: np.ndarray, kmax: int) -> list[int]:
    mean = float(v.mean()) if v.size else 0.0
    k0 = int(math.floor(math.log2(mean * math.log(2) + 1.0)))
    return [k for k in range(k0 - 2, k0 + 3) if 0 <= k <= kmax] or [0]


def _position_plan(idx: np.ndarray, n: int) -> tuple[int, int, int]:
    """(scheme, bits, rice k) of the cheapest coding of sorted distinct indices ``idx`` in 0..n-1."""
    c = idx.size
    costs = {_SCHEME_INDEX: (c * _bits_for(n), 0), _SCHEME_BITMAP: (n, 0)}
    if c:
        v = np.diff(idx, prepend=-1) - 1
        best = None
        for k in _rice_k_candidates(v, min(_bits_for(n), 63)):
            bits = _RICE_K_BITS + c * (k + 1) + int((v >> k).sum())
            if best is None or bits < best[0]:
                best = (bits, k)
        costs[_SCHEME_RICE] = best
    scheme = min(costs, key=lambda s: (costs[s][0], s))
    return scheme, costs[scheme][0], costs[scheme][1]


def _write_positions(bw: _BitWriter, idx: np.ndarray, n: int, scheme: int, k: int) -> None:
    if scheme == _SCHEME_INDEX:
        bw.fields(idx.reshape(-1, 1), [_bits_for(n)])
    elif scheme == _SCHEME_BITMAP:
        bm = np.zeros(n, dtype=np.uint8)
        bm[idx] = 1
        bw.bits(bm)
    else:
        v = (np.diff(idx, prepend=-1) - 1).astype(np.int64)
        bw.fields(np.array([[k]]), [_RICE_K_BITS])
        bw.fields((v & ((1 << k) - 1)).reshape(-1, 1), [k])
        q = v >> k
        # unary: q one-bits then a zero, for every gap, vectorised: zeros at the cumulative end positions
        ends = np.cumsum(q + 1) - 1
        unary = np.ones(int(ends[-1]) + 1, dtype=np.uint8)
        unary[ends] = 0
        bw.bits(unary)


def _read_positions(br: _BitReader, count: int, n: int, scheme: int) -> np.ndarray:
    """Sorted distinct int64 indices in 0..n-1; anything inconsistent raises CodecError."""
    if scheme == _SCHEME_INDEX:
        idx = br.fields(count, [_bits_for(n)])[:, 0]
    elif scheme == _SCHEME_BITMAP:
        idx = np.flatnonzero(br.take(n)).astype(np.int64)
        if idx.size != count:
            raise CodecError(f"bitmap holds {idx.size} positions, the header says {count}")
    elif scheme == _SCHEME_RICE:
        k = int(br.fields(1, [_RICE_K_BITS])[0, 0])
        if k > _bits_for(n):
            raise CodecError(f"Rice parameter {k} too large for {n} positions")
        rem = br.fields(count, [k])[:, 0]
        if count:
            rest = br.take(br.nbits - br.pos)
            zeros = np.flatnonzero(rest == 0)[:count]
            if zeros.size < count:
                raise CodecError("truncated Rice code")
            q = np.diff(zeros, prepend=-1) - 1
            br.pos -= rest.size - (int(zeros[-1]) + 1)  # give back the bits after the last quotient
            if int(q.max()) > (n >> k):
                raise CodecError("a Rice-coded gap is out of range")
            v = (q << k) | rem
            if float(v.astype(np.float64).sum()) + count > n + 1.0:
                raise CodecError("Rice-coded positions run past the end")
            idx = np.cumsum(v + 1) - 1
        else:
            idx = np.zeros(0, np.int64)
    else:
        raise CodecError(f"unknown position scheme {scheme}")
    if count and (int(idx[-1]) >= n or (count > 1 and np.any(np.diff(idx) <= 0))):
        raise CodecError("positions are out of range or not strictly increasing")
    return idx


def _flags(code: int, scheme: int) -> int:
    return code | (scheme << 2)


def _read_flags(r: _Reader) -> tuple[np.dtype, int]:
    f = r.byte()
    if f >> 4:
        raise CodecError(f"reserved flag bits set in {f:#04x}")
    return _read_dtype_code(f & 3), (f >> 2) & 3


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


# ======================================================================== grid
def _sat(a: np.ndarray) -> np.ndarray:
    """Summed-area table with a zero first row and column."""
    s = np.zeros((a.shape[0] + 1, a.shape[1] + 1), dtype=np.int64)
    np.cumsum(np.cumsum(a, axis=0, dtype=np.int64), axis=1, out=s[1:, 1:])
    return s


def _box_sum(sat: np.ndarray, r0: Any, c0: Any, r1: Any, c1: Any) -> Any:
    """Sum over rows r0..r1-1, cols c0..c1-1 from a summed-area table (vectorised over array arguments)."""
    return sat[r1, c1] - sat[r0, c1] - sat[r1, c0] + sat[r0, c0]


class _Costs:
    """The cost model of the rectangle search (bits): ``F`` per rectangle record, ``b`` per value, ``p`` per
    scattered position (an estimate), rectangles at least ``mc`` x ``mc``."""

    def __init__(self, F: int, b: int, p: float, mc: int) -> None:
        self.F, self.b, self.p, self.mc = F, b, p, mc

    def estimate(self, nnz: np.ndarray, h: np.ndarray, w: np.ndarray) -> np.ndarray:
        """Cheaper of one rectangle (if at least mc x mc) and scattered points, for boxes holding nnz nonzeros."""
        rect = np.where((h >= self.mc) & (w >= self.mc), self.F + self.b * h * w, np.inf)
        return np.minimum(rect, nnz * (self.b + self.p))


def _segmented_accumulate(values: np.ndarray, seg: np.ndarray, op: np.ufunc, reverse: bool) -> np.ndarray:
    """Running ``op`` (np.minimum or np.maximum) of ``values``, restarted in every segment; ``seg`` holds the
    segment ids, contiguous and increasing. One vectorised pass: each segment is shifted by a multiple of the
    value range so that no other segment can win the comparison."""
    if not values.size:
        return values
    span = int(values.max()) - int(values.min()) + 1
    rank = (int(seg[-1]) - seg) if reverse else seg
    shift = rank * span * (1 if op is np.maximum else -1)
    shifted = values + shift
    acc = op.accumulate(shifted[::-1])[::-1] if reverse else op.accumulate(shifted)
    return acc - shift


def _cuts_along(
    a0: np.ndarray, a1: np.ndarray, b0: np.ndarray, b1: np.ndarray, nxt: np.ndarray, prv: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every guillotine cut across the lines (rows, or columns when the tables are transposed) of every box
    [a0, a1) x [b0, b1), all boxes at once. ``nxt[g, b]`` is the first core cell at or after cross index b on
    line g (or the line length), ``prv[g, b]`` one past the last core cell before b (or 0). Returns the box id of
    every cut and its two halves (low: lines before the cut, high: the others), each shrunk to the bounding box
    of its core cells, as (n, 4) arrays of (a0, a1, b0, b1)."""
    n = a1 - a0
    seg = np.repeat(np.arange(n.size), n)
    starts = np.cumsum(n) - n
    pos = np.arange(seg.size) - starts[seg]
    g = a0[seg] + pos
    first = nxt[g, b0[seg]]
    nonempty = first < b1[seg]
    big = nxt.shape[0] + nxt.shape[1] + 2
    first = np.where(nonempty, first, big)
    last = np.where(nonempty, prv[g, b1[seg]], -1)
    acc = _segmented_accumulate
    lo_end = acc(np.where(nonempty, g + 1, -1), seg, np.maximum, False)
    lo_b0, lo_b1 = acc(first, seg, np.minimum, False), acc(last, seg, np.maximum, False)
    hi_beg = acc(np.where(nonempty, g, big), seg, np.minimum, True)
    hi_b0, hi_b1 = acc(first, seg, np.minimum, True), acc(last, seg, np.maximum, True)
    lo_sel = pos < (n - 1)[seg]  # the cut after line pos: low half = lines <= pos
    hi_sel = pos > 0  # the same cuts, seen from the high half's first line
    box = seg[lo_sel]
    low = np.stack([a0[box], lo_end[lo_sel], lo_b0[lo_sel], lo_b1[lo_sel]], axis=1)
    high = np.stack([hi_beg[hi_sel], a1[box], hi_b0[hi_sel], hi_b1[hi_sel]], axis=1)
    return box, low, high


def _line_tables(core: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(nxt, prv) of :func:`_cuts_along` for the rows of ``core`` (K, M+1 each)."""
    k, m = core.shape
    ar = np.arange(m)
    nxt = np.full((k, m + 1), m, np.int64)
    nxt[:, :m] = np.minimum.accumulate(np.where(core, ar, m)[:, ::-1], axis=1)[:, ::-1]
    prv = np.zeros((k, m + 1), np.int64)
    prv[:, 1:] = np.maximum.accumulate(np.where(core, ar + 1, 0), axis=1)
    return nxt, prv


def _disjoint_boxes(core: np.ndarray) -> np.ndarray:
    """Disjoint boxes (n, 4) = (r0, r1, c0, c1) holding the core: the bounding boxes of its 4-connected pieces,
    boxes that overlap merged into their common bounding box, repeatedly, until none overlap (boxes that merely
    touch stay apart). A box then holds only the core cells of its own pieces, so the boxes can be split
    independently and their rectangles never overlap. Overlapping pairs come from a vectorised sweep over the
    boxes sorted by first row; the groups to merge are the connected components of the overlap graph."""
    labels, count = ndimage.label(core)
    if not count:
        return np.zeros((0, 4), np.int64)
    b = np.array([(r.start, r.stop, c.start, c.stop) for r, c in ndimage.find_objects(labels)], np.int64)
    while len(b) > 1:
        n = len(b)
        b = b[np.argsort(b[:, 0], kind="stable")]
        # candidates j > i start before box i ends (rows overlap); then keep those whose columns overlap too
        reach = np.maximum(np.searchsorted(b[:, 0], b[:, 1], side="left") - np.arange(n) - 1, 0)
        i = np.repeat(np.arange(n), reach)
        j = i + 1 + np.arange(i.size) - np.repeat(np.cumsum(reach) - reach, reach)
        both = (b[i, 2] < b[j, 3]) & (b[j, 2] < b[i, 3])
        if not both.any():
            break
        graph = csr_matrix((np.ones(int(both.sum())), (i[both], j[both])), shape=(n, n))
        count, comp = connected_components(graph, directed=False)
        merged = np.empty((count, 4), np.int64)
        merged[:, [0, 2]] = np.iinfo(np.int64).max
        merged[:, [1, 3]] = -1
        for col, op in enumerate((np.minimum, np.maximum, np.minimum, np.maximum)):
            op.at(merged[:, col], comp, b[:, col])
        b = merged
    return b


class _Search:
    """One rectangle search over a K x M support (docs/algorithm.md §9 cluster coding), fully vectorised.

    ``core``: the union of the all-nonzero ``mc x mc`` windows (the support's morphological opening), the shapes
    rectangles are cut from; nonzeros outside it (ragged edges, isolated points) stay scattered unless a rectangle
    cut from the core contains them. The search is a guillotine splitting of the disjoint boxes that hold the
    core's pieces (:func:`_disjoint_boxes`), run generation by generation: all boxes of a generation are priced
    and cut in one set of numpy operations (every row and column cut of every box, see :func:`_cuts_along`), so
    the Python loop runs over generations (the depth of the splitting), never over weights or even boxes.
    Rectangles come out disjoint by construction."""

    def __init__(self, support: np.ndarray, costs: _Costs) -> None:
        k, m = support.shape
        mc = costs.mc
        self.costs = costs
        self.sat_nz = _sat(support)
        win = _box_sum(self.sat_nz, slice(0, k - mc + 1), slice(0, m - mc + 1), slice(mc, k + 1), slice(mc, m + 1))
        full = win == mc * mc  # origins of the all-nonzero windows
        self.sat_full = _sat(full)
        pad = np.zeros((k + mc - 1, m + mc - 1), np.int64)  # full origins shifted by mc-1: core = window sums > 0
        pad[mc - 1 : k, mc - 1 : m] = full
        sp = _sat(pad)
        self.core = _box_sum(sp, slice(0, k), slice(0, m), slice(mc, k + mc), slice(mc, m + mc)) > 0
        self.rows = _line_tables(self.core)
        self.cols = _line_tables(self.core.T)
        self.roots = _disjoint_boxes(self.core)

    def _price(self, boxes: np.ndarray) -> np.ndarray:
        """Estimated bits of (n, 4) boxes (r0, r1, c0, c1)."""
        r0, r1, c0, c1 = boxes.T
        return self.costs.estimate(_box_sum(self.sat_nz, r0, c0, r1, c1), r1 - r0, c1 - c0)

    def run(self, n_min: int, full_only: bool = False) -> np.ndarray:
        """Rectangles (R, 4) = (row, col, h, w). Every box of a generation is (1) dropped when it is smaller than
        mc x mc, holds no all-nonzero window or fewer than ``n_min`` nonzeros; (2) sent whole when it is full;
        otherwise its best cut (least estimated bits of the two shrunk halves; ties: the more balanced cut) is (3)
        taken when it beats both one rectangle and scattered points; (4) else the box is one rectangle when that beats
        scattered points; (5) else it is cut anyway (it still holds an all-nonzero window). Cuts shrink boxes, so
        the loop ends."""
        c, mc = self.costs, self.costs.mc
        boxes = self.roots
        out = [np.zeros((0, 4), np.int64)]
        while boxes.size:
            r0, r1, c0, c1 = boxes.T
            h, w = r1 - r0, c1 - c0
            nnz = _box_sum(self.sat_nz, r0, c0, r1, c1)
            ok = (h >= mc) & (w >= mc) & (nnz >= n_min)
            ok[ok] = _box_sum(self.sat_full, r0[ok], c0[ok], r1[ok] - mc + 1, c1[ok] - mc + 1) > 0
            full = ok & (nnz == h * w)
            out.append(boxes[full])
            live = ok & ~full
            boxes, h, w, nnz = boxes[live], h[live], w[live], nnz[live]
            if not boxes.size:
                break
            r0, r1, c0, c1 = boxes.T
            rb, rlow, rhigh = _cuts_along(r0, r1, c0, c1, *self.rows)
            cb, clow, chigh = _cuts_along(c0, c1, r0, r1, *self.cols)
            box = np.concatenate([rb, cb])
            low = np.concatenate([rlow, clow[:, [2, 3, 0, 1]]])
            high = np.concatenate([rhigh, chigh[:, [2, 3, 0, 1]]])
            est = self._price(low) + self._price(high)
            area_lo = (low[:, 1] - low[:, 0]) * (low[:, 3] - low[:, 2])
            bigger = np.maximum(area_lo, (high[:, 1] - high[:, 0]) * (high[:, 3] - high[:, 2]))
            order = np.lexsort((bigger, est, box))  # ties: the more balanced cut (shallower splitting)
            ids, at = np.unique(box[order], return_index=True)
            best = order[at]
            best_est = np.full(boxes.shape[0], np.inf)
            best_est[ids] = est[best]
            cut_of = np.full(boxes.shape[0], -1)
            cut_of[ids] = best
            rect = c.F + c.b * h * w
            scat = nnz * (c.b + c.p)
            # A rectangle with zeros inside is fine when its values travel with it (the zeros say where S is not);
            # a support coded alone (``full_only``) can only hold whole rectangles.
            accept = (best_est >= np.minimum(rect, scat)) & (rect < scat) & (not full_only)
            out.append(boxes[accept])
            cut = cut_of[~accept & (cut_of >= 0)]
            boxes = np.concatenate([low[cut], high[cut]])
        found = np.concatenate(out)
        return np.stack([found[:, 0], found[:, 2], found[:, 1] - found[:, 0], found[:, 3] - found[:, 2]], axis=1)


def _merge_touching(rects: np.ndarray) -> np.ndarray:
    """Merge rectangles (row, col, h, w) that share a whole side (same rows and adjacent columns, or the other
    way round) into one: the same cells for one record less. Vectorised over chains; repeats until stable."""
    changed = True
    while changed and len(rects) > 1:
        changed = False
        for swap in ([0, 1, 2, 3], [1, 0, 3, 2]):  # merge along columns, then along rows (transposed view)
            r = rects[:, swap]
            r = r[np.lexsort((r[:, 1], r[:, 2], r[:, 0]))]  # by row, height, then column
            start = np.ones(len(r), bool)
            start[1:] = (r[1:, 0] != r[:-1, 0]) | (r[1:, 2] != r[:-1, 2]) | (r[1:, 1] != r[:-1, 1] + r[:-1, 3])
            if start.all():
                continue
            merged = r[start]
            merged[:, 3] = np.bincount(np.cumsum(start) - 1, weights=r[:, 3]).astype(np.int64)
            rects = merged[:, swap]
            changed = True
    return rects


def _position_bits(count: int, n: int) -> float:
    """Rough bits per position of ``count`` scattered points among n with the cheapest scheme: Rice
    ~ log2(n / count) + 1.5, capped by the bitmap (n / count) and the index list (ceil(log2 n)). An estimate for
    the search's cost model only; plans are compared by their exact bits."""
    c = max(count, 1)
    return float(min(max(_bits_for(n), 1), n / c, math.log2(max(n / c, 1.0)) + 1.5))


def _plan(support: np.ndarray, rects: np.ndarray, F: int, value_bits: int) -> tuple[int, np.ndarray]:
    """Exact bits of the cluster coding of ``support`` with these (R, 4) rectangles (all but the constant flags,
    K and M header bytes), and the scattered flat indices it leaves."""
    covered = np.zeros(support.shape, bool)
    for r0, c0, h, w in rects.tolist():  # a loop over rectangles
        covered[r0 : r0 + h, c0 : c0 + w] = True
    scattered = np.flatnonzero(support & ~covered)
    pos_bits = _position_plan(scattered, support.size)[1]
    area = int((rects[:, 2] * rects[:, 3]).sum())
    bits = 8 * ((F * len(rects) + pos_bits + 7) // 8) + value_bits * (area + scattered.size)
    return bits + 8 * (len(_varint(len(rects))) + len(_varint(scattered.size))), scattered


def _find_rectangles(support: np.ndarray, min_cluster: int, value_bits: int, full_only: bool = False) -> np.ndarray:
    """Disjoint rectangles (R, 4) = (row, col, height, width) of the cluster coding (§9); see the module
    docstring for the rule and :class:`_Search` for the method.

    The position cost ``p`` of a scattered point is first estimated from the nonzeros outside the core; when the
    scattered points actually left over imply a clearly different ``p``, the search runs once more with it. The
    cheapest of these plans and of "no rectangle at all" (exact bit counts) wins, so a grid never costs more
    than its nonzeros sent as scattered points (up to a byte of header)."""
    k, m = support.shape
    n = k * m
    mc = min(min_cluster, k, m)
    none = np.zeros((0, 4), np.int64)
    if not support.any():
        return none
    if support.all():
        return np.array([[0, 0, k, m]], np.int64)
    F = 2 * (_bits_for(k) + _bits_for(m))
    best = (_plan(support, none, F, value_bits)[0], none)
    search = _Search(support, _Costs(F, value_bits, 0.0, mc))
    # first guess of p: the nonzeros outside the core will be the scattered points
    p: float | None = _position_bits(int(np.count_nonzero(support & ~search.core)), n)
    for _ in range(2):
        if p is None:
            break
        search.costs.p = p
        rects = _merge_touching(search.run(int(math.floor((F + value_bits * mc * mc) / (value_bits + p))) + 1,
                                           full_only))
        if not len(rects):
            break
        bits, scattered = _plan(support, rects, F, value_bits)
        if bits < best[0]:
            best = (bits, rects)
        p_next = _position_bits(scattered.size, n)  # what the plan really leaves scattered
        p = p_next if abs(p_next - p) > 0.75 else None
    return best[1]


def _grid_parts(matrix: np.ndarray, min_cluster: int, dtype: str) -> tuple[bytes, bytes, bytes]:
    """(header, bit stream = rectangle records + scattered positions + padding, values) of the cluster coding."""
    a = _as_real(matrix)
    if a.ndim != 2 or a.size == 0:
        raise ValueError(f"encode_grid needs a non-empty 2-D matrix, got shape {a.shape}")
    if int(min_cluster) < 1:
        raise ValueError(f"min_cluster must be >= 1, got {min_cluster}")
    code = _dtype_code(dtype)
    k, m = a.shape
    wire = _cast_values(a.reshape(-1), code).reshape(k, m)
    # The support is what survives the value dtype: a value that rounds to 0 is not sent.
    rects, scattered, scheme, stream = _support_stream(wire != 0, int(min_cluster), 8 * _DTYPES[code].itemsize)
    rect_vals = [wire[r0 : r0 + h, c0 : c0 + w].reshape(-1) for r0, c0, h, w in rects.tolist()]
    header = bytes([_flags(code, scheme)]) + _varint(k) + _varint(m) + _varint(len(rects)) + _varint(scattered.size)
    values = np.concatenate([*rect_vals, wire.reshape(-1)[scattered]]).astype(_DTYPES[code])
    return header, stream, values.tobytes()


def _support_stream(
    support: np.ndarray, min_cluster: int, value_bits: int, full_only: bool = False
) -> tuple[np.ndarray, np.ndarray, int, bytes]:
    """The cluster coding of a support's positions: (rectangles (r0, c0, h, w), scattered flat indices, position
    scheme, bit stream = rectangle records + scattered positions + padding). ``full_only``: rectangles hold no
    zero (a support whose values travel apart: its rectangles are read back as all in S)."""
    k, m = support.shape
    rects = _find_rectangles(support, min_cluster, value_bits, full_only)
    covered = np.zeros((k, m), dtype=bool)
    for r0, c0, h, w in rects.tolist():
        covered[r0 : r0 + h, c0 : c0 + w] = True
    scattered = np.flatnonzero(support & ~covered)
    scheme, _, rice_k = _position_plan(scattered, k * m)
    bw = _BitWriter()
    fields = rects.copy()
    fields[:, 2:] -= 1
    wk, wm = _bits_for(k), _bits_for(m)
    bw.fields(fields, [wk, wm, wk, wm])
    _write_positions(bw, scattered, k * m, scheme, rice_k)
    return rects, scattered, scheme, bw.getvalue()


def encode_support(support: np.ndarray, *, min_cluster: int = 3, value_bits: int = 16) -> bytes:
    """The positions part of :func:`encode_grid` alone, for a support whose values travel apart (quantised):
    ``byte(scheme) varint(K) varint(M) varint(R) varint(C)`` + the rectangle records and scattered positions.
    ``value_bits`` (the cost of one value sent apart) lets the rectangle search weigh positions against values
    as the grid coding does. ``decode_support(encode_support(s)) == s``; the values of a support go row-major."""
    s = np.asarray(support, dtype=bool)
    if s.ndim != 2 or s.size == 0:
        raise ValueError(f"encode_support needs a non-empty 2-D mask, got shape {s.shape}")
    k, m = s.shape
    rects, scattered, scheme, stream = _support_stream(s, int(min_cluster), int(value_bits), full_only=True)
    return bytes([scheme]) + _varint(k) + _varint(m) + _varint(len(rects)) + _varint(scattered.size) + stream


def _rectangle_cells(r0: np.ndarray, c0: np.ndarray, h: np.ndarray, w: np.ndarray, m: int) -> np.ndarray:
    """Flat indices of every rectangle cell, in record order and row-major inside each (no loop)."""
    areas = h * w
    starts = np.cumsum(areas) - areas
    rid = np.repeat(np.arange(r0.size), areas)
    local = np.arange(int(areas.sum())) - starts[rid]
    return (r0[rid] + local // w[rid]) * m + c0[rid] + local % w[rid]


def _support_head(r: _Reader, max_elements: int | None) -> tuple[int, int, int, int, int]:
    """(scheme, K, M, rectangle count, scattered count) of a support header, bounds-checked."""
    scheme = r.byte()
    if scheme > 3:
        raise CodecError(f"unknown position scheme {scheme}")
    k = r.varint(limit=_MAX_DIM, what="rows")
    m = r.varint(limit=_MAX_DIM, what="columns")
    if k == 0 or m == 0:
        raise CodecError(f"empty grid {k}x{m}")
    _check_limit(k * m, max_elements, f"support {k}x{m}")
    n_rect = r.varint(limit=min(k * m, 8 * r.left), what="rectangle count")
    count = r.varint(limit=k * m, what="scattered count")
    return scheme, k, m, n_rect, count


def decode_support(data: bytes, *, max_elements: int | None = None) -> np.ndarray:
    """Inverse of :func:`encode_support`: a (K, M) bool mask. Rectangles must lie inside the grid and not overlap,
    scattered positions must be sorted, distinct and outside every rectangle; the bytes must end with the stream."""
    r = _Reader(data)
    scheme, k, m, n_rect, count = _support_head(r, max_elements)
    br = _BitReader(r.take(r.left))
    wk, wm = _bits_for(k), _bits_for(m)
    f = br.fields(n_rect, [wk, wm, wk, wm])
    r0, c0, h, w = f[:, 0], f[:, 1], f[:, 2] + 1, f[:, 3] + 1
    if n_rect and (np.any(r0 + h > k) or np.any(c0 + w > m)):
        raise CodecError("a rectangle lies outside the grid")
    if float((h * w).sum(dtype=np.float64)) + count > k * m:
        raise CodecError("rectangles and points cover more than the grid")
    scattered = _read_positions(br, count, k * m, scheme)
    br.finish()
    out = np.zeros(k * m, dtype=bool)
    if n_rect:
        flat = _rectangle_cells(r0, c0, h, w, m)
        out[flat] = True
        if int(np.count_nonzero(out)) != flat.size:
            raise CodecError("rectangles overlap")
        if count and out[scattered].any():
            raise CodecError("a scattered position lies inside a rectangle")
    out[scattered] = True
    return out.reshape(k, m)


_DELTA_FULL, _DELTA_FLIPS = 0, 1


def encode_support_delta(support: np.ndarray, base: np.ndarray | None, *, min_cluster: int = 3,
                         value_bits: int = 16, full: bytes | None = None) -> bytes:
    """A support for a receiver that holds ``base`` (None: nothing): flag 0 + :func:`encode_support`'s full
    positions, or flag ``1 | scheme << 2`` + the positions that flipped (``support != base``, cheapest of index
    list / bitmap / Rice-coded gaps), whichever is fewer bytes (ties: the full positions, which need no base). So
    it is never longer than the full positions plus the flag byte (docs/communication.md, "Positions").
    ``full``: the support's :func:`encode_support` payload when the caller has it already (one per round, however
    many bases its receivers hold)."""
    s = np.asarray(support, dtype=bool)
    if full is None:
        full = encode_support(s, min_cluster=min_cluster, value_bits=value_bits)
    full = bytes([_DELTA_FULL]) + full
    if base is None:
        return full
    b = np.asarray(base, dtype=bool)
    if b.shape != s.shape:
        raise ValueError(f"base support {b.shape} and support {s.shape} differ in shape")
    flips = np.flatnonzero(s.reshape(-1) != b.reshape(-1))
    scheme, _, k = _position_plan(flips, s.size)
    bw = _BitWriter()
    _write_positions(bw, flips, s.size, scheme, k)
    delta = bytes([_DELTA_FLIPS | scheme << 2]) + _varint(flips.size) + bw.getvalue()
    return delta if len(delta) < len(full) else full


def support_delta_needs_base(data: bytes) -> bool:
    """Whether a support delta payload is coded against the receiver's support (flag 1) rather than whole."""
    r = _Reader(data)
    return r.byte() & 3 == _DELTA_FLIPS


def decode_support_delta(data: bytes, base: np.ndarray | None, *, max_elements: int | None = None) -> np.ndarray:
    """Inverse of :func:`encode_support_delta`: the (K, M) bool support. A delta payload needs ``base`` (the
    support the receiver holds; ValueError without it); malformed bytes raise CodecError."""
    r = _Reader(data)
    flag = r.byte()
    kind, scheme = flag & 3, flag >> 2
    if kind == _DELTA_FULL and scheme == 0:
        return decode_support(r.take(r.left), max_elements=max_elements)
    if kind != _DELTA_FLIPS or scheme > _SCHEME_RICE:
        raise CodecError(f"unknown support delta flag {flag:#04x}")
    if base is None:
        raise ValueError("a support delta needs the support the receiver holds")
    b = np.asarray(base, dtype=bool)
    _check_limit(b.size, max_elements, f"support {b.shape}")
    count = r.varint(limit=b.size, what="flip count")
    br = _BitReader(r.take(r.left))
    flips = _read_positions(br, count, b.size, scheme)
    br.finish()
    out = b.reshape(-1).copy()
    out[flips] ^= True
    return out.reshape(b.shape)


def encode_grid(matrix: np.ndarray, *, min_cluster: int = 3, dtype: str = "float16") -> bytes:
    """Cluster coding of one sparse 2-D grid (§9): disjoint rectangles of at least min_cluster x min_cluster
    as (row, col, height-1, width-1) + their values row-major; the leftover nonzeros with their positions
    (cheapest of index list / bitmap / Rice-coded gaps) + values. A 0-sized matrix raises ValueError; NaN / Inf or
    float16 overflow raise CodecError. ``decode_grid(encode_grid(m)) == m`` rounded to ``dtype``, exactly."""
    return b"".join(_grid_parts(matrix, min_cluster, dtype))


def _read_grid_head(r: _Reader, max_elements: int | None) -> tuple[Any, ...]:
    """Parse a grid's header and rectangle records (cursor left after the header):
    (dtype, scheme, K, M, scattered count, record bits, (r0, c0, h, w), values held by rectangles)."""
    dt, scheme = _read_flags(r)
    k = r.varint(limit=_MAX_DIM, what="rows")
    m = r.varint(limit=_MAX_DIM, what="columns")
    if k == 0 or m == 0:
        raise CodecError(f"empty grid {k}x{m}")
    n = k * m
    _check_limit(n, max_elements, f"grid {k}x{m}")
    max_vals = r.left // dt.itemsize
    n_rect = r.varint(limit=min(n, max_vals), what="rectangle count")
    count = r.varint(limit=min(n, max_vals), what="scattered count")
    wk, wm = _bits_for(k), _bits_for(m)
    rec_bits = n_rect * 2 * (wk + wm)
    if (rec_bits + 7) // 8 > r.left:
        raise CodecError(f"truncated: {n_rect} rectangle records do not fit in {r.left} bytes")
    br = _BitReader(r.data[r.pos :])
    f = br.fields(n_rect, [wk, wm, wk, wm])
    r0, c0, h, w = f[:, 0], f[:, 1], f[:, 2] + 1, f[:, 3] + 1
    if n_rect and (np.any(r0 + h > k) or np.any(c0 + w > m)):
        raise CodecError("a rectangle lies outside the grid")
    areas = h * w
    if float(areas.sum(dtype=np.float64)) + count > min(n, max_vals):  # (float: no int64 overflow)
        raise CodecError("rectangles and points hold more values than the grid or the bytes")
    return dt, scheme, k, m, count, rec_bits, (r0, c0, h, w), int(areas.sum())


def decode_grid(data: bytes, *, max_elements: int | None = None) -> np.ndarray:
    """Inverse of :func:`encode_grid` (docs/algorithm.md §9): a (K, M) float32 matrix (float64 for a float64 payload).

    Bounds: K*M <= ``max_elements`` (default :data:`DEFAULT_MAX_ELEMENTS`) is checked before anything is
    allocated; rectangles must lie inside the grid and not overlap, scattered positions must be sorted, distinct
    and outside every rectangle, and the bytes must hold exactly the bit stream and values announced."""
    r = _Reader(data)
    dt, scheme, k, m, count, rec_bits, (r0, c0, h, w), n_rv = _read_grid_head(r, max_elements)
    n, n_rect = k * m, r0.size
    value_bytes = (n_rv + count) * dt.itemsize
    stream = r.take(r.left - value_bytes)
    br = _BitReader(stream)
    if rec_bits > br.nbits:
        raise CodecError("truncated rectangle records")
    br.pos = rec_bits
    scattered = _read_positions(br, count, n, scheme)
    br.finish()
    vals = _read_values(r, dt, n_rv + count)
    r.end()
    out = np.zeros(n, dtype=vals.dtype)
    if n_rect:
        flat = _rectangle_cells(r0, c0, h, w, m)
        covered = np.zeros(n, dtype=bool)
        covered[flat] = True
        if int(np.count_nonzero(covered)) != n_rv:
            raise CodecError("rectangles overlap")
        if count and covered[scattered].any():
            raise CodecError("a scattered position lies inside a rectangle")
        out[flat] = vals[:n_rv]
    out[scattered] = vals[n_rv:]
    return out.reshape(k, m)


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

