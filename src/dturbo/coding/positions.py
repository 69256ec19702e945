"""Positions of sorted distinct indices, the cheapest of an index list, a bitmap and Rice-coded gaps
(:mod:`dturbo.codec`, "positions")."""

from __future__ import annotations

import math

import numpy as np

from .bits import (
    _RICE_K_BITS,
    _SCHEME_BITMAP,
    _SCHEME_INDEX,
    _SCHEME_RICE,
    CodecError,
    _BitReader,
    _bits_for,
    _BitWriter,
    _read_dtype_code,
    _Reader,
)


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


