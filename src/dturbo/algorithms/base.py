"""What the federated methods share on top of the protocol (:mod:`dturbo.protocol`): framing messages, scalars,
upload meta, client weights and sampling, per-client RNGs, and the ledger's split of a message's bits."""

from __future__ import annotations

import numpy as np
import torch

from ..codec import decode_message, decode_values, encode_message, encode_values
from ..ledger import LEDGER_PARTS, message_bits
from ..protocol import (  # the protocol's types, importable from here too
    ClientAlgorithm,
    ClientData,
    ClientError,
    MessageError,
    Rejection,
    RoundResult,
    ServerAlgorithm,
    State,
)

__all__ = [
    "LEDGER_PARTS", "NO_CLIENT", "ClientAlgorithm", "ClientData", "ClientError", "MessageError", "Rejection",
    "RoundResult", "ServerAlgorithm", "State", "client_generator", "client_weights", "decode_message",
    "encode_message", "fields_dict", "frame", "message_bits", "need", "pack_scalars", "sample_uniform",
    "unpack_scalars", "upload_meta", "upload_samples",
]


def pack_scalars(values: list[float] | np.ndarray) -> bytes:
    """A few float64 scalars (counters, metrics) as a field payload."""
    return encode_values(np.asarray(values, dtype=np.float64), dtype="float64")


def unpack_scalars(payload: bytes, count: int) -> np.ndarray:
    out = decode_values(payload, max_elements=count)
    if out.shape != (count,):
        raise MessageError(f"expected {count} scalars, got {out.shape[0]}")
    return out.astype(np.float64)


def fields_dict(data: bytes, expected_kind: str, max_bytes: int | None = None) -> dict[str, bytes]:
    """Decode a framed message into a name -> payload mapping, rejecting duplicate names."""
    _, fields = decode_message(data, expected_kind=expected_kind, max_bytes=max_bytes)
    out: dict[str, bytes] = {}
    for name, payload in fields:
        if name in out:
            raise MessageError(f"duplicate field {name!r}")
        out[name] = payload
    return out


def frame(kind: str, fields: dict[str, bytes]) -> bytes:
    return encode_message(kind, list(fields.items()))


def client_generator(seed: int, round_idx: int, client_id: int) -> torch.Generator:
    """The RNG of one client in one round: a pure function of (seed, round, client), so a resumed run
    draws exactly the same minibatches and noise as an uninterrupted one."""
    ss = np.random.SeedSequence([seed, round_idx, client_id, 0xD7])
    g = torch.Generator()
    g.manual_seed(int(ss.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1)))
    return g


def need(fields: dict[str, bytes], name: str) -> bytes:
    """The payload of a field a message must have."""
    if name not in fields:
        raise MessageError(f"missing field {name!r}")
    return fields[name]


def upload_samples(fields: dict[str, bytes], round_idx: int | None, total_samples: int) -> int:
    """n_t of an upload, from its ``meta`` (round, client id, n_t): the round must be this one (else stale or
    replayed) and n_t a whole number in 1..n."""
    return upload_meta(fields, round_idx, total_samples)[0]


NO_CLIENT = -1  # the client id of an upload whose meta names none that can be a client's


def upload_meta(fields: dict[str, bytes], round_idx: int | None, total_samples: int) -> tuple[int, int]:
    """(n_t, the client id it claims) of an upload, from its ``meta`` (round, client id, n_t): the round must be this
    one (else stale or replayed) and n_t a whole number in 1..n; a claimed id that is no whole number in 0..2**31
    reads as :data:`NO_CLIENT` (the server compares it with the sender)."""
    meta = unpack_scalars(need(fields, "meta"), 3)
    if round_idx is not None and meta[0] != round_idx:
        raise MessageError(f"upload of round {meta[0]:g}, this is round {round_idx} (stale or replayed)")
    n_t = meta[2]
    if not (np.isfinite(n_t) and n_t >= 1 and n_t == int(n_t) and n_t <= total_samples):
        raise MessageError(f"invalid sample count n_t={n_t}")
    claimed = meta[1]
    client = int(claimed) if np.isfinite(claimed) and claimed == int(claimed) and 0 <= claimed < 2**31 else NO_CLIENT
    return int(n_t), client


def client_weights(n_t: list[int] | np.ndarray, weighting: str) -> np.ndarray:
    """p_t of the clients that answered: n_t / sum n_t (renormalised among them), or uniform."""
    n = np.asarray(n_t, dtype=np.float64)
    return n / n.sum() if weighting == "samples" else np.full(n.size, 1.0 / n.size)


def sample_uniform(seed: int, round_idx: int, n: int, k: int | None) -> list[int]:
    """k of n clients uniformly without replacement, a pure function of (seed, round); all when k is None or >= n."""
    if k is None or k >= n:
        return list(range(n))
    rng = np.random.default_rng([seed, round_idx, 0x5A])
    return sorted(rng.choice(n, size=k, replace=False).tolist())
