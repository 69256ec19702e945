"""Hostile clients (``[faults] attackers``, ``attack``; docs/robustness.md): each trains honestly, then rewrites its
upload's bytes as an attacker would (decode, change, encode again with the payload's own encoder), so that the
server meets uploads that frame and decode. Which clients attack is seeded once per run and every rewrite is a pure
function of the round and the client, so a run with attackers is reproducible and resumes identically.

The attacks, one small class each: ``values`` (every value +-65504, float16's largest), ``overflow`` (every value
+-3e38 in float32), ``sign_flip`` (values times -4, sigma times 4: inside the bounds), ``samples`` (n_t = every
sample of the federation), ``loss`` (a NaN, Inf or -1e300 training loss), ``copy`` (another client's upload of the
round sent as its own), ``spoof`` (its own upload under another client's id). A value attack on a field only its
method reads (FedPM's mask) sends it negated (:meth:`dturbo.protocol.ServerAlgorithm.negated_payload`: FedPM's mask
inverted).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .algorithms.base import pack_scalars, unpack_scalars
from .codec import (
    decode_dense,
    decode_message,
    decode_quantized,
    decode_sparse,
    decode_ternary,
    decode_values,
    encode_dense,
    encode_message,
    encode_quantized,
    encode_sparse,
    encode_ternary,
    encode_values,
)
from .coding.values import decode_symbols, encode_symbols
from .config import Config

_DTYPE_NAMES = {1: "float16", 2: "float32", 3: "float64"}
_FLOAT16_MAX = 65504.0
POSITIVE = ("sigma", "prior_std")  # field suffixes whose values are > 0 (scaled, never negated)


def hostile_clients(cfg: Config) -> list[int]:
    """The ``[faults] attackers`` hostile client ids of a run, a pure function of its seed."""
    n, k = cfg.federation.clients, min(cfg.faults.attackers, cfg.federation.clients)
    if not k:
        return []
    rng = np.random.default_rng([cfg.experiment.seed, 0xA77AC4])
    return sorted(int(c) for c in rng.choice(n, size=k, replace=False))


class RoundView:
    """What an attacker knows of its round: the server it talks to (its message layouts, its algorithm's messages
    and layers), the round, its client id, its downlink and the other clients' uploads."""

    def __init__(self, server: Any, cfg: Config, round_idx: int, client: int, downlink: bytes,
                 others: Mapping[int, bytes]) -> None:
        self.server, self.cfg, self.round_idx, self.client = server, cfg, round_idx, client
        self.downlink, self.others = downlink, others

    def layout(self, kind: str, name: str) -> str | None:
        return self.server.layouts.get(kind, {}).get(name.rsplit(".", 1)[-1])


class Attack:
    """One way to rewrite an honest upload."""

    def rewrite(self, upload: bytes, ctx: RoundView) -> bytes:
        raise NotImplementedError


def _replace(upload: bytes, name: str, payload: bytes) -> bytes:
    kind, fields = decode_message(upload)
    return encode_message(kind, [(n, payload if n == name else p) for n, p in fields])


class ValueAttack(Attack):
    """Rewrites every value payload of the upload (:meth:`values`: float values; :meth:`symbols`: quantised ones;
    a FedPM mask is inverted)."""

    dtype: str | None = None  # the wire dtype it writes (None: the payload's own)

    def values(self, v: np.ndarray, positive: bool) -> np.ndarray:
        raise NotImplementedError

    def symbols(self, sym: np.ndarray, levels: int, params: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def negate(self, negative: np.ndarray) -> np.ndarray:
        return negative

    def _dtype(self, code: int) -> str:
        return self.dtype or _DTYPE_NAMES[code]

    def payload(self, payload: bytes, layout: str, name: str, ctx: RoundView) -> bytes:
        positive = name.rsplit(".", 1)[-1] in POSITIVE
        if layout == "values":
            return encode_values(self.values(decode_values(payload).astype(np.float64), positive),
                                 self._dtype(payload[0]))
        if layout == "dense":
            return encode_dense(self.values(decode_dense(payload).astype(np.float64), positive),
                                self._dtype(payload[0]))
        if layout == "sparse":
            v = decode_sparse(payload).astype(np.float64)
            return encode_sparse(np.where(v != 0, self.values(v, positive), 0.0), self._dtype(payload[0] & 3))
        if layout in ("quantized", "coded"):
            sym, levels, params = (decode_quantized if layout == "quantized" else decode_symbols)(payload)
            sym, params = self.symbols(sym, levels, params.astype(np.float64))
            return (encode_quantized if layout == "quantized" else encode_symbols)(sym, levels, params)
        if layout == "ternary":
            idx, negative, mu, n = decode_ternary(payload)
            return encode_ternary(idx, self.negate(negative), float(self.values(np.array([mu]), True)[0]), n,
                                  self._dtype(payload[0] & 3))
        if layout == "mask":  # a layout only its method reads (FedPM's coded mask): the method negates it
            return ctx.server.negated_payload(name, payload, ctx.downlink) or payload
        return payload

    def rewrite(self, upload: bytes, ctx: RoundView) -> bytes:
        kind, fields = decode_message(upload)
        out = []
        for name, payload in fields:
            layout = ctx.layout(kind, name)
            out.append((name, payload if layout is None else self.payload(payload, layout, name, ctx)))
        return encode_message(kind, out)


class ExtremeValues(ValueAttack):
    """Every value at float16's largest magnitude, with its sign (sigma +65504; zeros of a sparse upload stay 0)."""

    def values(self, v: np.ndarray, positive: bool) -> np.ndarray:
        return np.where(v < 0, -_FLOAT16_MAX, _FLOAT16_MAX) if not positive else np.full(v.shape, _FLOAT16_MAX)

    def symbols(self, sym: np.ndarray, levels: int, params: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return sym, np.full(params.shape, _FLOAT16_MAX)


class Overflow(ExtremeValues):
    """Every value at 3e38 (finite in float32, beyond float16), written in float32."""

    dtype = "float32"
    top = 3e38

    def values(self, v: np.ndarray, positive: bool) -> np.ndarray:
        return np.where(v < 0, -self.top, self.top) if not positive else np.full(v.shape, self.top)

    def symbols(self, sym: np.ndarray, levels: int, params: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return sym, np.full(params.shape, self.top)


class SignFlip(ValueAttack):
    """Values times -4 (sigma times 4), within float16: an attack that stays inside the bounds."""

    factor = 4.0

    def values(self, v: np.ndarray, positive: bool) -> np.ndarray:
        return np.clip(v * (self.factor if positive else -self.factor), -_FLOAT16_MAX, _FLOAT16_MAX)

    def symbols(self, sym: np.ndarray, levels: int, params: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return levels - 1 - sym, params * self.factor  # the levels are symmetric about 0: L - 1 - k is -level k

    def negate(self, negative: np.ndarray) -> np.ndarray:
        return ~negative


class Samples(Attack):
    """n_t = every sample of the federation: half the weight of a round of 10."""

    def rewrite(self, upload: bytes, ctx: RoundView) -> bytes:
        round_idx, client, _ = unpack_scalars(dict(decode_message(upload)[1])["meta"], 3)
        return _replace(upload, "meta", pack_scalars([round_idx, client, ctx.server.total_samples]))


class Loss(Attack):
    """A training loss of NaN, Inf or -1e300 (by round)."""

    def rewrite(self, upload: bytes, ctx: RoundView) -> bytes:
        metrics = decode_values(dict(decode_message(upload)[1])["metrics"]).astype(np.float64)
        metrics[0] = (float("nan"), float("inf"), -1e300)[ctx.round_idx % 3]
        # written by hand: the encoder refuses NaN and Inf ("values" layout: float64 code, count, values)
        return _replace(upload, "metrics", bytes([3, metrics.size]) + metrics.astype("<f8").tobytes())


class Copy(Attack):
    """Another client's upload of the round (the next honest one in the order) sent as its own."""

    def rewrite(self, upload: bytes, ctx: RoundView) -> bytes:
        others = [c for c in ctx.others if c != ctx.client]
        after = [c for c in others if c > ctx.client] + [c for c in others if c < ctx.client]
        return ctx.others[after[0]] if after else upload


class Spoof(Attack):
    """Its own upload under the id of the next client."""

    def rewrite(self, upload: bytes, ctx: RoundView) -> bytes:
        round_idx, _, n_t = unpack_scalars(dict(decode_message(upload)[1])["meta"], 3)
        victim = (ctx.client + 1) % ctx.cfg.federation.clients
        return _replace(upload, "meta", pack_scalars([round_idx, victim, n_t]))


ATTACKS: dict[str, type[Attack]] = {"values": ExtremeValues, "overflow": Overflow, "sign_flip": SignFlip,
                                    "samples": Samples, "loss": Loss, "copy": Copy, "spoof": Spoof}
