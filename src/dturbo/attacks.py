"""Hostile clients (``[faults] attackers``, ``attack``; docs/robustness.md): each trains honestly, then rewrites its
upload's bytes as an attacker would (decode, change, encode again with the payload's own encoder), so that the
server meets uploads that frame and decode. Which clients attack is seeded once per run and every rewrite is a pure
function of the round and the client, so a run with attackers is reproducible and resumes identically.

The attacks, one small class each: ``values`` (every value +-65504, float16's largest), ``overflow`` (every value
+-3e38 in float32), ``sign_flip`` (values times -4, sigma times 4: inside the bounds), and three that stay inside
the bounds on purpose and read the round's honest uploads as a colluding attacker would: ``scaled_sign_flip`` (the
update reversed and stretched to 0.9 of the value bound), ``alie`` ("a little is enough", Baruch et al. 2019: the
honest mean less z standard deviations per coordinate) and ``ipm`` (inner-product manipulation, Xie et al. 2020:
-epsilon times the honest mean update); and two against a model with BatchNorm: ``plain_state`` (its running
statistics and affine weights reversed and stretched to their bound) and ``calibration`` (calibration replies of
means and variances at the bound); ``samples`` (n_t = every
sample of the federation), ``loss`` (a NaN, Inf or -1e300 training loss), ``copy`` (another client's upload of the
round sent as its own), ``spoof`` (its own upload under another client's id). A value attack on a field only its
method reads (FedPM's mask) sends it negated (:meth:`dturbo.protocol.ServerAlgorithm.negated_payload`: FedPM's mask
inverted).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import cached_property
from statistics import NormalDist
from typing import Any

import numpy as np

from .algorithms.base import pack_scalars, unpack_scalars
from .algorithms.bounds import VALUE_CAP, magnitude
from .algorithms.plain import SUFFIX as PLAIN
from .algorithms.plain import PlainTensor
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
from .quantize import level_values

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
                 others: Mapping[int, bytes], attackers: int = 1) -> None:
        self.server, self.cfg, self.round_idx, self.client = server, cfg, round_idx, client
        self.downlink, self.others, self.attackers = downlink, others, attackers

    def layout(self, kind: str, name: str) -> str | None:
        return self.server.layouts.get(kind, {}).get(name.rsplit(".", 1)[-1])

    @cached_property
    def _others(self) -> list[tuple[str, dict[str, bytes]]]:
        """The other uploads' kinds and fields, decoded once for every field an attack reads."""
        return [(kind, dict(fields)) for kind, fields in map(decode_message, self.others.values())]

    @cached_property
    def _down(self) -> tuple[str, dict[str, bytes]]:
        kind, fields = decode_message(self.downlink)
        return kind, dict(fields)

    def honest(self, name: str, size: int) -> np.ndarray:
        """The other (honest) clients' values of field ``name`` (one row each; those of another length left out)."""
        rows = []
        for kind, fields in self._others:
            payload, layout = fields.get(name), self.layout(kind, name)
            if payload is not None and layout in VALUE_LAYOUTS:
                v = read_values(payload, layout)
                if v.size == size:
                    rows.append(v)
        return np.stack(rows) if rows else np.zeros((0, size))

    def reference(self, name: str, size: int) -> np.ndarray | None:
        """The global values an upload field of weights moves from, read from the downlink: its field of the same
        name, or (a baseline's ``theta``: weight and bias of a layer) its ``w`` and ``bias`` one after the other;
        None where the downlink holds no such values."""
        kind, down = self._down
        base = name.rsplit(".", 1)[0]
        parts = [name] if name in down else [f"{base}.w", f"{base}.bias"]
        if not all(p in down and self.layout(kind, p) in VALUE_LAYOUTS for p in parts):
            return None
        v = np.concatenate([read_values(down[p], self.layout(kind, p)) for p in parts])
        return v if v.size == size else None


class Attack:
    """One way to rewrite an honest upload (and, :meth:`statistics`, a BatchNorm calibration reply)."""

    def rewrite(self, upload: bytes, ctx: RoundView) -> bytes:
        raise NotImplementedError

    def statistics(self, reply: bytes) -> bytes:
        """A calibration reply (:mod:`dturbo.algorithms.statistics`) as this attacker sends it: honest."""
        return reply


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


VALUE_LAYOUTS = ("values", "dense", "sparse", "quantized", "coded", "ternary")
UPDATE_LAYOUTS = ("quantized", "coded", "ternary")  # the quantised and ternary uploads carry updates, not weights


def read_values(payload: bytes, layout: str) -> np.ndarray:
    """A value payload as one float64 vector (quantised symbols at their levels, a ternary vector whole)."""
    if layout == "values":
        return decode_values(payload).astype(np.float64)
    if layout == "dense":
        return decode_dense(payload).astype(np.float64).reshape(-1)
    if layout == "sparse":
        return decode_sparse(payload).astype(np.float64).reshape(-1)
    if layout in ("quantized", "coded"):
        sym, levels, params = (decode_quantized if layout == "quantized" else decode_symbols)(payload)
        return level_values(sym, levels, float(params[0]))  # every quantiser of dturbo puts its levels so
    idx, negative, mu, n = decode_ternary(payload)
    out = np.zeros(n)
    out[idx] = np.where(negative, -mu, mu)
    return out


def write_values(target: np.ndarray, payload: bytes, layout: str) -> bytes:
    """``target`` written in the layout and dtype of ``payload``, keeping its structure: a sparse or ternary one's
    positions, a quantised one's level count (the scale stretched to reach ``target``)."""
    t = np.clip(np.nan_to_num(target), -VALUE_CAP, VALUE_CAP)
    if layout == "values":
        return encode_values(t, _DTYPE_NAMES[payload[0]])
    if layout == "dense":
        return encode_dense(t.reshape(decode_dense(payload).shape), _DTYPE_NAMES[payload[0]])
    if layout == "sparse":
        own = decode_sparse(payload)
        return encode_sparse(np.where(own != 0, t.reshape(own.shape), 0.0), _DTYPE_NAMES[payload[0] & 3])
    if layout in ("quantized", "coded"):
        _, levels, _ = (decode_quantized if layout == "quantized" else decode_symbols)(payload)
        scale = float(np.float32(np.abs(t).max())) if t.size else 0.0
        sym = np.zeros(t.size, np.int64) + (levels - 1) // 2
        if scale > 0:
            sym = np.clip(np.rint((t / scale + 1.0) * (levels - 1) / 2.0), 0, levels - 1).astype(np.int64)
        return (encode_quantized if layout == "quantized" else encode_symbols)(sym, levels, [scale])
    idx, _, _, n = decode_ternary(payload)
    kept = t[idx]
    return encode_ternary(idx, kept < 0, float(np.abs(kept).mean()) if kept.size else 0.0, n,
                          _DTYPE_NAMES[payload[0] & 3])


class CoordinatedAttack(ValueAttack):
    """An attack inside the bounds that sets each value field (sigma and the prior's scales excepted: they stay
    honest) to :meth:`target` of its own values, the global values the field moves from (0 for an update; None where
    the downlink does not show them) and, asked for when used, the honest clients' values of the same field this
    round. A field only its method reads (FedPM's mask) is sent negated."""

    def target(self, own: np.ndarray, reference: np.ndarray | None, honest: Callable[[], np.ndarray],
               ctx: RoundView) -> np.ndarray:
        raise NotImplementedError

    def payload(self, payload: bytes, layout: str, name: str, ctx: RoundView) -> bytes:
        if layout not in VALUE_LAYOUTS:  # the mask negated, any other layout as it is
            return super().payload(payload, layout, name, ctx)
        if name.rsplit(".", 1)[-1] in POSITIVE:
            return payload
        own = read_values(payload, layout)
        ref = np.zeros(own.size) if layout in UPDATE_LAYOUTS else ctx.reference(name, own.size)
        return write_values(self.target(own, ref, lambda: ctx.honest(name, own.size), ctx), payload, layout)


class ScaledSignFlip(CoordinatedAttack):
    """The client's update reversed and stretched until its largest value reaches 0.9 of the bound the server
    checks (:func:`dturbo.algorithms.bounds.magnitude` of the global layer): the strongest sign flip an upload
    bound lets through. A field of weights whose global values the downlink does not show is reversed about 0."""

    share = 0.9

    def bound(self, reference: np.ndarray) -> float:
        """The largest magnitude the server accepts for the field, from its global values."""
        return magnitude(reference)

    def target(self, own: np.ndarray, reference: np.ndarray | None, honest: Callable[[], np.ndarray],
               ctx: RoundView) -> np.ndarray:
        ref = np.zeros(own.size) if reference is None else reference
        step = own - ref
        top = float(np.abs(step).max()) if step.size else 0.0
        if top == 0.0:
            return own
        # how far from the global values the reversed update may reach
        room = max(self.share * self.bound(ref) - float(np.abs(ref).max()), 0.0)
        return ref - step * room / top


class ALIE(CoordinatedAttack):
    """"A little is enough" (Baruch et al. 2019): per coordinate the honest mean less z honest standard deviations,
    z = Phi^-1((n - s) / n) with s = floor(n / 2 + 1) - f for n uploads of which f hostile (the paper's z_max: 0 for
    one attacker of ten, 0.52 for three)."""

    def target(self, own: np.ndarray, reference: np.ndarray | None, honest: Callable[[], np.ndarray],
               ctx: RoundView) -> np.ndarray:
        rows = honest()
        if rows.shape[0] < 2:
            return own
        n, f = rows.shape[0] + ctx.attackers, ctx.attackers
        s = n // 2 + 1 - f
        z = NormalDist().inv_cdf(min(max((n - s) / n, 0.5), 0.999))
        return rows.mean(axis=0) - z * rows.std(axis=0)


class IPM(CoordinatedAttack):
    """Inner-product manipulation (Xie et al. 2020): the update -epsilon times the honest clients' mean update
    (epsilon = 0.1, the setting of Karimireddy et al. 2021), sent as the weights it makes; a field of weights whose
    global values the downlink does not show stays honest."""

    epsilon = 0.1

    def target(self, own: np.ndarray, reference: np.ndarray | None, honest: Callable[[], np.ndarray],
               ctx: RoundView) -> np.ndarray:
        if reference is None:
            return own
        rows = honest()
        if not rows.shape[0]:
            return own
        return reference - self.epsilon * (rows.mean(axis=0) - reference)


class _ToLimit(ScaledSignFlip):
    """The scaled sign flip of one tensor of the state outside the Bayesian layers, to 0.9 of its limit
    (:meth:`dturbo.algorithms.plain.PlainTensor.limit`)."""

    def __init__(self, tensor: PlainTensor) -> None:
        self.tensor = tensor

    def bound(self, reference: np.ndarray) -> float:
        return self.tensor.limit(reference)


class PlainStatePoison(ScaledSignFlip):
    """Only the state outside the Bayesian layers (the ``.plain`` fields) reversed about the global state and
    stretched to 0.9 of the limit the server checks (BatchNorm's affine weights: a weight layer's; its running
    statistics: ``VALUE_CAP``); the Bayesian layers' fields honest."""

    def payload(self, payload: bytes, layout: str, name: str, ctx: RoundView) -> bytes:
        if not (name.endswith(f".{PLAIN}") and layout == "dense"):
            return payload
        tensor = next((t for t in ctx.server.plain.tensors if t.field == name), None)
        return payload if tensor is None else _ToLimit(tensor).payload(payload, layout, name, ctx)


class CalibrationPoison(Attack):
    """Trains and uploads honestly; answers BatchNorm calibration with every mean at 0.9 of the bound the server
    checks (``VALUE_CAP``), its sign kept, and every variance at 0.9 of it."""

    def rewrite(self, upload: bytes, ctx: RoundView) -> bytes:
        return upload

    def statistics(self, reply: bytes) -> bytes:
        kind, fields = decode_message(reply)
        out = []
        for name, payload in fields:
            v = decode_dense(payload).astype(np.float64)
            top = 0.9 * VALUE_CAP
            v = np.full(v.shape, top) if name.endswith(".var") else np.where(v < 0, -top, top)
            out.append((name, encode_dense(v, "float32")))
        return encode_message(kind, out)


ATTACKS: dict[str, type[Attack]] = {"values": ExtremeValues, "overflow": Overflow, "sign_flip": SignFlip,
                                    "samples": Samples, "loss": Loss, "copy": Copy, "spoof": Spoof,
                                    "scaled_sign_flip": ScaledSignFlip, "alie": ALIE, "ipm": IPM,
                                    "plain_state": PlainStatePoison, "calibration": CalibrationPoison}
