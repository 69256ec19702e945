"""Byte and bit primitives of the codec (:mod:`dturbo.codec`): varints, bounded readers, MSB-first bit streams,
value dtypes; and :class:`CodecError`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

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


