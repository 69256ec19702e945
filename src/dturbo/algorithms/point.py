"""Shared halves of the point-estimate baselines (FedAvg, FedPAQ, DSSM; REFERENCE.md "Baselines").

The baselines train the same architectures as D-Turbo-VBI as ordinary networks: the Bayesian layers run
deterministically (``stochastic = False``), every weight is trainable, there is no KL term. Per layer the
parameters travel as one vector ``theta = [weight (row-major), bias]``; state outside the Bayesian layers travels
dense in float16, averaged by n_t (:mod:`dturbo.algorithms.plain`).

A baseline decides three things: which clients take part (:meth:`PointServer.select_clients`), how a client's
local result travels (its :class:`PointMessages`: ``encode_theta`` / ``decode_theta`` and the layout, in one
class that both halves use), and whether that result is new weights or an update (``semantics``) and how results
are weighted. Download is the dense model in the configured dtype for every baseline.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ..codec import decode_dense, encode_dense
from ..config import Config
from ..device import resolve_device
from ..nn.bayes import BayesianLayer, bayesian_layers
from ..nn.shapes import grid_shape
from ..protocol import ClientAlgorithm
from .base import ClientData, MessageError, RoundResult, State, client_generator, need, pack_scalars, unpack_scalars
from .bounds import Limit, UploadBounds, magnitude
from .local import round_lr, train_local
from .message import Layouts, MessageSpec, finite, ledger, upload_metrics
from .plain import PlainState
from .server import Received, ServerBase, Upload


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


@dataclass
class PointDownlink:
    round_idx: int
    weights: list[tuple[np.ndarray, np.ndarray]]  # (w on the grid, bias) per layer
    plain: dict[str, np.ndarray]


@dataclass
class PointUplink(Upload):
    theta: dict[str, np.ndarray]  # per layer name: [weight (row-major), bias], float64; weights or an update
    nll: float  # the client's mean training loss

    def vectors(self) -> dict[str, np.ndarray]:
        return {f"{name}.theta": theta for name, theta in self.theta.items()}


class PointMessages:
    """A baseline's two messages, defined once: the dense download in ``dtype``, the upload of one theta per layer
    in ``up_layout`` (a baseline overrides :meth:`encode_theta` / :meth:`decode_theta` and these two)."""

    up_layout = "dense"

    def __init__(self, name: str, cfg: Config, layers: list[PointLayer], plain: PlainState) -> None:
        self.cfg, self.layers, self.plain = cfg, layers, plain
        self.down = MessageSpec(f"{name}/down", {"meta": "header", "w": "dense", "bias": "dense"})
        self.up = MessageSpec(f"{name}/up", {"meta": "header", "metrics": "header", "theta": self.up_layout})
        self.max_uplink_bytes = sum(8 * i.size + 256 for i in layers) + plain.max_bytes() + 4096

    @property
    def layouts(self) -> Layouts:
        return ledger(self.down, self.up)

    @property
    def dtype(self) -> str:
        raise NotImplementedError

    def encode_theta(self, local: np.ndarray, start: np.ndarray, rng: np.random.Generator) -> bytes:
        """One layer's upload from its trained theta ``local`` and the ``start`` it was trained from."""
        raise NotImplementedError

    def decode_theta(self, payload: bytes, info: PointLayer) -> np.ndarray:
        """One layer's theta from its payload; the layout of ``up_layout``."""
        return decode_dense(payload, max_elements=info.size).reshape(-1)

    def encode_downlink(self, state: State, round_idx: int, total_samples: int) -> bytes:
        fields = {"meta": pack_scalars([round_idx, total_samples])}
        for info in self.layers:
            fields[f"{info.name}.w"] = encode_dense(state[f"{info.name}.w"], dtype=self.dtype)
            fields[f"{info.name}.bias"] = encode_dense(state[f"{info.name}.bias"], dtype=self.dtype)
        return self.down.frame(fields | self.plain.encode_state(state))

    def decode_downlink(self, data: bytes) -> PointDownlink:
        fields = self.down.open(data)
        round_idx, _ = (int(v) for v in unpack_scalars(need(fields, "meta"), 2))
        weights = []
        for info in self.layers:
            w = decode_dense(need(fields, f"{info.name}.w"), max_elements=info.size)
            b = decode_dense(need(fields, f"{info.name}.bias"), max_elements=info.size).reshape(-1)
            if w.shape != info.grid or b.size != info.n_bias:
                raise MessageError(f"{info.name}: downlink shapes {w.shape}, {b.shape} do not fit the model")
            weights.append((w, b))
        return PointDownlink(round_idx, weights, self.plain.decode(fields))

    def encode_uplink(self, round_idx: int, client_id: int, n_t: int, thetas: list[tuple[np.ndarray, np.ndarray]],
                      plain_fields: dict[str, bytes], nll: float, rng: np.random.Generator) -> bytes:
        """An upload from each layer's (trained theta, start) and the plain state already encoded."""
        up = {"meta": pack_scalars([round_idx, client_id, n_t])}
        for info, (local, start) in zip(self.layers, thetas, strict=True):
            up[f"{info.name}.theta"] = self.encode_theta(local, start, rng)
        up |= plain_fields
        up["metrics"] = pack_scalars([nll])
        return self.up.frame(up)

    def decode_uplink(self, data: bytes, round_idx: int | None, total_samples: int) -> PointUplink:
        """Decode and validate one upload; raises MessageError / CodecError with a reason."""
        fields, n_t, client_id = self.up.open_upload(data, round_idx, total_samples, self.max_uplink_bytes)
        out = {}
        for info in self.layers:
            theta = self.decode_theta(need(fields, f"{info.name}.theta"), info)
            if theta.shape != (info.size,):
                raise MessageError(f"{info.name}.theta has {theta.size} values, expected {info.size}")
            out[info.name] = finite(f"{info.name}.theta", theta).astype(np.float64)
        plain = self.plain.decode(fields)
        nll = float(upload_metrics(fields, 1)[0])
        return PointUplink(n_t, plain, out, nll, client_id=client_id)


class PointServer(ServerBase[PointUplink]):
    """Server half shared by the baselines: dense download, validated uploads, weighted combination."""

    name = "point"
    semantics = "weights"  # the uploads are new weights ("weights") or updates to add ("update")
    messages_type: type[PointMessages] = PointMessages

    def __init__(self, cfg: Config, model_factory: Callable[[], nn.Module], total_samples: int) -> None:
        self.cfg = cfg
        self.configure(cfg)
        self.model_factory = model_factory
        self.total_samples = int(total_samples)
        model = model_factory()
        self.layers = point_layers(model)
        self.plain = PlainState(model)
        self.messages = self.messages_type(self.name, cfg, self.layers, self.plain)
        self.layouts = self.messages.layouts

    def configure(self, cfg: Config) -> None:
        """Set ``semantics`` / ``weighting`` from the config."""

    def init(self) -> State:
        model = self.model_factory()
        state: State = {}
        for info, (_, layer) in zip(self.layers, bayesian_layers(model), strict=True):
            theta = _theta(layer)
            state[f"{info.name}.w"] = theta[: -info.n_bias or None].reshape(info.grid).astype(np.float32)
            state[f"{info.name}.bias"] = theta[theta.size - info.n_bias :].astype(np.float32)
        return state | self.plain.init(model)

    def downlink(self, state: State, round_idx: int) -> bytes:
        return self.messages.encode_downlink(state, round_idx, self.total_samples)

    def decode_uplink(self, state: State, data: bytes, round_idx: int | None = None) -> PointUplink:
        return self.messages.decode_uplink(data, round_idx, self.total_samples)

    def global_theta(self, state: State, info: PointLayer) -> np.ndarray:
        """A layer's global [weight (row-major), bias], float64."""
        return np.concatenate([state[f"{info.name}.w"].reshape(-1), state[f"{info.name}.bias"]]).astype(np.float64)

    def bounds(self, state: State, round_idx: int) -> UploadBounds:
        """Each layer's theta (or, for updates, the weights it makes) within the magnitude of the global layer."""
        limits = {}
        for info in self.layers:
            theta = self.global_theta(state, info)
            limits[f"{info.name}.theta"] = Limit(magnitude(theta), theta if self.semantics == "update" else None)
        return UploadBounds(limits, self.partitions)

    def rows(self, state: State, uploads: list[PointUplink]) -> tuple[list[np.ndarray], np.ndarray | None]:
        """Each upload's theta of every layer as one vector, and the global weights (None for updates: from 0)."""
        reference = None
        if self.semantics == "weights":
            reference = np.concatenate([self.global_theta(state, info) for info in self.layers])
        return [np.concatenate([u.theta[i.name] for i in self.layers]) for u in uploads], reference

    def _combined(self, state: State, got: Received[PointUplink]) -> dict[str, np.ndarray]:
        """Each layer's combination of the uploads' theta: the weighted mean, or ``[robust]``'s rule on the whole
        vectors (the update's reference: the global weights, or 0 for updates)."""
        p, ups = got.p, got.uploads
        if self.robust.plain:
            out = {}
            for info in self.layers:
                combined = np.zeros(info.size)
                for pt, u in zip(p, ups, strict=True):
                    combined += pt * u.theta[info.name]
                out[info.name] = combined
            return out
        rows, reference = self.rows(state, ups)
        flat = self.robust.combine(rows, p, reference, len(got.rejected))
        sizes = np.cumsum([0] + [info.size for info in self.layers])
        return {info.name: flat[a:b] for info, a, b in zip(self.layers, sizes[:-1], sizes[1:], strict=True)}

    def aggregate(self, state: State, uplinks: list[bytes], round_idx: int, senders: list[int] | None = None
                  ) -> RoundResult:
        t0 = time.perf_counter()
        got = self.receive(state, uplinks, round_idx, senders)
        p, ups = got.p, got.uploads
        new = self.aggregate_plain(state, got)
        nonzero = total = 0
        combination = self._combined(state, got)
        for info in self.layers:
            n = info.name
            combined = combination[n]
            if self.semantics == "update":
                combined += np.concatenate([state[f"{n}.w"].reshape(-1), state[f"{n}.bias"]]).astype(np.float64)
            w = combined[: info.size - info.n_bias].reshape(info.grid).astype(np.float32)
            new[f"{n}.w"], new[f"{n}.bias"] = w, combined[info.size - info.n_bias :].astype(np.float32)
            nonzero += int(np.count_nonzero(w))
            total += w.size
        metrics = {
            "density": nonzero / total,
            "train_nll": math.fsum(pt * u.nll for pt, u in zip(p, ups, strict=True)),
            **got.counts(),
            "server_seconds": round(time.perf_counter() - t0, 3),
        }
        return RoundResult(state=new, metrics=metrics, rejected=got.rejected)

    def global_model(self, state: State) -> nn.Module:
        return point_model(self.model_factory, self.layers, state, self.plain)


class PointClient(ClientAlgorithm):
    """Client half shared by the baselines: load the dense model, train, encode theta per layer."""

    name = "point"
    messages_type: type[PointMessages] = PointMessages

    def __init__(self, cfg: Config, model_factory: Callable[[], nn.Module]) -> None:
        self.cfg = cfg
        self.model = make_deterministic(model_factory())
        self.layers = point_layers(self.model)
        self.plain = PlainState(self.model)
        self.messages = self.messages_type(self.name, cfg, self.layers, self.plain)
        self.device = resolve_device(cfg.experiment.device)

    def _load(self, down: PointDownlink) -> list[np.ndarray]:
        """Put a decoded downlink into the client's model; the parameters training starts from, per layer."""
        starts = []
        for (w, b), (_, layer) in zip(down.weights, bayesian_layers(self.model), strict=True):
            _load(layer, w, b)
            starts.append(_theta(layer))
        self.plain.load_values(self.model, down.plain)
        return starts

    def receive(self, downlink: bytes, client_id: int) -> nn.Module:
        self._load(self.messages.decode_downlink(downlink))
        return self.model

    def fit(self, downlink: bytes, data: ClientData, client_id: int) -> bytes:
        down = self.messages.decode_downlink(downlink)
        round_idx = down.round_idx
        starts = self._load(down)
        gen = client_generator(self.cfg.experiment.seed, round_idx, client_id)
        result = train_local(self.model, data, self.cfg.train, gen, device=self.device,
                             lr=round_lr(self.cfg, round_idx))
        rng = np.random.default_rng([self.cfg.experiment.seed, round_idx, client_id, 0x51])
        thetas = [(_theta(layer), start) for (_, layer), start in zip(bayesian_layers(self.model), starts, strict=True)]
        return self.messages.encode_uplink(round_idx, client_id, len(data), thetas, self.plain.encode_model(self.model),
                                           result.nll, rng)


def sigma_options(cfg: Config) -> dict[str, Any]:
    """``AlgorithmSpec.model_options`` of the baselines: the Bayesian layers' sigma as ``[dturbo]`` sets it. A
    baseline never trains sigma, but its saved model holds it: built as D-Turbo-VBI's, a model has the same shape and
    values whichever method trained it."""
    return {"sigma_mode": cfg.dturbo.sigma_mode, "sigma_init_ratio": cfg.dturbo.sigma_init_ratio}
