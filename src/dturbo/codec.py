"""Bytes of every message (SPEC 9): cluster-coded grids, dense / sparse / value tensors, message framing.

Bits are always 8 x the bytes these functions produce. Values are float16 unless asked otherwise.

Formats (all integers little-endian; ``varint`` = unsigned LEB128):

* values:  dtype(1) varint(n) values                                       -- no shape, no positions
* dense:   dtype(1) ndim(1) varint(dim)* values
* sparse:  dtype(1) ndim(1) varint(dim)* positions values                   -- positions, see below
* grid:    dtype(1) varint(K) varint(M) varint(#rect) rect-fields positions values
  - rect-fields: per rectangle (row, col, height-1, width-1) with ceil(log2 K), ceil(log2 M),
    ceil(log2 K), ceil(log2 M) bits, bit-packed, padded to a byte;
  - positions (of the scattered nonzeros not inside a rectangle): scheme(1) varint(count) then either an
    index list (ceil(log2 N) bits per flat row-major index, bit-packed) or an N-bit bitmap, whichever is
    smaller;
  - values: every rectangle's values row-major (zeros inside a rectangle included), then the scattered ones.
* message: b"DT" version(1) len(1) kind varint(#fields) { len(1) name varint(len) payload }*

Decoders are bounds-checked: malformed input raises :class:`CodecError` (never another exception) and
nothing larger than ``max_elements`` values (or than the bytes could describe) is allocated.
NaN / Inf are refused at encode time; at decode they are returned as they are and the caller validates.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import ndimage

MAGIC = b"DT"
VERSION = 1
_DTYPES = {1: np.dtype("<f2"), 2: np.dtype("<f4"), 3: np.dtype("<f8")}
_DTYPE_CODES = {"float16": 1, "float32": 2, "float64": 3}
_FLOAT16_MAX = 65504.0
_SCHEME_INDEX, _SCHEME_BITMAP = 0, 1


class CodecError(ValueError):
    """Malformed or unsupported bytes (or values that cannot be encoded)."""


# ------------------------------------------------------------ primitives
def _varint(n: int) -> bytes:
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
    def __init__(self, data: bytes) -> None:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise CodecError(f"expected bytes, got {type(data).__name__}")
        self.data = memoryview(bytes(data))
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise CodecError(f"truncated: need {n} bytes at offset {self.pos}, have {len(self.data) - self.pos}")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def byte(self) -> int:
        return self.take(1)[0]

    def varint(self, limit: int = 1 << 62) -> int:
        shift = n = 0
        while True:
            b = self.byte()
            n |= (b & 0x7F) << shift
            if not b & 0x80:
                break
            shift += 7
            if shift > 63:
                raise CodecError("varint too long")
        if n > limit:
            raise CodecError(f"value {n} exceeds the limit {limit}")
        return n

    def end(self) -> None:
        if self.pos != len(self.data):
            raise CodecError(f"{len(self.data) - self.pos} trailing bytes")


def _dtype_code(dtype: str) -> int:
    if dtype not in _DTYPE_CODES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPE_CODES)}, got {dtype!r}")
    return _DTYPE_CODES[dtype]


def _values_bytes(values: np.ndarray, code: int) -> bytes:
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(values)):
        raise CodecError("cannot encode NaN or Inf")
    if code == 1 and values.size and np.abs(values).max() > _FLOAT16_MAX:
        raise CodecError(f"value {np.abs(values).max():g} overflows float16 (max {_FLOAT16_MAX})")
    return values.astype(_DTYPES[code]).tobytes()


def _read_dtype(r: _Reader) -> np.dtype:
    code = r.byte()
    if code not in _DTYPES:
        raise CodecError(f"unknown dtype code {code}")
    return _DTYPES[code]


def _read_values(r: _Reader, dt: np.dtype, n: int) -> np.ndarray:
    return np.frombuffer(r.take(n * dt.itemsize), dtype=dt).astype(np.float32 if dt.itemsize <= 4 else np.float64)


def _bits_for(n: int) -> int:
    """Bits of a field holding 0..n-1."""
    return max(0, math.ceil(math.log2(n))) if n > 1 else 0


def _pack_fields(fields: np.ndarray, widths: list[int]) -> bytes:
    """Bit-pack an (R, F) array of unsigned ints with the given per-column widths (vectorised)."""
    if fields.size == 0 or sum(widths) == 0:
        return b""
    cols = []
    for j, w in enumerate(widths):
        if w:
            shifts = np.arange(w - 1, -1, -1, dtype=np.uint64)
            cols.append(((fields[:, j : j + 1].astype(np.uint64) >> shifts) & 1).astype(np.uint8))
    return np.packbits(np.concatenate(cols, axis=1).reshape(-1)).tobytes()


def _unpack_fields(r: _Reader, rows: int, widths: list[int]) -> np.ndarray:
    total = rows * sum(widths)
    raw = np.frombuffer(r.take((total + 7) // 8), np.uint8)
    bits = np.unpackbits(raw)[:total].reshape(rows, sum(widths)).astype(np.uint64)
    out = np.zeros((rows, len(widths)), dtype=np.int64)
    start = 0
    for j, w in enumerate(widths):
        if w:
            weights = np.uint64(1) << np.arange(w - 1, -1, -1, dtype=np.uint64)
            out[:, j] = (bits[:, start : start + w] * weights).sum(axis=1)
            start += w
    return out


def _encode_positions(flat_idx: np.ndarray, n: int) -> bytes:
    """Cheapest of an index list (ceil(log2 n) bits each) and an n-bit bitmap."""
    w = _bits_for(n)
    list_bytes = (len(flat_idx) * w + 7) // 8
    bitmap_bytes = (n + 7) // 8
    if list_bytes <= bitmap_bytes:
        return bytes([_SCHEME_INDEX]) + _varint(len(flat_idx)) + _pack_fields(flat_idx.reshape(-1, 1), [w])
    bm = np.zeros(n, dtype=np.uint8)
    bm[flat_idx] = 1
    return bytes([_SCHEME_BITMAP]) + _varint(len(flat_idx)) + np.packbits(bm).tobytes()


def _decode_positions(r: _Reader, n: int) -> np.ndarray:
    scheme = r.byte()
    count = r.varint(limit=n)
    if scheme == _SCHEME_INDEX:
        idx = _unpack_fields(r, count, [_bits_for(n)])[:, 0] if count else np.zeros(0, np.int64)
    elif scheme == _SCHEME_BITMAP:
        bits = np.unpackbits(np.frombuffer(r.take((n + 7) // 8), np.uint8))[:n]
        idx = np.flatnonzero(bits)
    else:
        raise CodecError(f"unknown position scheme {scheme}")
    if len(idx) != count or (count and (idx.max() >= n or np.any(np.diff(idx) <= 0))):
        raise CodecError("positions are out of range, unsorted, or do not match their count")
    return idx


# An all-zero grid or sparse tensor is a few bytes whatever its shape, so its size cannot be bounded by the
# bytes present: without a caller's bound, at most this many elements are ever allocated.
DEFAULT_MAX_ELEMENTS = 1 << 26


def _check_limit(n: int, max_elements: int | None, what: str) -> None:
    if max_elements is None:
        max_elements = DEFAULT_MAX_ELEMENTS
    if n > max_elements:
        raise CodecError(f"{what} claims {n} elements, more than the allowed {max_elements}")


# ---------------------------------------------------------------- values
def encode_values(vec: np.ndarray, dtype: str = "float16") -> bytes:
    """Values in a fixed (canonical) order, no positions: what D-Turbo-VBI clients upload (SPEC 9)."""
    vec = np.asarray(vec).reshape(-1)
    code = _dtype_code(dtype)
    return bytes([code]) + _varint(vec.size) + _values_bytes(vec, code)


def decode_values(data: bytes, *, max_elements: int | None = None) -> np.ndarray:
    r = _Reader(data)
    dt = _read_dtype(r)
    n = r.varint(limit=len(r.data) // dt.itemsize)
    _check_limit(n, max_elements, "values")
    out = _read_values(r, dt, n)
    r.end()
    return out


# ----------------------------------------------------------------- dense
def _encode_shape(shape: tuple[int, ...]) -> bytes:
    if len(shape) > 8:
        raise CodecError("at most 8 dimensions")
    return bytes([len(shape)]) + b"".join(_varint(int(s)) for s in shape)


def _decode_shape(r: _Reader, max_elements: int | None, bound: int) -> tuple[int, ...]:
    ndim = r.byte()
    if ndim > 8:
        raise CodecError(f"{ndim} dimensions (at most 8)")
    shape = tuple(r.varint(limit=1 << 40) for _ in range(ndim))
    n = math.prod(shape)
    _check_limit(n, max_elements, f"shape {shape}")
    if n > bound:
        raise CodecError(f"shape {shape} cannot fit in {len(r.data)} bytes")
    return shape


def encode_dense(array: np.ndarray, dtype: str = "float16") -> bytes:
    """A dense tensor: shape header then every value."""
    array = np.asarray(array)
    code = _dtype_code(dtype)
    return bytes([code]) + _encode_shape(array.shape) + _values_bytes(array, code)


def decode_dense(data: bytes, *, max_elements: int | None = None) -> np.ndarray:
    r = _Reader(data)
    dt = _read_dtype(r)
    shape = _decode_shape(r, max_elements, len(r.data) // dt.itemsize)
    out = _read_values(r, dt, math.prod(shape)).reshape(shape)
    r.end()
    return out


# ---------------------------------------------------------------- sparse
def encode_sparse(array: np.ndarray, dtype: str = "float16") -> bytes:
    """A sparse tensor: shape, positions of the nonzeros (index list or bitmap, the cheaper), values."""
    array = np.asarray(array)
    code = _dtype_code(dtype)
    flat = array.reshape(-1)
    idx = np.flatnonzero(flat)
    head = bytes([code]) + _encode_shape(array.shape)
    return head + _encode_positions(idx, flat.size) + _values_bytes(flat[idx], code)


def decode_sparse(data: bytes, *, max_elements: int | None = None) -> np.ndarray:
    r = _Reader(data)
    dt = _read_dtype(r)
    shape = _decode_shape(r, max_elements, DEFAULT_MAX_ELEMENTS if max_elements is None else max_elements)
    n = math.prod(shape)
    idx = _decode_positions(r, n)
    vals = _read_values(r, dt, len(idx))
    r.end()
    out = np.zeros(n, dtype=vals.dtype)
    out[idx] = vals
    return out.reshape(shape)


# ------------------------------------------------------------------ grid
def _find_rectangles(support: np.ndarray, min_cluster: int, value_bits: int) -> list[tuple[int, int, int, int]]:
    """Non-overlapping rectangles worth sending whole: bounding boxes of the 4-connected clusters that are at
    least min_cluster x min_cluster and cost less as (fields + every value in the box) than their nonzeros
    cost as scattered points. Largest boxes first; a box overlapping an accepted one is skipped."""
    k, m = support.shape
    labels, count = ndimage.label(support)
    if count == 0:
        return []
    boxes = ndimage.find_objects(labels)
    field_bits = 2 * (_bits_for(k) + _bits_for(m))
    point_bits = value_bits + _bits_for(k * m)
    cand = [(s[0].start, s[1].start, s[0].stop - s[0].start, s[1].stop - s[1].start) for s in boxes]
    cand = [c for c in cand if c[2] >= min_cluster and c[3] >= min_cluster]
    cand.sort(key=lambda c: -c[2] * c[3])
    covered = np.zeros_like(support, dtype=bool)
    chosen = []
    for r0, c0, h, w in cand:
        box = (slice(r0, r0 + h), slice(c0, c0 + w))
        if covered[box].any():
            continue
        nnz = int(support[box].sum())
        if field_bits + value_bits * h * w < nnz * point_bits:
            covered[box] = True
            chosen.append((r0, c0, h, w))
    return chosen


def _grid_parts(matrix: np.ndarray, min_cluster: int, dtype: str) -> tuple[bytes, bytes, bytes, bytes]:
    """(header, rectangle fields, scattered positions, values) of the cluster coding."""
    matrix = np.asarray(matrix)
    if matrix.ndim != 2 or matrix.size == 0:
        raise ValueError(f"encode_grid needs a non-empty 2-D matrix, got shape {matrix.shape}")
    code = _dtype_code(dtype)
    k, m = matrix.shape
    values = np.asarray(matrix, dtype=np.float64)
    if not np.all(np.isfinite(values)):
        raise CodecError("cannot encode NaN or Inf")
    if code == 1 and np.abs(values).max() > _FLOAT16_MAX:
        raise CodecError(f"value {np.abs(values).max():g} overflows float16 (max {_FLOAT16_MAX})")
    # The support is what survives the value dtype: a value that rounds to 0 is not sent.
    support = values.astype(_DTYPES[code]) != 0
    rects = _find_rectangles(support, min_cluster, 8 * _DTYPES[code].itemsize)
    covered = np.zeros_like(support)
    rect_vals = []
    for r0, c0, h, w in rects:
        covered[r0 : r0 + h, c0 : c0 + w] = True
        rect_vals.append(values[r0 : r0 + h, c0 : c0 + w].reshape(-1))
    scattered = np.flatnonzero(support & ~covered)
    header = bytes([code]) + _varint(k) + _varint(m) + _varint(len(rects))
    fields = np.array(rects, dtype=np.int64).reshape(-1, 4)
    if len(rects):
        fields[:, 2:] -= 1
    wk, wm = _bits_for(k), _bits_for(m)
    rect_bytes = _pack_fields(fields, [wk, wm, wk, wm])
    pos = _encode_positions(scattered, k * m)
    vals = _values_bytes(np.concatenate([*rect_vals, values.reshape(-1)[scattered]]), code)
    return header, rect_bytes, pos, vals


def encode_grid(matrix: np.ndarray, *, min_cluster: int = 3, dtype: str = "float16") -> bytes:
    """Cluster coding of a sparse 2-D grid (SPEC 9): rectangles of at least min_cluster x min_cluster as
    (row, col, height, width) + their values; leftover nonzeros with positions + values."""
    return b"".join(_grid_parts(matrix, min_cluster, dtype))


def grid_cost(matrix: np.ndarray, *, min_cluster: int = 3, dtype: str = "float16") -> dict[str, int]:
    """Bits of encode_grid by part: header, positions (rectangle fields + scattered positions, with their
    byte padding), values; total == 8 * len(encode_grid(matrix))."""
    header, rects, pos, vals = _grid_parts(matrix, min_cluster, dtype)
    out = {"header": 8 * len(header), "positions": 8 * (len(rects) + len(pos)), "values": 8 * len(vals)}
    out["total"] = sum(out.values())
    return out


def decode_grid(data: bytes, *, max_elements: int | None = None) -> np.ndarray:
    r = _Reader(data)
    dt = _read_dtype(r)
    k = r.varint(limit=1 << 32)
    m = r.varint(limit=1 << 32)
    if k == 0 or m == 0:
        raise CodecError(f"empty grid {k}x{m}")
    _check_limit(k * m, max_elements, f"grid {k}x{m}")
    n_rect = r.varint(limit=k * m)
    wk, wm = _bits_for(k), _bits_for(m)
    fields = _unpack_fields(r, n_rect, [wk, wm, wk, wm]) if n_rect else np.zeros((0, 4), np.int64)
    r0, c0, h, w = fields[:, 0], fields[:, 1], fields[:, 2] + 1, fields[:, 3] + 1
    if n_rect and (np.any(r0 + h > k) or np.any(c0 + w > m)):
        raise CodecError("a rectangle lies outside the grid")
    areas = h * w
    n_rect_vals = int(areas.sum())
    if n_rect_vals > k * m:
        raise CodecError("rectangles hold more values than the grid")
    scattered = _decode_positions(r, k * m)
    vals = _read_values(r, dt, n_rect_vals + len(scattered))
    r.end()
    out = np.zeros((k, m), dtype=np.float32)
    start = 0
    for i in range(n_rect):  # a loop over rectangles, not weights
        a = int(areas[i])
        out[r0[i] : r0[i] + h[i], c0[i] : c0[i] + w[i]] = vals[start : start + a].reshape(h[i], w[i])
        start += a
    flat = out.reshape(-1)
    flat[scattered] = vals[start:]
    return out


# --------------------------------------------------------------- message
def encode_message(kind: str, fields: list[tuple[str, bytes]]) -> bytes:
    """Frame named payloads into one versioned message."""
    k = kind.encode()
    if len(k) > 255:
        raise ValueError("message kind too long")
    parts = [MAGIC, bytes([VERSION, len(k)]), k, _varint(len(fields))]
    for name, payload in fields:
        nb = name.encode()
        if len(nb) > 255:
            raise ValueError(f"field name too long: {name[:40]}...")
        parts += [bytes([len(nb)]), nb, _varint(len(payload)), bytes(payload)]
    return b"".join(parts)


def decode_message(
    data: bytes, *, expected_kind: str | None = None, max_bytes: int | None = None
) -> tuple[str, list[tuple[str, bytes]]]:
    if max_bytes is not None and len(data) > max_bytes:
        raise CodecError(f"message of {len(data)} bytes exceeds the bound of {max_bytes}")
    r = _Reader(data)
    if bytes(r.take(2)) != MAGIC:
        raise CodecError("not a dturbo message (bad magic)")
    version = r.byte()
    if version != VERSION:
        raise CodecError(f"unsupported message version {version} (this build reads {VERSION})")
    try:
        kind = bytes(r.take(r.byte())).decode()
    except UnicodeDecodeError:
        raise CodecError("message kind is not UTF-8") from None
    if expected_kind is not None and kind != expected_kind:
        raise CodecError(f"expected a {expected_kind!r} message, got {kind!r}")
    count = r.varint(limit=len(data))
    fields = []
    for _ in range(count):
        try:
            name = bytes(r.take(r.byte())).decode()
        except UnicodeDecodeError:
            raise CodecError("field name is not UTF-8") from None
        length = r.varint(limit=len(data))
        fields.append((name, bytes(r.take(length))))
    r.end()
    return kind, fields
