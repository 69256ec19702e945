"""STC, sparse ternary compression in both directions (Sattler, Wiedemann, Mueller, Samek, "Robust and
Communication-Efficient Federated Learning from Non-IID Data", IEEE TNNLS 2020, arXiv:1903.02891; REFERENCE.md).

The paper's Algorithm 1, ``STC_p(T)`` on one tensor T: keep the k = ceil(p * numel) entries of largest |T|,
mu = mean |kept|, send ``sign(T_i) * mu`` at the kept positions, the positions Golomb coded. Its Algorithm 2
(federated learning with STC, "extending to downstream compression"):

* client i, round t: train from the global model W; ``A_i = (W_local - W) + R_i``; send ``S_i = STC_{p_up}(A_i)``;
  keep ``R_i = A_i - S_i`` (error feedback: what was not sent is sent later);
* server: ``A = R + sum_i w_i S_i`` (w_i = n_i / n, or 1 / |I_t|); broadcast ``S = STC_{p_down}(A)``; keep
  ``R = A - S``; ``W <- W + S``. Every client applies the same S to its own copy of W, so W never travels again.

As in the authors' code (``compression_utils.stc`` of felisat/federated-learning), compression is per parameter
tensor: a layer's weight and its bias are compressed apart, each with its own k and mu. Ties at the k-th
magnitude go to the lower index, and an all-zero entry is never "kept" (it would carry a sign it does not have).
mu is rounded to its wire dtype (``[stc] dtype``) *before* the residual is formed, so sent + residual equals
the accumulated update up to one float64 rounding, and the receiver rebuilds exactly what the sender subtracted.

Wire (codec :func:`~dturbo.codec.encode_ternary`): per tensor n, the count, mu, the positions (the cheapest of
index list / bitmap / Rice-coded gaps; at STC's densities Rice, i.e. Golomb with a power-of-two parameter, as in
the paper's "lossless encoding"), one sign bit per position. The ledger books mu and the sign bits as values,
the position stream as positions.

Downlink: round 0 carries the initial model dense in float32 (the one time W travels; the paper's clients start
from a common model too, this counts what that costs); every later round carries only the ternary update S of
the previous aggregation, plus an 8-byte digest (sha256) of the model it yields. State outside the Bayesian layers
(a model of one's own with BatchNorm, ...) is not STC-compressed: it travels dense in float16 both ways every round,
as with every algorithm (:mod:`dturbo.algorithms.plain`). The server state holds W, its
residual R and the pending S, so the server side is checkpointed whole.

Client state (private in STC: residuals R_i, and the copy of W the updates apply to):

* kept in the client object, the residuals **per client id** (one client object serves every id in the
  in-process runner), the global model **once per process**: every client receives every broadcast (the
  ledger counts the downlink to each of them, injected drops included), so their copies are the same bytes and
  one copy stands for all (a round in which no client at all runs leaves it behind: the next round then fails).
  A client whose copy does not yield the digest, or that has no copy of the previous round, raises
  :class:`~dturbo.algorithms.base.ClientError` (counted as failed, with the reason): it never trains from wrong
  weights. Hence STC needs every client every round (``federation.clients_per_round`` unset or equal to
  ``clients``; a :class:`~dturbo.config.ConfigError` otherwise): the paper's weight-update caching for partial
  participation is not implemented;
* a round is a pure function of (downlink, data, residual at the start of that round): a retried round
  (``federation.on_too_few = "retry"``) starts again from the same residual instead of adding the update twice;
* resume: :meth:`StcClient.export_state` / :meth:`StcClient.import_state` give the residuals and the model copy
  to the in-process runner, which saves them in the same atomic checkpoint file as the server state (under
  ``clients/``), so a resumed run is bit-identical to an uninterrupted one;
* Flower: after each successful round the ClientApp saves this node's part of :meth:`StcClient.export_state`
  (the model copy, its own residual) in the node's ``Context.state``, which the SuperNode keeps across the
  messages of a run, and imports it into a client object that did not make it (Flower's deployment engine may
  start a ClientApp process per message), so a run is exact as above, in process and per message (tested;
  :mod:`dturbo.flower.client_app`). What ``Context.state`` does not outlive still loses the state: a restarted
  SuperNode, or a resumed Flower run (a new run, and its checkpoint holds no client state); those clients then
  fail with that reason instead of training. On a deployment so does a node that missed a broadcast (its train
  message was not delivered): its own copy of the model is behind (in one process one copy serves all, as above).
* an upload lost on the way (dropped, late, corrupted) is lost for good: the client's residual already counts
  it as sent and nothing sends it again.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field
from torch import nn

from ..codec import decode_dense, decode_ternary, encode_dense, encode_ternary
from ..config import Config, ConfigError, Probability, Section
from ..device import resolve_device
from ..nn.bayes import bayesian_layers
from ..protocol import NO_CLIENT, AlgorithmSpec, ClientAlgorithm
from .base import (
    ClientData,
    ClientError,
    MessageError,
    RoundResult,
    State,
    client_generator,
    need,
    pack_scalars,
    unpack_scalars,
    upload_meta,
)
from .bounds import Limit, UploadBounds, magnitude
from .feedback import ClientResiduals
from .local import round_lr, train_local
from .message import Layouts, MessageSpec, ledger, upload_metrics
from .plain import PlainState
from .point import PointLayer, _load, _theta, make_deterministic, point_layers, point_model, sigma_options
from .server import ServerBase, Upload

DOWN_KIND, UP_KIND = "stc/down", "stc/up"
DIGEST_BYTES = 8
_FLOAT16_MAX = 65504.0
_MODE_DENSE, _MODE_UPDATE = 0, 1


# ============================================================ the compressor (Algorithm 1)
def stc_k(n: int, p: float) -> int:
    """Entries kept of a tensor of n: k = ceil(p * n), at least 1 (the authors' code), 0 for an empty tensor."""
    return min(n, max(1, math.ceil(p * n))) if n else 0


def top_k_indices(v: np.ndarray, k: int) -> np.ndarray:
    """Sorted positions of the k largest |v| (ties at the k-th magnitude: lower index first), zeros never
    included (so fewer than k when v has fewer nonzeros). O(n): one partition, no sort of the whole vector."""
    a = np.abs(np.asarray(v, dtype=np.float64).reshape(-1))
    k = min(int(k), int(np.count_nonzero(a)))
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    if k == a.size:
        return np.arange(a.size, dtype=np.int64)
    thr = np.partition(a, a.size - k)[a.size - k]  # the k-th largest magnitude (> 0 as k <= nonzeros)
    greater = np.flatnonzero(a > thr)
    ties = np.flatnonzero(a == thr)[: k - greater.size]
    return np.sort(np.concatenate([greater, ties])).astype(np.int64)


def wire_mu(mu: float, dtype: str) -> float:
    """mu as the receiver will read it: rounded to ``dtype`` (float16 clipped to its largest value; the residual
    keeps the rest, so nothing is lost)."""
    if dtype == "float16":
        return float(np.float16(min(mu, _FLOAT16_MAX)))
    return float(np.float32(mu))


def ternary_dense(idx: np.ndarray, negative: np.ndarray, mu: float, n: int) -> np.ndarray:
    """The float64 vector of n with ``-mu`` / ``+mu`` at ``idx`` (by ``negative``), 0 elsewhere."""
    out = np.zeros(n, dtype=np.float64)
    out[idx] = np.where(negative, -mu, mu)
    return out


def stc_compress(acc: np.ndarray, p: float, dtype: str) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
    """``STC_p`` of one accumulated tensor (update + residual), the paper's Algorithm 1 with error feedback:
    (positions, negative, mu on the wire, new residual = acc - sent), all in float64."""
    acc = np.asarray(acc, dtype=np.float64).reshape(-1)
    idx = top_k_indices(acc, stc_k(acc.size, p))
    kept = acc[idx]
    mu = wire_mu(float(np.abs(kept).mean()), dtype) if idx.size else 0.0
    negative = kept < 0
    return idx, negative, mu, acc - ternary_dense(idx, negative, mu, acc.size)


def model_digest(theta: np.ndarray) -> bytes:
    """8 bytes of sha256 over the float32 model: a client checks that its rebuilt model is the server's."""
    return hashlib.sha256(np.ascontiguousarray(theta, dtype="<f4").tobytes()).digest()[:DIGEST_BYTES]


# ================================================================== tensor layout
class StcConfig(Section):
    """STC (Sattler et al. 2019, sparse ternary compression): per tensor, clients send the top-k of (update +
    their error-feedback residual) as {-mu, 0, +mu} with Golomb(-Rice) coded positions; the server averages,
    compresses the global update the same way (its own residual) and broadcasts it. Needs every client every
    round (federation.clients_per_round unset)."""

    p_up: Probability = Field(0.01, gt=0, le=1, description="fraction kept of each tensor's client update, "
                                                            "k = ceil(p_up * size) (the paper uses 1/25 .. 1/400)")
    p_down: Probability = Field(0.01, gt=0, le=1, description="the same for the server's broadcast update")
    dtype: Literal["float16", "float32"] = Field("float32", description="of mu, one value per tensor and message")
    weighting: Literal["uniform", "samples"] = Field("samples", description="mean of the updates, or by n_t")


@dataclass(frozen=True)
class StcTensor:
    """One compressed tensor (a layer's weight or bias) as a slice of the flat model vector."""

    name: str  # "dense1.w" / "dense1.bias"
    start: int
    size: int

    @property
    def sl(self) -> slice:
        return slice(self.start, self.start + self.size)


def stc_tensors(layers: list[PointLayer]) -> list[StcTensor]:
    """Weight then bias of every layer, in the order of the flat vector (point.py's theta, layer after layer)."""
    out, pos = [], 0
    for info in layers:
        for name, size in ((f"{info.name}.w", info.size - info.n_bias), (f"{info.name}.bias", info.n_bias)):
            if size:
                out.append(StcTensor(name, pos, size))
                pos += size
    return out


def _flat_state(state: State, layers: list[PointLayer]) -> np.ndarray:
    return np.concatenate([np.concatenate([state[f"{i.name}.w"].reshape(-1), state[f"{i.name}.bias"].reshape(-1)])
                           for i in layers]).astype(np.float32)


def _decode_update(fields: dict[str, bytes], tensors: list[StcTensor], total: int,
                   max_kept: dict[str, int] | None = None) -> tuple[np.ndarray, int]:
    """The float64 dense update of a message's ``<tensor>.delta`` fields and the entries it keeps. Raises
    MessageError / CodecError with a reason: wrong length, more entries than k, mu not finite or negative
    (bad, unsorted or duplicate positions and truncation are the codec's CodecError)."""
    out = np.zeros(total, dtype=np.float64)
    kept = 0
    for t in tensors:
        idx, negative, mu, n = decode_ternary(need(fields, f"{t.name}.delta"), max_elements=t.size)
        if n != t.size:
            raise MessageError(f"{t.name}.delta has length {n}, expected {t.size}")
        if max_kept is not None and idx.size > max_kept[t.name]:
            raise MessageError(f"{t.name}.delta keeps {idx.size} entries, more than k = {max_kept[t.name]}")
        if not (math.isfinite(mu) and mu >= 0):
            raise MessageError(f"{t.name}.delta has an invalid magnitude mu = {mu}")
        out[t.start + idx] = np.where(negative, -mu, mu)
        kept += idx.size
    return out, kept


# ======================================================================= messages
@dataclass
class StcDownlink:
    """A broadcast: its round, mode (round 0: W dense, later: the ternary update S), the digest of the model it
    yields, and its fields, read lazily (:meth:`StcMessages.dense_model`, :meth:`StcMessages.update`): a client
    first checks that it holds the model the update applies to."""

    round_idx: int
    mode: int
    digest: bytes
    fields: dict[str, bytes]


@dataclass
class StcUplink(Upload):
    update: np.ndarray  # the dense float64 update sum of the client's ternary tensors
    kept: int  # entries it sends
    nll: float  # the client's mean training loss

    def vectors(self) -> dict[str, np.ndarray]:
        return {"update": self.update}


class StcMessages:
    """STC's two messages, defined once (module docstring, Wire): specs, encoders, decoders, the uplink bound."""

    def __init__(self, cfg: Config, layers: list[PointLayer], plain: PlainState) -> None:
        self.cfg, self.layers, self.plain = cfg, layers, plain
        self.tensors = stc_tensors(layers)
        self.size = sum(t.size for t in self.tensors)
        self.k_up = {t.name: stc_k(t.size, cfg.stc.p_up) for t in self.tensors}
        self.down = MessageSpec(DOWN_KIND, {"meta": "header", "digest": "header", "w": "dense", "bias": "dense",
                                            "delta": "ternary"})
        self.up = MessageSpec(UP_KIND, {"meta": "header", "metrics": "header", "delta": "ternary"})
        # a bitmap and the sign bits of every tensor, plus headers
        self.max_uplink_bytes = sum(2 * t.size // 8 + 64 for t in self.tensors) + plain.max_bytes() + 4096

    @property
    def layouts(self) -> Layouts:
        return ledger(self.down, self.up)

    def encode_downlink(self, state: State, round_idx: int, total_samples: int) -> bytes:
        theta = _flat_state(state, self.layers)
        mode = _MODE_DENSE if round_idx == 0 else _MODE_UPDATE
        fields = {"meta": pack_scalars([round_idx, total_samples, mode])}
        for t in self.tensors:
            if mode == _MODE_DENSE:
                fields[t.name] = encode_dense(theta[t.sl], dtype="float32")
            else:
                sent = state[f"{t.name}.sent"]
                idx = np.flatnonzero(sent)
                mu = float(abs(sent[idx[0]])) if idx.size else 0.0
                fields[f"{t.name}.delta"] = encode_ternary(idx, sent[idx] < 0, mu, t.size, dtype=self.cfg.stc.dtype)
        fields["digest"] = model_digest(theta)
        return self.down.frame(fields | self.plain.encode_state(state))

    def decode_downlink(self, data: bytes) -> StcDownlink:
        fields = self.down.open(data)
        round_idx, _, mode = (int(v) for v in unpack_scalars(need(fields, "meta"), 3))
        return StcDownlink(round_idx, mode, need(fields, "digest"), fields)

    def dense_model(self, msg: StcDownlink) -> np.ndarray:
        """W of a round-0 broadcast as a float32 flat vector."""
        theta = np.zeros(self.size, dtype=np.float32)
        for t in self.tensors:
            v = decode_dense(need(msg.fields, t.name), max_elements=t.size).reshape(-1)
            if v.size != t.size:
                raise MessageError(f"{t.name}: {v.size} values in the downlink, the model has {t.size}")
            theta[t.sl] = v
        return theta

    def update(self, msg: StcDownlink) -> np.ndarray:
        """S of a later broadcast, dense float64."""
        return _decode_update(msg.fields, self.tensors, self.size)[0]

    def encode_uplink(self, round_idx: int, client_id: int, n_t: int, acc: np.ndarray, after: np.ndarray,
                      plain_fields: dict[str, bytes], nll: float) -> bytes:
        """The upload STC_{p_up}(acc) per tensor; writes the residual acc - sent into ``after``."""
        up = {"meta": pack_scalars([round_idx, client_id, n_t])}
        s = self.cfg.stc
        for t in self.tensors:
            idx, negative, mu, after[t.sl] = stc_compress(acc[t.sl], s.p_up, s.dtype)
            up[f"{t.name}.delta"] = encode_ternary(idx, negative, mu, t.size, dtype=s.dtype)
        up |= plain_fields
        up["metrics"] = pack_scalars([nll])
        return self.up.frame(up)

    def decode_uplink(self, data: bytes, round_idx: int | None, total_samples: int) -> StcUplink:
        """One upload; MessageError / CodecError with a reason when it is malformed, stale, too long, or does not
        fit the model."""
        fields = self.up.open(data, max_bytes=self.max_uplink_bytes)
        extra = set(fields) - {"meta", "metrics", *(f"{t.name}.delta" for t in self.tensors),
                               *(t.field for t in self.plain.tensors)}
        if extra:
            raise MessageError(f"unexpected fields {sorted(extra)}")
        n_t, client_id = upload_meta(fields, round_idx, total_samples)
        update, kept = _decode_update(fields, self.tensors, self.size, self.k_up)
        nll = float(upload_metrics(fields, 1)[0])
        return StcUplink(n_t, self.plain.decode(fields), update, kept, nll, client_id=client_id)


# ========================================================================= server
class StcServer(ServerBase[StcUplink]):
    """Server half (Algorithm 2): weighted mean of the ternary updates, its own STC with error feedback on the
    global update, W <- W + S; broadcasts S (round 0: W dense). Every client every round: the config check below
    makes :meth:`ServerBase.select_clients` select them all."""

    name = "stc"

    def __init__(self, cfg: Config, model_factory: Callable[[], nn.Module], total_samples: int) -> None:
        f = cfg.federation
        if f.clients_per_round is not None and f.clients_per_round < f.clients:
            raise ConfigError(
                "config key 'federation.clients_per_round': experiment.algorithm = 'stc' needs every client every "
                "round (leave clients_per_round unset): its downlink is an update of the previous global model, "
                "which a client that skipped a round does not hold (the paper's update caching for partial "
                "participation is not implemented)")
        self.cfg = cfg
        self.model_factory = model_factory
        self.total_samples = int(total_samples)
        model = model_factory()
        self.layers = point_layers(model)
        self.plain = PlainState(model)  # the state outside the Bayesian layers: dense both ways, every round
        self.messages = StcMessages(cfg, self.layers, self.plain)
        self.tensors, self.size, self.k_up = self.messages.tensors, self.messages.size, self.messages.k_up
        self.layouts = self.messages.layouts

    @property
    def weighting(self) -> str:  # type: ignore[override]
        return self.cfg.stc.weighting

    def init(self) -> State:
        model = self.model_factory()
        state: State = {}
        for info, (_, layer) in zip(self.layers, bayesian_layers(model), strict=True):
            theta = _theta(layer)
            state[f"{info.name}.w"] = theta[: info.size - info.n_bias].reshape(info.grid).astype(np.float32)
            state[f"{info.name}.bias"] = theta[info.size - info.n_bias :].astype(np.float32)
        for t in self.tensors:
            state[f"{t.name}.residual"] = np.zeros(t.size, dtype=np.float64)  # the server's error feedback R
            state[f"{t.name}.sent"] = np.zeros(t.size, dtype=np.float32)  # S of the last round, broadcast next
        return state | self.plain.init(model)

    def downlink(self, state: State, round_idx: int) -> bytes:
        return self.messages.encode_downlink(state, round_idx, self.total_samples)

    def evaluation_downlink(self, state: State, round_idx: int) -> bytes:
        """W dense, as round 0's broadcast codes it (a later broadcast is an update of a model the node may not
        hold)."""
        return self.messages.encode_downlink(state, 0, self.total_samples)

    def decode_uplink(self, state: State, data: bytes, round_idx: int | None = None) -> StcUplink:
        return self.messages.decode_uplink(data, round_idx, self.total_samples)

    def bounds(self, state: State, round_idx: int) -> UploadBounds:
        """The weights an update makes within the magnitude of the global model."""
        theta = _flat_state(state, self.layers).astype(np.float64)
        return UploadBounds({"update": Limit(magnitude(theta), theta)}, self.partitions)

    def rows(self, state: State, uploads: list[StcUplink]) -> tuple[list[np.ndarray], None]:
        """Each upload's ternary update, dense."""
        return [u.update for u in uploads], None

    def aggregate(self, state: State, uplinks: list[bytes], round_idx: int, senders: list[int] | None = None
                  ) -> RoundResult:
        t0 = time.perf_counter()
        got = self.receive(state, uplinks, round_idx, senders)
        w, ups = got.p, got.uploads
        if self.robust.plain:
            mean = w @ np.stack([u.update for u in ups])  # sum_i w_i S_i, float64
        else:
            mean = self.robust.combine(self.rows(state, ups)[0], w, refused=len(got.rejected))
        theta = _flat_state(state, self.layers)
        new = self.aggregate_plain(state, got)
        step = np.zeros(self.size, dtype=np.float32)
        kept_down = 0
        for t in self.tensors:
            acc = mean[t.sl] + state[f"{t.name}.residual"]
            idx, negative, mu, residual = stc_compress(acc, self.cfg.stc.p_down, self.cfg.stc.dtype)
            sent = ternary_dense(idx, negative, mu, t.size).astype(np.float32)  # exact: mu is a wire value
            new[f"{t.name}.residual"], new[f"{t.name}.sent"] = residual, sent
            step[t.sl] = sent
            kept_down += idx.size
        theta = theta + step  # float32, as every client computes it (model_digest checks that they do)
        pos = 0
        for info in self.layers:
            n_w = info.size - info.n_bias
            new[f"{info.name}.w"] = theta[pos : pos + n_w].reshape(info.grid)
            new[f"{info.name}.bias"] = theta[pos + n_w : pos + info.size]
            pos += info.size
        weights = [new[f"{i.name}.w"] for i in self.layers]
        metrics = {
            "density": sum(int(np.count_nonzero(x)) for x in weights) / sum(x.size for x in weights),
            "up_density": float(np.mean([u.kept for u in ups])) / self.size,  # entries a client sends / all
            "down_density": kept_down / self.size,
            "train_nll": math.fsum(wi * u.nll for wi, u in zip(w, ups, strict=True)),
            **got.counts(),
            "server_seconds": round(time.perf_counter() - t0, 3),
        }
        return RoundResult(state=new, metrics=metrics, rejected=got.rejected)

    def global_model(self, state: State) -> nn.Module:
        return point_model(self.model_factory, self.layers, state, self.plain)


# ========================================================================= client
@dataclass
class _ModelCopy:
    round: int  # the round whose downlink produced it
    digest: bytes
    theta: np.ndarray  # float32, flat


class StcClient(ClientAlgorithm):
    """Client half (Algorithm 2): rebuild W from the broadcast, train, send STC_{p_up}(update + residual), keep the
    new residual. State: residuals per client id, one model copy per process (module docstring)."""

    keeps_state = True

    name = "stc"

    def __init__(self, cfg: Config, model_factory: Callable[[], nn.Module]) -> None:
        self.cfg = cfg
        self.model = make_deterministic(model_factory())
        self.device = resolve_device(cfg.experiment.device)
        self.layers = point_layers(self.model)
        self.plain = PlainState(self.model)
        self.messages = StcMessages(cfg, self.layers, self.plain)
        self.tensors, self.size = self.messages.tensors, self.messages.size
        self._model: _ModelCopy | None = None
        self._residuals = ClientResiduals(self.size, np.float64)

    # ------------------------------------------------------------- downlink
    def global_weights(self, downlink: bytes, client_id: int) -> tuple[int, np.ndarray]:
        """(round, the global model as a float32 flat vector) from a downlink and the model copy, which it becomes
        (for a node that holds nothing, ``NO_CLIENT``: the copy stays as it is); ClientError when the copy is
        missing or does not match (never trains from wrong weights)."""
        msg = self.messages.decode_downlink(downlink)
        round_idx, mode, digest = msg.round_idx, msg.mode, msg.digest
        have = self._model
        if mode == _MODE_DENSE:
            theta = self.messages.dense_model(msg)
        elif mode == _MODE_UPDATE:
            if have is not None and have.round == round_idx and have.digest == digest:
                return round_idx, have.theta  # this round's broadcast was applied already (a retried round)
            if have is None or have.round != round_idx - 1:
                held = "no copy" if have is None else f"the model of round {have.round}"
                raise ClientError(
                    f"client {client_id}: the downlink of round {round_idx} is an update of the model of round "
                    f"{round_idx - 1}, and this client holds {held} (its state was lost, e.g. a restarted process; "
                    f"STC needs clients that keep their state)")
            theta = have.theta + self.messages.update(msg).astype(np.float32)  # float32, as the server computes it
        else:
            raise MessageError(f"unknown downlink mode {mode}")
        if model_digest(theta) != digest:
            raise ClientError(f"client {client_id}: the model rebuilt from the downlink of round {round_idx} does "
                              f"not match the server's (digest): refusing to train from wrong weights")
        if client_id != NO_CLIENT:  # an evaluation's global model is not the round this client trains from
            self._model = _ModelCopy(round_idx, digest, theta)
        return round_idx, theta

    # ------------------------------------------------------------------ fit
    def receive(self, downlink: bytes, client_id: int) -> nn.Module:
        self._load(downlink, self.global_weights(downlink, client_id)[1])
        return self.model

    def fit(self, downlink: bytes, data: ClientData, client_id: int) -> bytes:
        round_idx, start = self.global_weights(downlink, client_id)
        self._load(downlink, start)
        gen = client_generator(self.cfg.experiment.seed, round_idx, client_id)
        result = train_local(self.model, data, self.cfg.train, gen, device=self.device,
                             lr=round_lr(self.cfg, round_idx))
        local = np.concatenate([_theta(layer) for _, layer in bayesian_layers(self.model)])
        before = self._residuals.entering(client_id, round_idx)
        acc = (local - start.astype(np.float64)) + before
        if not np.all(np.isfinite(acc)):
            raise ClientError(f"client {client_id}: the local update is not finite")
        after = np.empty_like(acc)
        up = self.messages.encode_uplink(round_idx, client_id, len(data), acc, after,
                                         self.plain.encode_model(self.model), result.nll)
        self._residuals.record(client_id, round_idx, before, after)
        return up

    # ------------------------------------------------------------ resume
    def _load(self, downlink: bytes, start: np.ndarray) -> None:
        pos = 0
        for info, (_, layer) in zip(self.layers, bayesian_layers(self.model), strict=True):
            n_w = info.size - info.n_bias
            _load(layer, start[pos : pos + n_w], start[pos + n_w : pos + info.size])
            pos += info.size
        if self.plain or self.plain.fixed:  # the other state comes dense in every downlink
            self.plain.load_fields(self.model, self.messages.down.open(downlink))

    def export_state(self) -> dict[str, np.ndarray]:
        """The private state to checkpoint after a round: the model copy and every client's residual (each
        with the round that made it). Empty when no client of this object has run."""
        out: dict[str, np.ndarray] = {}
        if self._model is not None:
            out["model"] = self._model.theta
            out["model_round"] = np.array([self._model.round], dtype=np.int64)
            out["model_digest"] = np.frombuffer(self._model.digest, dtype=np.uint8).copy()
        return out | self._residuals.export_state()

    def import_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Inverse of :meth:`export_state` (on resume); ValueError when the arrays do not fit this model."""
        self._model = None
        try:
            if "model" in arrays:
                theta = np.asarray(arrays["model"], dtype=np.float32)
                digest = np.asarray(arrays["model_digest"], dtype=np.uint8).tobytes()
                if theta.shape != (self.size,) or len(digest) != DIGEST_BYTES or model_digest(theta) != digest:
                    raise ValueError("the model copy does not fit the model or its digest")
                self._model = _ModelCopy(int(arrays["model_round"][0]), digest, theta.copy())
            self._residuals.import_state(arrays)
        except (KeyError, IndexError, TypeError) as err:
            raise ValueError(f"checkpointed STC client state is incomplete ({err})") from None


def describe(s: StcConfig) -> str:
    return f"STC (p={s.p_up:g} up, {s.p_down:g} down)"


SPEC = AlgorithmSpec("stc", StcConfig, StcServer, StcClient, default_lr=2e-3, label="STC",
                     model_options=sigma_options, describe=describe)
