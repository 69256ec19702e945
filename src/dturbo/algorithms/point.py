"""Shared halves of the point-estimate baselines (FedAvg, FedPAQ, DSSM; REFERENCE.md "Baselines").

The baselines train the same architectures as D-Turbo-VBI as ordinary networks: the Bayesian layers run
deterministically (``stochastic = False``), every weight is trainable, there is no KL term. Per layer the
parameters travel as one vector ``theta = [weight (row-major), bias]``; state outside the Bayesian layers travels
dense in float16, averaged by n_t (:mod:`dturbo.algorithms.plain`).

A subclass decides three things: which clients take part (:meth:`PointServer.select_clients`), how a client
encodes its local result (:meth:`PointClient.encode_theta`, the server's :meth:`PointServer.decode_theta`),
and whether that result is new weights or an update (``semantics``) and how results are weighted.
Download is the dense model in the configured dtype for every baseline.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..codec import decode_dense, encode_dense
from ..config import Config
from ..device import resolve_device
from ..nn.bayes import BayesianLayer, bayesian_layers
from ..prior import grid_shape
from .base import (
    ClientData,
    MessageError,
    RoundResult,
    State,
    client_generator,
    client_weights,
    decode_uplinks,
    fields_dict,
    frame,
    need,
    pack_scalars,
    sample_uniform,
    unpack_scalars,
    upload_samples,
)
from .local import train_local
from .plain import LAYOUT as PLAIN_LAYOUT
from .plain import PlainState


@dataclass(frozen=True)
class PointLayer:
    name: str
    grid: tuple[int, int]
    n_bias: int

    @property
    def size(self) -> int:
        return self.grid[0] * self.grid[1] + self.n_bias


def point_layers(model: nn.Module) -> list[PointLayer]:
    return [PointLayer(n, grid_shape(la), 0 if la.bias is None else int(la.bias.numel()))
            for n, la in bayesian_layers(model)]


def make_deterministic(model: nn.Module) -> nn.Module:
    """The Bayesian network as an ordinary one: mean weights only, sigma frozen and unused."""
    for _, layer in bayesian_layers(model):
        layer.stochastic = False
        layer.sigma_param.requires_grad_(False)
    return model


def _load(layer: BayesianLayer, w: np.ndarray, bias: np.ndarray) -> None:
    with torch.no_grad():
        layer.mask.fill_(1.0)
        layer.weight_mu.copy_(torch.from_numpy(np.asarray(w, dtype=np.float32).reshape(layer.weight_mu.shape)))
        if layer.bias is not None:
            layer.bias.copy_(torch.from_numpy(np.asarray(bias, dtype=np.float32)))


def point_model(model_factory: Callable[[], nn.Module], layers: list[PointLayer], state: State,
                plain: PlainState) -> nn.Module:
    """The deterministic network with the weights and biases of ``state`` (``<layer>.w``, ``<layer>.bias``) and its
    other state (:mod:`~dturbo.algorithms.plain`), in eval mode: the global model of every point-estimate baseline."""
    model = make_deterministic(model_factory())
    for info, (_, layer) in zip(layers, bayesian_layers(model), strict=True):
        _load(layer, state[f"{info.name}.w"], state[f"{info.name}.bias"])
    plain.load_state(model, state)
    return model.eval()


def _theta(layer: BayesianLayer) -> np.ndarray:
    w = layer.weight_mu.detach().double().numpy().reshape(-1)
    b = layer.bias.detach().double().numpy() if layer.bias is not None else np.zeros(0)
    return np.concatenate([w, b])


class PointServer:
    """Server half shared by the baselines: dense download, validated uploads, weighted combination."""

    name = "point"
    semantics = "weights"  # the uploads are new weights ("weights") or updates to add ("update")
    weighting = "samples"  # by n_t ("samples") or a plain mean ("uniform")
    up_layout = "dense"

    def __init__(self, cfg: Config, model_factory: Callable[[], nn.Module], total_samples: int) -> None:
        self.cfg = cfg
        self.configure(cfg)
        self.model_factory = model_factory
        self.total_samples = int(total_samples)
        model = model_factory()
        self.layers = point_layers(model)
        self.plain = PlainState(model)
        self.down_kind, self.up_kind = f"{self.name}/down", f"{self.name}/up"
        self.layouts = {
            self.down_kind: {"meta": "header", "w": "dense", "bias": "dense", **PLAIN_LAYOUT},
            self.up_kind: {"meta": "header", "metrics": "header", "theta": self.up_layout, **PLAIN_LAYOUT},
        }

    def configure(self, cfg: Config) -> None:
        """Set ``semantics`` / ``weighting`` / ``up_layout`` from the config (before the layouts are built)."""

    @property
    def dtype(self) -> str:
        raise NotImplementedError

    def init(self) -> State:
        model = self.model_factory()
        state: State = {}
        for info, (_, layer) in zip(self.layers, bayesian_layers(model), strict=True):
            theta = _theta(layer)
            state[f"{info.name}.w"] = theta[: -info.n_bias or None].reshape(info.grid).astype(np.float32)
            state[f"{info.name}.bias"] = theta[theta.size - info.n_bias :].astype(np.float32)
        return state | self.plain.init(model)

    def select_clients(self, round_idx: int) -> list[int]:
        f = self.cfg.federation
        return sample_uniform(self.cfg.experiment.seed, round_idx, f.clients, f.clients_per_round)

    def downlink(self, state: State, round_idx: int) -> bytes:
        fields = {"meta": pack_scalars([round_idx, self.total_samples])}
        for info in self.layers:
            fields[f"{info.name}.w"] = encode_dense(state[f"{info.name}.w"], dtype=self.dtype)
            fields[f"{info.name}.bias"] = encode_dense(state[f"{info.name}.bias"], dtype=self.dtype)
        return frame(self.down_kind, fields | self.plain.encode_state(state))

    # ---------------------------------------------------------------- uplink
    def decode_theta(self, payload: bytes, info: PointLayer) -> np.ndarray:
        """One layer's theta from its payload; the layout of ``up_layout``."""
        return decode_dense(payload, max_elements=info.size).reshape(-1)

    def decode_uplink(self, data: bytes, round_idx: int | None = None) -> tuple[int, dict[str, np.ndarray], float]:
        """Decode and validate one upload: (n_t, theta per layer name and the other state per field name, nll);
        raises MessageError / CodecError with a reason."""
        bound = sum(8 * i.size + 256 for i in self.layers) + self.plain.max_bytes() + 4096
        fields = fields_dict(data, self.up_kind, max_bytes=bound)
        n_t = upload_samples(fields, round_idx, self.total_samples)
        out = {}
        for info in self.layers:
            theta = self.decode_theta(need(fields, f"{info.name}.theta"), info)
            if theta.shape != (info.size,):
                raise MessageError(f"{info.name}.theta has {theta.size} values, expected {info.size}")
            if not np.all(np.isfinite(theta)):
                raise MessageError(f"{info.name}.theta contains NaN or Inf")
            out[info.name] = theta.astype(np.float64)
        out |= self.plain.decode(fields)
        nll = float(unpack_scalars(need(fields, "metrics"), 1)[0])
        return int(n_t), out, nll

    def aggregate(self, state: State, uplinks: list[bytes], round_idx: int) -> RoundResult:
        t0 = time.perf_counter()
        valid, rejected = decode_uplinks(uplinks, lambda data: self.decode_uplink(data, round_idx))
        p = client_weights([v[0] for v in valid], self.weighting)
        new: State = dict(state) | self.plain.aggregate([v[0] for v in valid], [v[1] for v in valid])
        nonzero = total = 0
        for info in self.layers:
            n = info.name
            combined = np.zeros(info.size)
            for pt, v in zip(p, valid, strict=True):
                combined += pt * v[1][n]
            if self.semantics == "update":
                combined += np.concatenate([state[f"{n}.w"].reshape(-1), state[f"{n}.bias"]]).astype(np.float64)
            w = combined[: info.size - info.n_bias].reshape(info.grid).astype(np.float32)
            new[f"{n}.w"], new[f"{n}.bias"] = w, combined[info.size - info.n_bias :].astype(np.float32)
            nonzero += int(np.count_nonzero(w))
            total += w.size
        metrics = {
            "density": nonzero / total,
            "train_nll": math.fsum(pt * v[2] for pt, v in zip(p, valid, strict=True)),
            "clients_ok": float(len(valid)),
            "clients_rejected": float(len(rejected)),
            "server_seconds": round(time.perf_counter() - t0, 3),
        }
        return RoundResult(state=new, metrics=metrics, rejected=rejected)

    def global_model(self, state: State) -> nn.Module:
        return point_model(self.model_factory, self.layers, state, self.plain)


class PointClient:
    """Client half shared by the baselines: load the dense model, train, encode theta per layer."""

    name = "point"

    def __init__(self, cfg: Config, model_factory: Callable[[], nn.Module]) -> None:
        self.cfg = cfg
        self.model = make_deterministic(model_factory())
        self.layers = point_layers(self.model)
        self.plain = PlainState(self.model)
        self.device = resolve_device(cfg.experiment.device)
        self.down_kind, self.up_kind = f"{self.name}/down", f"{self.name}/up"

    def encode_theta(self, local: np.ndarray, start: np.ndarray, rng: np.random.Generator) -> bytes:
        raise NotImplementedError

    def fit(self, downlink: bytes, data: ClientData, client_id: int) -> bytes:
        fields = fields_dict(downlink, self.down_kind)
        round_idx, _ = (int(v) for v in unpack_scalars(need(fields, "meta"), 2))
        starts = []
        for info, (_, layer) in zip(self.layers, bayesian_layers(self.model), strict=True):
            w = decode_dense(need(fields, f"{info.name}.w"), max_elements=info.size)
            b = decode_dense(need(fields, f"{info.name}.bias"), max_elements=info.size).reshape(-1)
            if w.shape != info.grid or b.size != info.n_bias:
                raise MessageError(f"{info.name}: downlink shapes {w.shape}, {b.shape} do not fit the model")
            _load(layer, w, b)
            starts.append(_theta(layer))
        self.plain.load_fields(self.model, fields)
        gen = client_generator(self.cfg.experiment.seed, round_idx, client_id)
        result = train_local(self.model, data, self.cfg.train, gen, device=self.device)
        rng = np.random.default_rng([self.cfg.experiment.seed, round_idx, client_id, 0x51])
        up = {"meta": pack_scalars([round_idx, client_id, len(data)])}
        for info, (_, layer), start in zip(self.layers, bayesian_layers(self.model), starts, strict=True):
            up[f"{info.name}.theta"] = self.encode_theta(_theta(layer), start, rng)
        up |= self.plain.encode_model(self.model)
        up["metrics"] = pack_scalars([result.nll])
        return frame(self.up_kind, up)


