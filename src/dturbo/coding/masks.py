"""Arithmetic (range) coding of binary masks under a per-bit probability model (FedPM, Isik et al. ICLR 2023,
"less than 1 bit per parameter": a client's sampled mask is entropy coded, so it costs about its entropy).

The coder is ``constriction``'s range coder (``constriction.stream.queue.RangeEncoder`` with the vectorised
``constriction.stream.model.Bernoulli`` family, ``perfect=False``): both sides pass the same float64
probabilities, which constriction quantises to fixed point identically, so the receiver rebuilds every bit. A
probability of 0 or 1 still leaves the other outcome codable (at most :data:`MAX_BITS_PER_SYMBOL` bits).

Bytes: the coder's 32-bit words, little-endian, nothing else: the receiver knows the bit count and the model.
:func:`encode_mask_payload` / :func:`decode_mask_payload` make the ``mask`` payload layout of the ledger
(``codec.payload_bits``): ``model(1)``, for model 1 ``varint(ones)``, then the words. Model 0 codes each bit
with the receiver's own probabilities (FedPM: the global theta_G it sent); model 1 with one Bernoulli(ones / n)
for the whole layer, i.e. the empirical entropy the authors' code charges per mask.

Decoding is hardened for hostile input: the length must be whole words and at most what ``count`` symbols can
cost; the decoded mask is re-encoded and must give the very same bytes, so a truncated, padded or garbage payload
raises :class:`dturbo.codec.CodecError` (never hangs, never returns a wrong mask silently).
"""

from __future__ import annotations

import constriction
import numpy as np

from .bits import DEFAULT_MAX_ELEMENTS, CodecError, _Reader, _varint

__all__ = ["MAX_BITS_PER_SYMBOL", "decode_mask", "decode_mask_payload", "encode_mask", "encode_mask_payload",
           "mask_cost_bits"]

# constriction's Bernoulli model has 24-bit probability precision: the least likely outcome (p = 0 or 1 given)
# costs at most 24 bits; the range coder adds at most two words of its own.
MAX_BITS_PER_SYMBOL = 24
_WORD = 4


# constriction is one compiled module: its submodules are attributes, not importable paths
_Bernoulli = constriction.stream.model.Bernoulli
RangeEncoder = constriction.stream.queue.RangeEncoder
RangeDecoder = constriction.stream.queue.RangeDecoder


def _model() -> constriction.stream.model.Bernoulli:
    # perfect=False: the documented, stable behaviour (the default changes between versions)
    return _Bernoulli(perfect=False)


def _check_probs(probs: np.ndarray, count: int) -> np.ndarray:
    """float64 probabilities of the bits being 1, shape (count,), finite and in [0, 1] (constriction panics
    instead of raising on anything else, so this is checked first)."""
    p = np.asarray(probs, dtype=np.float64).reshape(-1)
    if p.size != count:
        raise ValueError(f"{p.size} probabilities for {count} bits")
    if p.size and not (np.all(np.isfinite(p)) and p.min() >= 0.0 and p.max() <= 1.0):
        raise ValueError("probabilities must be finite and in [0, 1]")
    return np.ascontiguousarray(p)


def encode_mask(bits: np.ndarray, probs: np.ndarray) -> bytes:
    """Range-code a binary mask (any shape, flattened row-major) with P(bit = 1) = ``probs`` (same size).
    Returns the coder's words as little-endian bytes; 0 bits give b""."""
    b = np.asarray(bits).reshape(-1)
    if b.size and (b.dtype.kind not in "biu" or not np.all((b == 0) | (b == 1))):
        raise ValueError("a mask must hold only 0 and 1")
    p = _check_probs(probs, b.size)
    if not b.size:
        return b""
    enc = RangeEncoder()
    enc.encode(b.astype(np.int32), _model(), p)
    return enc.get_compressed().astype("<u4").tobytes()


def decode_mask(data: bytes, probs: np.ndarray, count: int, *, max_elements: int | None = None) -> np.ndarray:
    """Inverse of :func:`encode_mask`: ``count`` bits as a uint8 array. Raises CodecError (a ValueError) on a
    payload that is not exactly the coding of some mask of ``count`` bits under ``probs``."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CodecError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    count = int(count)
    bound = DEFAULT_MAX_ELEMENTS if max_elements is None else int(max_elements)
    if not 0 <= count <= bound:
        raise CodecError(f"mask of {count} bits: allowed 0..{bound}")
    p = _check_probs(probs, count)
    if len(data) % _WORD:
        raise CodecError(f"mask payload of {len(data)} bytes is not whole 32-bit words (truncated?)")
    most = _WORD * (-(-count * MAX_BITS_PER_SYMBOL // 32) + 2) if count else 0
    if len(data) > most:
        raise CodecError(f"mask payload of {len(data)} bytes exceeds the {most} bytes {count} bits can take")
    if not count:
        return np.zeros(0, dtype=np.uint8)
    if not data:
        raise CodecError(f"empty payload for a mask of {count} bits (truncated)")
    words = np.frombuffer(data, dtype="<u4").astype(np.uint32)
    try:
        out = np.asarray(RangeDecoder(words).decode(_model(), p))
    except Exception as err:  # constriction raises AssertionError on data no mask codes to
        raise CodecError(f"invalid range-coded mask: {err}") from None
    if out.shape != (count,) or not np.all((out == 0) | (out == 1)):
        raise CodecError("range decoder returned a malformed mask")
    mask = out.astype(np.uint8)
    # Canonical check: trailing garbage, truncation into a decodable prefix, or random words all re-encode to
    # other bytes. Encoding is deterministic, so a genuine payload always passes.
    if encode_mask(mask, p) != data:
        raise CodecError("mask payload is not the coding of any mask (truncated, padded or corrupt)")
    return mask


def mask_cost_bits(bits: np.ndarray, probs: np.ndarray) -> float:
    """The information-theoretic cost sum(-log2 P(bit)) of a mask under ``probs`` (what a perfect coder pays)."""
    b = np.asarray(bits).reshape(-1).astype(bool)
    p = _check_probs(probs, b.size)
    with np.errstate(divide="ignore"):
        return float(-np.log2(np.where(b, p, 1.0 - p)).sum())


MODEL_GIVEN, MODEL_EMPIRICAL = 0, 1


def encode_mask_payload(bits: np.ndarray, probs: np.ndarray, model: str = "best") -> bytes:
    """One layer's mask as a ``mask`` payload: coded with ``probs`` (``model="global"``), with one
    Bernoulli(fraction of ones) (``"empirical"``), or the shorter of the two (``"best"``, ties to ``probs``)."""
    b = np.asarray(bits).reshape(-1)
    out = []
    if model in ("best", "global"):
        out.append(bytes([MODEL_GIVEN]) + encode_mask(b, probs))
    if model in ("best", "empirical"):
        ones = int(np.count_nonzero(b))
        frac = np.full(b.size, ones / b.size if b.size else 0.0)
        out.append(bytes([MODEL_EMPIRICAL]) + _varint(ones) + encode_mask(b, frac))
    if not out:
        raise ValueError(f"model must be 'best', 'global' or 'empirical', got {model!r}")
    return min(out, key=len)


def decode_mask_payload(payload: bytes, probs: np.ndarray, count: int) -> np.ndarray:
    """Inverse of :func:`encode_mask_payload`: ``count`` bits (uint8). CodecError on anything malformed."""
    r = _Reader(payload)
    model = r.byte()
    if model == MODEL_GIVEN:
        p = np.asarray(probs, dtype=np.float64).reshape(-1)
        ones = None
    elif model == MODEL_EMPIRICAL:
        ones = r.varint(limit=count, what="count of ones")
        p = np.full(count, ones / count if count else 0.0)
    else:
        raise CodecError(f"unknown mask probability model {model}")
    mask = decode_mask(payload[r.pos :], p, count)
    if ones is not None and int(np.count_nonzero(mask)) != ones:
        raise CodecError(f"mask holds {int(np.count_nonzero(mask))} ones, its header says {ones}")
    return mask
