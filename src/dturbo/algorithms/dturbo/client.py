"""D-Turbo-VBI's client half: decode the downlink, train (E6) on the support, upload mu on the support."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from ...config import Config
from ...device import resolve_device
from ...nn.bayes import SAMPLINGS, bayesian_layers
from ...protocol import ClientAlgorithm, MessageError
from ..base import ClientData, client_generator
from ..feedback import ClientResiduals
from ..held import ClientSupports
from ..local import round_lr, train_local
from ..plain import PlainState
from .layers import layer_infos, load_layer, rebuilt_prior_std, sigma_grid_on
from .messages import (
    DturboDownlink,
    DturboMessages,
    DturboUplink,
    UpLayer,
    sigma_as_sent,
)
from .prior import resolve_prior


class DturboClient(ClientAlgorithm):
    """Client half: decode the downlink, train (E6) on the support, upload mu on the support.

    With ``transmission.positions = "delta"`` the client keeps, per client id (one object serves every client in
    process), the supports of the last two downlinks it decoded, by round: the server codes a downlink against the
    support of the last round it knows the client decoded (its upload was valid), and a round run again (a retry,
    or a resumed run whose client had decoded the round before the stop) must still find that one after the client
    decoded the round's own; with ``down_mu = "update"`` also the weights each of them left it holding (the next
    update is coded from them). With ``up_quantizer = "sign"`` it keeps each client's residual: what its last upload
    rounded off, on every layer's grid (0 off the support it sent), which the next upload adds to its update on the
    support it sends (:mod:`dturbo.algorithms.feedback`). :meth:`export_state` / :meth:`import_state` carry them
    through a checkpoint, and the Flower ClientApp keeps them in the node's state."""

    keeps_state = True

    def __init__(self, cfg: Config, model_factory: Callable[[], nn.Module]) -> None:
        self.cfg = cfg
        self.model_factory = model_factory
        self.model = model_factory()
        self.layers = layer_infos(self.model, cfg)
        self.plain = PlainState(self.model)
        self.messages = DturboMessages(cfg, self.model, self.layers, self.plain)
        self.device = resolve_device(cfg.experiment.device)
        self.supports = ClientSupports([info.name for info in self.layers], [info.grid for info in self.layers])
        self._weights: dict[int, dict[int, list[np.ndarray]]] = {}  # down_mu = "update": id -> round -> weights
        self._offsets = np.cumsum([0, *(int(np.prod(info.grid)) for info in self.layers)])
        self._residuals = ClientResiduals(int(self._offsets[-1]), np.float32)

    def receive(self, downlink: bytes, client_id: int) -> nn.Module:
        self._load(self._decode(downlink, client_id))
        return self.model

    def use_server_priors(self, scales: list[float]) -> None:
        """Each layer's prior rebuilt on the server's s_l; the client and its message coder share the list of layer
        infos, which changes in place."""
        if len(scales) != len(self.layers):
            raise MessageError(f"{len(scales)} prior scales for a model of {len(self.layers)} Bayesian layers")
        priors = self.cfg.dturbo.prior
        self.layers[:] = [dataclasses.replace(info, prior=resolve_prior(getattr(priors, info.kind), scale,
                                                                        info.normalised))
                          for info, scale in zip(self.layers, scales, strict=True)]

    def fit(self, downlink: bytes, data: ClientData, client_id: int) -> bytes:
        down = self._decode(downlink, client_id)
        if self.messages.delta:
            self._keep(client_id, down.round_idx, [d.support for d in down.layers],
                       self._held_after(down) if self.messages.update else None)
        round_idx = down.round_idx
        model = self.model
        layers = bayesian_layers(model)
        starts = self._load(down)
        gen = client_generator(self.cfg.experiment.seed, round_idx, client_id)
        sampling = SAMPLINGS[self.cfg.dturbo.sampling]
        for _, layer in layers:
            layer.generator, layer.sampling = gen, sampling
        beta = self.cfg.dturbo.beta
        total = down.total_samples

        def penalty() -> torch.Tensor:
            # E6: beta * KL / n with n the *global* sample count.
            return beta * torch.stack([layer.kl() for _, layer in layers]).sum() / total

        result = train_local(model, data, self.cfg.train, gen, penalty, device=self.device,
                             lr=round_lr(self.cfg, round_idx))
        before = self._residuals.entering(client_id, round_idx) if self.messages.up_values.feedback else None
        up: dict[str, UpLayer] = {}
        for i, (info, (_, layer), d, start) in enumerate(zip(self.layers, layers, down.layers, starts, strict=True)):
            mask = d.support
            mu = layer.weight_mu.detach().double().numpy().reshape(info.grid)
            # a quantised upload: the update from the weights received (the server adds it to its own mu_G)
            sent = mu[mask] - start[mask] if self.messages.up_values.sends_update else mu[mask]
            if before is not None:  # what the last upload rounded off, where this one sends
                sent = sent + self._on_grid(before, i)[mask]
            bias = layer.bias.detach().numpy() if layer.bias is not None else np.zeros(0, np.float32)
            if self.messages.bias_up and layer.bias is not None:  # the update from the biases received
                bias = bias.astype(np.float64) - d.bias.astype(np.float32)
            up[info.name] = UpLayer(sent, sigma_as_sent(layer.sigma.detach().numpy(), mask), bias)
        msg = DturboUplink(len(data), {}, up, result.nll, result.penalty)
        rng = np.random.default_rng([self.cfg.experiment.seed, round_idx, client_id, 0x0B])
        received: dict[str, np.ndarray] | None = {} if before is not None else None
        upload = self.messages.encode_uplink(round_idx, client_id, msg, self.plain.encode_model(model), rng, received)
        if before is not None and received is not None:
            after = np.zeros(self._residuals.size, dtype=np.float32)
            for i, (info, d) in enumerate(zip(self.layers, down.layers, strict=True)):
                self._on_grid(after, i)[d.support] = up[info.name].mu - received[info.name]
            self._residuals.record(client_id, round_idx, before, after)
        return upload

    def _on_grid(self, flat: np.ndarray, i: int) -> np.ndarray:
        """Layer ``i``'s part of a flat vector over every layer's grid, as its grid (a view)."""
        return flat[self._offsets[i]:self._offsets[i + 1]].reshape(self.layers[i].grid)

    def _decode(self, downlink: bytes, client_id: int) -> DturboDownlink:
        """The downlink, decoded against the supports (and weights) ``client_id`` holds."""
        return self.messages.decode_downlink(downlink, self.supports.held.get(client_id), self._weights.get(client_id))

    def _load(self, down: DturboDownlink) -> list[np.ndarray]:
        """Put a decoded downlink into the client's model; the weights training starts from, per layer."""
        starts = []
        for info, (_, layer), d in zip(self.layers, bayesian_layers(self.model), down.layers, strict=True):
            ps = np.ones(info.grid)
            if d.prior_std is not None:
                ps[d.support] = d.prior_std
            else:
                ps[d.support] = rebuilt_prior_std(info, d.mu, sigma_grid_on(d.sigma, d.support),
                                                  self.cfg.dturbo.gamma_update)[d.support]
            load_layer(layer, d.mu, d.support, d.sigma, d.bias if layer.bias is not None else None, ps)
            starts.append(layer.weight_mu.detach().double().numpy().reshape(info.grid))  # what training starts from
        self.plain.load_values(self.model, down.plain)
        return starts

    def _held_after(self, down: DturboDownlink) -> list[np.ndarray]:
        """``down_mu = "update"``: the weights a downlink leaves the client holding (``HeldWeights``: every layer's
        grid, then with ``biases = "as_mu"`` every layer's biases)."""
        held = [d.mu.astype(np.float32) for d in down.layers]
        if self.messages.bias_down:
            held += [d.bias.astype(np.float32) for d in down.layers]
        return held

    # -------------------------------------------------- the supports held (positions = "delta")
    def _keep(self, client_id: int, round_idx: int, supports: list[np.ndarray],
              weights: list[np.ndarray] | None) -> None:
        """Hold the supports (and weights) just decoded, and of the others only the newest (class docstring: why
        two); the weights follow the rounds whose supports are held."""
        self.supports.keep(client_id, round_idx, supports)
        if weights is not None:
            mine = self._weights.get(client_id, {}) | {round_idx: weights}
            self._weights[client_id] = {r: mine[r] for r in self.supports.held[client_id] if r in mine}

    def export_state(self) -> dict[str, np.ndarray]:
        """The supports every client holds (packed bits), with ``down_mu = "update"`` the weights and with
        ``up_quantizer = "sign"`` the residuals, for the checkpoint; empty with ``positions = "full"`` and neither."""
        out = self.supports.export_state() | self._residuals.export_state()
        if self.messages.update:
            for cid, mine in sorted(self.supports.held.items()):
                for slot, r in enumerate(sorted(mine)):
                    for key, w in zip(self._held_keys(slot, cid), self._weights[cid][r], strict=True):
                        out[key] = w.reshape(-1)
        return out

    def _held_keys(self, slot: int, cid: int) -> list[str]:
        """The checkpoint's keys of the weights client ``cid`` holds in ``slot`` (``HeldWeights``' order)."""
        return [f"{n}.{kind}{slot}/{cid}" for n, kind, _ in self.messages.held_entries()]

    def import_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Inverse of :meth:`export_state` (on resume, or a Flower node's saved state); ValueError when the arrays
        do not fit this model."""
        self.supports.import_state(arrays)
        self._residuals.import_state(arrays)
        self._weights = {}
        if not self.messages.update:
            return
        try:
            shapes = [shape for _, _, shape in self.messages.held_entries()]
            for cid, mine in self.supports.held.items():
                self._weights[cid] = {r: [self._weights_at(arrays, key, shape, cid)
                                          for key, shape in zip(self._held_keys(slot, cid), shapes, strict=True)]
                                      for slot, r in enumerate(sorted(mine))}
        except KeyError as err:
            raise ValueError(f"checkpointed D-Turbo-VBI client state is incomplete ({err})") from None

    @staticmethod
    def _weights_at(arrays: dict[str, np.ndarray], key: str, shape: tuple[int, ...], cid: int) -> np.ndarray:
        w = np.asarray(arrays[key])
        size = int(np.prod(shape))
        if w.dtype != np.float32 or w.shape != (size,):
            name = key.split("/", 1)[0].rstrip("0123456789")
            raise ValueError(f"the weights {name} held by client {cid} are {w.dtype} {w.shape}, the model needs "
                             f"float32 ({size},)")
        return w.reshape(shape)
