"""FedDST, federated dynamic sparse training (Bibikar, Vikalo, Wang, Chen, "Federated Dynamic Sparse Training:
Computing Less, Communicating Less, Yet Learning Better", AAAI 2022; REFERENCE.md).

One global mask at a fixed density D (``[feddst] density``, the paper's 1 - S) over the weights of the Bayesian
layers, spread over the layers by the Erdos-Renyi-kernel rule (``distribution = "erk"``: a layer's density is
proportional to the sum of its weight tensor's dimensions over their product, capped at 1) or alike
(``"uniform"``); the initial mask keeps each layer's largest initial weights. Biases are dense. A round:

* server -> client: the weights on the global mask (``dtype``), the biases, and the mask's positions when the client
  does not hold it (as the flips since the one it holds, or whole: :mod:`dturbo.algorithms.held`);
* client: trains the masked network (weights off the mask stay exactly 0). In a readjustment round (rounds 1,
  1 + R, 1 + 2R, ... with R = ``readjust_every``, while the ratio is above 0) it removes, per layer, the
  n = floor(alpha_t * k) active weights of smallest magnitude (k: the layer's mask size) and regrows n inactive
  ones where the gradient of the loss on one minibatch is largest, at 0, so its mask keeps k weights;
  alpha_t = alpha / 2 * (1 + cos(pi * t / T_end)) with alpha = ``readjust_ratio``, 0 from round T_end =
  ``readjust_until`` (the paper's annealing; its reference code applies alpha twice, alpha^2 / 2 * (1 + cos)).
  ``readjust_at`` is the fraction of its local steps a client trains before readjusting (1: after its local
  training, as the reference code; below 1 the regrown weights train in the same round);
* client -> server: the weights on its mask in the mask's row-major order, the biases, and after a readjustment its
  mask as the flips from the round's global mask;
* server: per weight, the n_t-weighted mean over the clients whose mask holds it; the union of the clients' masks;
  when that holds more than k weights in a layer, the k of largest mean magnitude stay (aggregation by magnitude).
  A round without readjustment changes no mask.

The final model is sparse (unstructured): export times it like D-Turbo-VBI's. State outside the Bayesian layers
travels dense, as with every algorithm (:mod:`dturbo.algorithms.plain`).

Server state: per layer ``name.w`` (float32, 0 off the mask), ``name.mask`` (uint8) and ``name.bias``; the supports
each client holds (:class:`~dturbo.algorithms.held.HeldSupports`); the plain state. Client state: the supports each
client id holds (:class:`~dturbo.algorithms.held.ClientSupports`), checkpointed through
:meth:`FedDstClient.export_state`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from ..codec import (
    CodecError,
    decode_dense,
    decode_support_delta,
    decode_values,
    encode_dense,
    encode_support,
    encode_support_delta,
    encode_values,
)
from ..config import Config, Probability, Section
from ..device import resolve_device
from ..nn.bayes import BayesianLayer, bayesian_layers
from ..nn.shapes import erk_densities
from ..protocol import AlgorithmSpec, ClientAlgorithm
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
)
from .bounds import Limit, UploadBounds, magnitude
from .held import NO_BASE, ClientSupports, HeldSupports
from .local import LocalResult, num_local_steps, round_lr, train_local
from .message import Layouts, MessageSpec, finite, ledger, upload_metrics
from .plain import PlainState
from .point import PointLayer, make_deterministic, point_layers, point_model, sigma_options
from .server import Received, ServerBase, Upload

DOWN_KIND, UP_KIND = "feddst/down", "feddst/up"


# ================================================================================== the masks
def layer_counts(shapes: Sequence[tuple[int, ...]], density: float, distribution: str) -> list[int]:
    """Weights each layer keeps for a global ``density``: alike (``uniform``), or by the Erdos-Renyi-kernel rule
    (``erk``, :func:`dturbo.nn.shapes.erk_densities`)."""
    sizes = np.array([math.prod(s) for s in shapes], dtype=np.float64)
    if distribution == "uniform":
        d = np.full(sizes.size, density)
    else:
        d = erk_densities(list(shapes), sizes, density)
    return [int(k) for k in np.clip(np.round(d * sizes), 1, sizes)]


def top_k(score: np.ndarray, k: int, among: np.ndarray | None = None) -> np.ndarray:
    """Boolean mask of the k largest ``score`` entries (among ``among`` when given); ties: the lower index."""
    flat = np.asarray(score, dtype=np.float64).reshape(-1)
    cand = np.arange(flat.size) if among is None else np.flatnonzero(np.asarray(among).reshape(-1))
    k = min(int(k), cand.size)
    out = np.zeros(flat.size, dtype=bool)
    if k > 0:
        order = np.argsort(-flat[cand], kind="stable")  # stable: equal scores keep index order
        out[cand[order[:k]]] = True
    return out.reshape(np.shape(score))


def readjust_ratio(cfg: Config, round_idx: int) -> float:
    """alpha_t of round ``round_idx``: 0 unless it is a readjustment round (module docstring)."""
    f = cfg.feddst
    until = f.readjust_until if f.readjust_until is not None else cfg.experiment.rounds // 2
    if round_idx < 1 or (round_idx - 1) % f.readjust_every or round_idx >= until:
        return 0.0
    return f.readjust_ratio / 2.0 * (1.0 + math.cos(math.pi * round_idx / until))


def readjusted(mask: np.ndarray, weights: np.ndarray, grad: np.ndarray, alpha: float) -> np.ndarray:
    """One client's new mask of a layer: the n = floor(alpha * k) active weights of smallest |w| out, n inactive
    ones of largest |grad| in (the ones just removed may come back), so k stay."""
    mask = np.asarray(mask, dtype=bool)
    k = int(mask.sum())
    n = int(math.floor(alpha * k))
    if n == 0:
        return mask.copy()
    keep = top_k(np.abs(weights), k - n, among=mask)
    return keep | top_k(np.abs(grad), n, among=~keep)


# ================================================================================== messages
class FedDstConfig(Section):
    """FedDST (Bibikar et al., AAAI 2022, dturbo.algorithms.feddst): one global mask at ``density``, trained sparse;
    every ``readjust_every`` rounds each client removes a ratio of its smallest active weights and regrows as many by
    gradient magnitude, and the server aggregates the masks by magnitude at the same density."""

    density: Probability = Field(0.2, gt=0, le=1, description="fraction of the weights in the global mask (the "
                                                               "paper's 1 - S)")
    distribution: Literal["erk", "uniform"] = Field("erk", description=(
        "how the density spreads over the layers: Erdos-Renyi-kernel (a layer's density proportional to the sum of "
        "its weight's dimensions over their product) or the same in every layer"))
    readjust_ratio: Probability = Field(0.05, ge=0, lt=1, description=(
        "alpha: a readjustment moves floor(alpha_t * k) weights of a layer's k, alpha_t = alpha / 2 * "
        "(1 + cos(pi t / readjust_until))"))
    readjust_every: int = Field(3, ge=1, description="rounds between readjustments (the first in round 1)")
    readjust_until: int | None = Field(None, ge=1, description="the round from which no readjustment happens; "
                                                                "unset: half the rounds")
    readjust_at: float = Field(1.0, gt=0, le=1, description=(
        "fraction of a readjusting client's local steps trained before it readjusts: 1, after its local training "
        "(the reference code); below 1 the regrown weights train in the same round"))
    dtype: Literal["float16", "float32"] = Field("float16", description="the weights' and biases' values, both ways")
    weighting: Literal["samples", "uniform"] = Field("samples", description="client weights by n_t, or alike")


@dataclass
class DstDownlink:
    round_idx: int
    alpha: float
    masks: list[np.ndarray]
    weights: list[np.ndarray]  # per layer, on the grid (0 off the mask)
    biases: list[np.ndarray]
    plain: dict[str, np.ndarray]


@dataclass
class DstUplink(Upload):
    masks: list[np.ndarray]
    weights: list[np.ndarray]  # float64 grids, 0 off the client's mask
    biases: list[np.ndarray]
    nll: float
    names: list[str]  # the layers', in order

    def vectors(self) -> dict[str, np.ndarray]:
        out = {f"{n}.w": w for n, w in zip(self.names, self.weights, strict=True)}
        return out | {f"{n}.bias": b for n, b in zip(self.names, self.biases, strict=True)}


class FedDstMessages:
    """FedDST's two messages, defined once (module docstring): specs, encoders, decoders, the upload bound."""

    def __init__(self, cfg: Config, layers: list[PointLayer], plain: PlainState) -> None:
        self.cfg, self.layers, self.plain = cfg, layers, plain
        self.down = MessageSpec(DOWN_KIND, {"meta": "header", "w": "values", "bias": "dense",
                                            "support": "support_delta"})
        self.up = MessageSpec(UP_KIND, {"meta": "header", "metrics": "header", "w": "values", "bias": "dense",
                                        "support": "support_delta"})
        # every value in float32, a bitmap of every weight, headers
        self.max_uplink_bytes = sum(4 * i.size + i.size // 8 + 256 for i in layers) + plain.max_bytes() + 4096

    @property
    def layouts(self) -> Layouts:
        return ledger(self.down, self.up)

    def _values(self, w: np.ndarray, mask: np.ndarray) -> bytes:
        return encode_values(np.asarray(w, dtype=np.float64)[mask], dtype=self.cfg.feddst.dtype)

    def _read_values(self, fields: dict[str, bytes], info: PointLayer, mask: np.ndarray) -> np.ndarray:
        v = finite(f"{info.name}.w", decode_values(need(fields, f"{info.name}.w"), max_elements=int(mask.size)))
        if v.size != int(mask.sum()):
            raise MessageError(f"{info.name}.w has {v.size} values, its mask holds {int(mask.sum())}")
        out = np.zeros(info.grid, dtype=np.float64)
        out[mask] = v
        return out

    def _read_bias(self, fields: dict[str, bytes], info: PointLayer) -> np.ndarray:
        b = decode_dense(need(fields, f"{info.name}.bias"), max_elements=max(info.n_bias, 1)).reshape(-1)
        if b.size != info.n_bias:
            raise MessageError(f"{info.name}.bias has {b.size} values, the layer has {info.n_bias}")
        return finite(f"{info.name}.bias", b).astype(np.float64)

    def encode_downlinks(self, state: State, round_idx: int, total_samples: int, alpha: float,
                         bases: dict[int, tuple[int, list[np.ndarray] | None]]) -> dict[int, bytes]:
        """Each client's downlink; ``bases[cid]`` = (the round whose supports it holds, those supports or None)."""
        masks = [state[f"{i.name}.mask"].astype(bool) for i in self.layers]
        common = {}
        for info, mask in zip(self.layers, masks, strict=True):
            common[f"{info.name}.w"] = self._values(state[f"{info.name}.w"], mask)
            common[f"{info.name}.bias"] = encode_dense(state[f"{info.name}.bias"], dtype=self.cfg.feddst.dtype)
        common |= self.plain.encode_state(state)
        full = [encode_support(m) for m in masks]  # once a round, whatever the bases
        out: dict[int, bytes] = {}
        for cid, (base, held) in bases.items():
            fields = {"meta": pack_scalars([round_idx, total_samples, alpha, base])}
            for info, mask, whole, h in zip(self.layers, masks, full, held or [None] * len(masks), strict=True):
                if h is None or not np.array_equal(h, mask):
                    fields[f"{info.name}.support"] = encode_support_delta(mask, h, full=whole)
            out[cid] = self.down.frame(fields | common)
        return out

    def decode_downlink(self, data: bytes, held: Callable[[int], list[np.ndarray] | None]) -> DstDownlink:
        """A downlink; ``held(round)`` gives the supports the client holds from that round's downlink (None: none).
        ClientError when the downlink needs supports the client does not hold."""
        fields = self.down.open(data)
        round_idx, _, alpha, base = unpack_scalars(need(fields, "meta"), 4)
        round_idx, base = int(round_idx), int(base)
        mine = held(base) if base != NO_BASE else None
        masks, weights, biases = [], [], []
        for i, info in enumerate(self.layers):
            payload = fields.get(f"{info.name}.support")
            try:
                if payload is None:
                    if mine is None:
                        raise ValueError("no support sent and none held")
                    mask = mine[i]
                else:
                    mask = decode_support_delta(payload, mine[i] if mine is not None else None,
                                                max_elements=int(np.prod(info.grid)))
            except ValueError as err:
                if isinstance(err, CodecError):
                    raise
                raise ClientError(f"the downlink of round {round_idx} needs the support of round {base}, which "
                                  f"this client does not hold ({err})") from None
            if mask.shape != info.grid:
                raise MessageError(f"{info.name}: the support is {mask.shape}, the layer's grid {info.grid}")
            masks.append(mask)
            weights.append(self._read_values(fields, info, mask))
            biases.append(self._read_bias(fields, info))
        return DstDownlink(round_idx, float(alpha), masks, weights, biases, self.plain.decode(fields))

    def encode_uplink(self, round_idx: int, client_id: int, n_t: int, global_masks: list[np.ndarray],
                      masks: list[np.ndarray], weights: list[np.ndarray], biases: list[np.ndarray],
                      plain_fields: dict[str, bytes], nll: float) -> bytes:
        up = {"meta": pack_scalars([round_idx, client_id, n_t])}
        for info, g, m, w, b in zip(self.layers, global_masks, masks, weights, biases, strict=True):
            up[f"{info.name}.w"] = self._values(w, m)
            up[f"{info.name}.bias"] = encode_dense(b, dtype=self.cfg.feddst.dtype)
            if not np.array_equal(g, m):  # a readjusted mask: its flips from the round's global mask
                up[f"{info.name}.support"] = encode_support_delta(m, g)
        up |= plain_fields
        up["metrics"] = pack_scalars([nll])
        return self.up.frame(up)

    def decode_uplink(self, data: bytes, round_idx: int | None, total_samples: int, global_masks: list[np.ndarray],
                      alpha: float) -> DstUplink:
        """One upload, checked against the round's global masks: a mask that moves in a round without
        readjustment, moves more than floor(alpha * k) weights in, or changes a layer's count is refused."""
        fields, n_t, client_id = self.up.open_upload(data, round_idx, total_samples, self.max_uplink_bytes)
        masks, weights, biases = [], [], []
        for info, g in zip(self.layers, global_masks, strict=True):
            payload = fields.get(f"{info.name}.support")
            mask = g
            if payload is not None:
                if alpha <= 0:
                    raise MessageError(f"{info.name}: a readjusted mask in a round without readjustment")
                mask = decode_support_delta(payload, g, max_elements=int(g.size))
                k = int(g.sum())
                if int(mask.sum()) != k:
                    raise MessageError(f"{info.name}: the client's mask holds {int(mask.sum())} weights, not {k}")
                grown = int((mask & ~g).sum())
                if grown > math.floor(alpha * k):
                    raise MessageError(f"{info.name}: {grown} weights regrown, at most {math.floor(alpha * k)} "
                                       f"this round")
            masks.append(mask)
            weights.append(self._read_values(fields, info, mask))
            biases.append(self._read_bias(fields, info))
        nll = float(upload_metrics(fields, 1)[0])
        return DstUplink(n_t, self.plain.decode(fields), masks, weights, biases, nll,
                         [info.name for info in self.layers], client_id=client_id)


# ==================================================================================== server
class FedDstServer(ServerBase[DstUplink]):
    """Server half: per-weight means over the clients that hold the weight, the masks aggregated by magnitude."""

    name = "feddst"

    def __init__(self, cfg: Config, model_factory: Callable[[], nn.Module], total_samples: int) -> None:
        self.cfg = cfg
        self.model_factory = model_factory
        self.total_samples = int(total_samples)
        model = model_factory()
        self.layers = point_layers(model)
        self.plain = PlainState(model)
        self.messages = FedDstMessages(cfg, self.layers, self.plain)
        self.layouts = self.messages.layouts
        shapes = [tuple(layer.weight_mu.shape) for _, layer in bayesian_layers(model)]
        self.counts = layer_counts(shapes, cfg.feddst.density, cfg.feddst.distribution)
        self.held = HeldSupports([i.name for i in self.layers], [i.grid for i in self.layers], cfg.federation.clients)

    @property
    def weighting(self) -> str:  # type: ignore[override]
        return self.cfg.feddst.weighting

    def masks(self, state: State) -> list[np.ndarray]:
        return [state[f"{i.name}.mask"].astype(bool) for i in self.layers]

    def init(self) -> State:
        """The initial model with each layer's k largest initial weights kept (the global mask)."""
        model = self.model_factory()
        state: State = {}
        for info, k, (_, layer) in zip(self.layers, self.counts, bayesian_layers(model), strict=True):
            w = layer.weight_mu.detach().double().numpy().reshape(info.grid)
            mask = top_k(np.abs(w), k)
            state[f"{info.name}.w"] = np.where(mask, w, 0.0).astype(np.float32)
            state[f"{info.name}.mask"] = mask.astype(np.uint8)
            bias = layer.bias.detach().numpy() if layer.bias is not None else np.zeros(0)
            state[f"{info.name}.bias"] = bias.astype(np.float32)
        return state | self.held.init() | self.plain.init(model)

    def downlink(self, state: State, round_idx: int) -> bytes:
        """The downlink of a client that holds no support."""
        return self.downlinks_for(state, round_idx, {0: (NO_BASE, None)})[0]

    def downlinks(self, state: State, round_idx: int, clients: list[int]) -> dict[int, bytes]:
        return self.downlinks_for(state, round_idx, {c: (self.held.base(state, c), self.held.supports(state, c))
                                                     for c in clients})

    def downlinks_for(self, state: State, round_idx: int,
                      bases: dict[int, tuple[int, list[np.ndarray] | None]]) -> dict[int, bytes]:
        return self.messages.encode_downlinks(state, round_idx, self.total_samples,
                                              readjust_ratio(self.cfg, round_idx), bases)

    def decode_uplink(self, state: State, data: bytes, round_idx: int | None = None) -> DstUplink:
        alpha = readjust_ratio(self.cfg, round_idx) if round_idx is not None else 1.0
        return self.messages.decode_uplink(data, round_idx, self.total_samples, self.masks(state), alpha)

    def bounds(self, state: State, round_idx: int) -> UploadBounds:
        """Each layer's weights and biases within the magnitude of the global layer."""
        limits = {}
        for info in self.layers:
            largest = magnitude(state[f"{info.name}.w"], state[f"{info.name}.bias"])
            limits[f"{info.name}.w"] = limits[f"{info.name}.bias"] = Limit(largest)
        return UploadBounds(limits, self.partitions)

    def rows(self, state: State, uploads: list[DstUplink]) -> tuple[list[np.ndarray], np.ndarray]:
        """Each upload's weights and biases, layer by layer, as one vector (a weight the client does not hold: 0), and
        the global ones."""
        rows = [np.concatenate([x.reshape(-1) for li in range(len(self.layers)) for x in (u.weights[li], u.biases[li])])
                for u in uploads]
        reference = np.concatenate([state[f"{i.name}.{k}"].reshape(-1).astype(np.float64) for i in self.layers
                                    for k in ("w", "bias")])
        return rows, reference

    def _robust_layers(self, state: State, got: Received[DstUplink]) -> list[tuple[np.ndarray, np.ndarray]] | None:
        """Per layer, ``[robust]``'s combination of the clients' (weights, bias), a weight a client does not hold
        counting as 0 for it; None with the plain mean."""
        if self.robust.plain:
            return None
        rows, reference = self.rows(state, got.uploads)
        flat = self.robust.combine(rows, got.p, reference, len(got.rejected))
        out, pos = [], 0
        for info in self.layers:
            n_w = info.grid[0] * info.grid[1]
            out.append((flat[pos:pos + n_w].reshape(info.grid), flat[pos + n_w:pos + n_w + info.n_bias]))
            pos += n_w + info.n_bias
        return out

    def aggregate(self, state: State, uplinks: list[bytes], round_idx: int, senders: list[int] | None = None
                  ) -> RoundResult:
        t0 = time.perf_counter()
        got = self.receive(state, uplinks, round_idx, senders)
        p, ups = got.p, got.uploads
        before = self.masks(state)
        new = self.aggregate_plain(state, got)
        new |= self.held.after_round(state, round_idx, self.select_clients(round_idx), [u.client_id for u in ups],
                                     before)
        robust = self._robust_layers(state, got)
        kept = flips = total = 0
        for li, (info, k, old) in enumerate(zip(self.layers, self.counts, before, strict=True)):
            den = sum(pt * u.masks[li].astype(np.float64) for pt, u in zip(p, ups, strict=True))
            if robust is None:
                num = sum(pt * u.weights[li] for pt, u in zip(p, ups, strict=True))
                mean = np.divide(num, den, out=np.zeros(info.grid), where=den > 0)
                bias = sum(pt * u.biases[li] for pt, u in zip(p, ups, strict=True))
            else:
                mean, bias = np.where(den > 0, robust[li][0], 0.0), robust[li][1]
            union = den > 0
            mask = top_k(np.abs(mean), k, among=union) if int(union.sum()) > k else union
            new[f"{info.name}.w"] = np.where(mask, mean, 0.0).astype(np.float32)
            new[f"{info.name}.mask"] = mask.astype(np.uint8)
            new[f"{info.name}.bias"] = np.asarray(bias).astype(np.float32)
            kept += int(mask.sum())
            flips += int((mask != old).sum())
            total += mask.size
        metrics = {
            "density": kept / total,
            "mask_flips": float(flips),
            "readjust_ratio": readjust_ratio(self.cfg, round_idx),
            "train_nll": math.fsum(pt * u.nll for pt, u in zip(p, ups, strict=True)),
            **got.counts(),
            "server_seconds": round(time.perf_counter() - t0, 3),
        }
        return RoundResult(state=new, metrics=metrics, rejected=got.rejected)

    def global_model(self, state: State) -> nn.Module:
        return point_model(self.model_factory, self.layers, state, self.plain)


# ==================================================================================== client
def _load(layer: BayesianLayer, w: np.ndarray, mask: np.ndarray, bias: np.ndarray) -> None:
    with torch.no_grad():
        shape = layer.weight_mu.shape
        layer.mask.copy_(torch.from_numpy(mask.reshape(shape).astype(np.float32)))
        layer.weight_mu.copy_(torch.from_numpy(np.where(mask, w, 0.0).reshape(shape).astype(np.float32)))
        if layer.bias is not None:
            layer.bias.copy_(torch.from_numpy(bias.astype(np.float32)))


def _weights(layer: BayesianLayer) -> np.ndarray:
    return (layer.weight_mu * layer.mask).detach().double().numpy()


def _dense_gradients(model: nn.Module, data: ClientData, batch_size: int, gen: torch.Generator,
                     device: torch.device) -> list[np.ndarray]:
    """The loss gradient of every Bayesian layer's weights, inactive ones included, on one minibatch drawn with
    ``gen`` (the network in eval mode: no BatchNorm statistics move)."""
    layers = [layer for _, layer in bayesian_layers(model)]
    masks = [layer.mask.clone() for layer in layers]
    idx = torch.randperm(len(data), generator=gen)[: min(batch_size, len(data))]
    model.to(device).eval()
    try:
        with torch.no_grad():
            for layer in layers:  # every weight in the graph; the inactive ones are 0, so the function is the same
                layer.weight_mu.mul_(layer.mask)
                layer.mask.fill_(1.0)
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(data.x[idx].to(device)), data.y[idx].to(device)).backward()
        return [layer.weight_mu.grad.detach().double().cpu().numpy() for layer in layers]
    finally:
        with torch.no_grad():
            for layer, m in zip(layers, masks, strict=True):
                layer.mask.copy_(m)
        model.zero_grad(set_to_none=True)
        model.to("cpu")


class FedDstClient(ClientAlgorithm):
    """Client half: train the masked network, readjust the mask in readjustment rounds, upload the weights on it."""

    keeps_state = True

    name = "feddst"

    def __init__(self, cfg: Config, model_factory: Callable[[], nn.Module]) -> None:
        self.cfg = cfg
        self.model = make_deterministic(model_factory())
        self.layers = point_layers(self.model)
        self.plain = PlainState(self.model)
        self.messages = FedDstMessages(cfg, self.layers, self.plain)
        self.device = resolve_device(cfg.experiment.device)
        self.supports = ClientSupports([i.name for i in self.layers], [i.grid for i in self.layers])

    def receive(self, downlink: bytes, client_id: int) -> nn.Module:
        self._load(self.messages.decode_downlink(downlink, lambda r: self.supports.get(client_id, r)))
        return self.model

    def fit(self, downlink: bytes, data: ClientData, client_id: int) -> bytes:
        down = self.messages.decode_downlink(downlink, lambda r: self.supports.get(client_id, r))
        self.supports.keep(client_id, down.round_idx, down.masks)
        layers = [layer for _, layer in bayesian_layers(self.model)]
        self._load(down)
        gen = client_generator(self.cfg.experiment.seed, down.round_idx, client_id)
        lr = round_lr(self.cfg, down.round_idx)
        steps = num_local_steps(self.cfg.train, len(data))
        if down.alpha > 0:  # readjust after ``readjust_at`` of the local steps, then train the rest
            first = max(1, round(self.cfg.feddst.readjust_at * steps))
            results = [self._train(data, gen, lr, first)]
            grads = _dense_gradients(self.model, data, self.cfg.train.batch_size, gen, self.device)
            for info, layer, g in zip(self.layers, layers, grads, strict=True):
                m = readjusted(layer.mask.numpy().astype(bool).reshape(info.grid), _weights(layer).reshape(info.grid),
                               g.reshape(info.grid), down.alpha)
                with torch.no_grad():
                    layer.mask.copy_(torch.from_numpy(m.astype(np.float32)).reshape(layer.mask.shape))
                    layer.weight_mu.mul_(layer.mask)  # the regrown start at 0, the removed are 0
            if steps > first:
                results.append(self._train(data, gen, lr, steps - first))
        else:
            results = [self._train(data, gen, lr, steps)]
        nll = sum(r.nll * r.steps for r in results) / sum(r.steps for r in results)
        # on each layer's grid (a convolution's weights are 4-D)
        masks = [layer.mask.numpy().astype(bool).reshape(info.grid) for info, layer in zip(self.layers, layers,
                                                                                            strict=True)]
        weights = [_weights(layer).reshape(info.grid) for info, layer in zip(self.layers, layers, strict=True)]
        biases = [layer.bias.detach().double().numpy() if layer.bias is not None else np.zeros(0) for layer in layers]
        return self.messages.encode_uplink(down.round_idx, client_id, len(data), down.masks, masks, weights, biases,
                                           self.plain.encode_model(self.model), nll)

    def _load(self, down: DstDownlink) -> None:
        for (_, layer), w, m, b in zip(bayesian_layers(self.model), down.weights, down.masks, down.biases,
                                       strict=True):
            _load(layer, w, m, b)
        self.plain.load_values(self.model, down.plain)

    def _train(self, data: ClientData, gen: torch.Generator, lr: float, steps: int) -> LocalResult:
        train = self.cfg.train.model_copy(update={"local_steps": steps})
        return train_local(self.model, data, train, gen, device=self.device, lr=lr)

    def export_state(self) -> dict[str, np.ndarray]:
        """The supports every client id holds, for the checkpoint."""
        return self.supports.export_state()

    def import_state(self, arrays: dict[str, np.ndarray]) -> None:
        self.supports.import_state(arrays)


def describe(f: FedDstConfig) -> str:
    return f"FedDST ({f.density:.0%} of the weights)"

SPEC = AlgorithmSpec("feddst", FedDstConfig, FedDstServer, FedDstClient,
                     default_lr=2e-3, label="FedDST", model_options=sigma_options,
                     describe=describe)
