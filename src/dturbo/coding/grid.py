"""Cluster-coded grids and supports, whole or as the flips from the receiver's support (:mod:`dturbo.codec`,
"grid", "support delta")."""

from __future__ import annotations

from typing import Any

import numpy as np

from .bits import (
    _DTYPES,
    _MAX_DIM,
    _SCHEME_RICE,
    CodecError,
    _as_real,
    _BitReader,
    _bits_for,
    _BitWriter,
    _cast_values,
    _check_limit,
    _dtype_code,
    _read_values,
    _Reader,
    _varint,
)
from .positions import _flags, _position_plan, _read_flags, _read_positions, _write_positions
from .rectangles import _find_rectangles


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


