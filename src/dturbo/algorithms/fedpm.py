"""FedPM (Isik, Pase, Gunduz, Weissman, Zorzi, "Sparse Random Networks for Communication-Efficient Federated
Learning", ICLR 2023; the authors' code is BerivanIsik/sparse-random-networks): train a mask, not the weights.
Only the paper's abstract and contribution list could be read here; the details below follow the authors' code
(``server.py``, ``client.py``, ``models/masked_layers.py``, ``utils/random.py``), named where they decide.

* Weights **and biases** stay frozen at the model's seeded initial values (times ``weight_scale``; the authors
  use a scaled signed-constant init so that a half-kept deep network keeps its signal): the server and every
  client rebuild them from the model factory, so they never travel (paper, contribution 4: the final model is
  "a random seed and a binary mask"). As in the authors' code (``MaskedLinear``/``MaskedConv2d``: ``bias_mask``
  beside ``mask``), biases are masked too.
* Each parameter has a score s; theta = sigmoid(s) is the probability that it is kept. A forward pass of local
  training uses w_init * m with a fresh m ~ Bernoulli(theta) per minibatch and a straight-through estimator: the
  gradient reaches theta as if m = theta (the authors' ``Bern`` autograd function; theirs also multiplies the
  gradient by theta; we pass it straight, the plain straight-through estimator).
* Download: the global probabilities theta_G, on a uniform grid of 2^``down_bits`` levels; a client
  starts its scores at logit(theta_G).
* Upload: one mask m ~ Bernoulli(theta_local) per client, range-coded (:mod:`dturbo.coding.masks`)
  with theta_G as the probability model both ends hold, or with the layer's fraction of ones (the empirical
  entropy the authors' code reports as the bitrate), whichever is shorter (``upload_model``).
* Server, "Bayesian aggregation" (paper, contribution 3): per parameter a Beta(alpha, beta) with the prior
  Beta(lambda0, lambda0); alpha += sum of the received bits, beta += clients - that sum; the prior is reset every
  ``reset_every`` rounds (the authors' code resets every round). theta_G is the posterior mode
  (alpha - 1) / (alpha + beta - 2) (the authors' code) or mean, squeezed into [epsilon, 1 - epsilon] (their code
  counts each received bit as epsilon or 1 - epsilon: with lambda0 = 1 the same numbers).
* Evaluation: the authors evaluate the network with a mask sampled from theta_G; ``eval_mask = "sample"`` draws
  one seeded mask per round (the model one would deploy: seed + mask), ``"threshold"`` keeps theta_G >= 0.5.
  :meth:`FedPmServer.global_model` is the ordinary network with weights w_init * mask, so ``density`` is real.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from pydantic import Field, model_validator
from torch import nn
from torch.nn.utils import parametrize

from ..codec import CodecError, decode_quantized, encode_quantized
from ..coding.masks import decode_mask_payload, encode_mask_payload
from ..config import Config, Section
from ..device import resolve_device
from ..nn.bayes import bayesian_layers
from ..protocol import AlgorithmSpec, ClientAlgorithm
from .base import ClientData, MessageError, RoundResult, State, client_generator, need, pack_scalars, unpack_scalars
from .local import round_lr, train_local
from .message import Layouts, MessageSpec, ledger, upload_metrics
from .plain import PlainState
from .point import PointLayer, _theta, make_deterministic, point_layers, sigma_options
from .server import Received, ServerBase, Upload

# Seed-sequence tags: every random draw is a pure function of (seed, round, client, tag), so resume is exact.
_TAG_SCORES, _TAG_GATES, _TAG_UPLOAD, _TAG_EVAL = 0x5C0, 0x6A7, 0x0B1, 0xE7A
# Scores are logit(theta_G) with theta_G kept this far from 0 and 1 (a wire level of 0 or 1 is finite then).
_LOGIT_CLAMP = 1e-6
# With a robust rule, a mask that costs more bits per parameter under theta_G than the round's median mask by more
# than this is refused: a mask sampled near theta_G costs about its entropy (measured: within 0.13 bits), an inverted
# one 0.5 to 4 bits more (benchmarks/hostile.py).
MASK_SCREEN_BITS = 0.25


# ------------------------------------------------------------------------------------------ shared pieces
def quantize_probs(theta: np.ndarray, bits: int) -> np.ndarray:
    """Levels 0..2^bits - 1 of probabilities on the uniform grid (round to nearest): what the downlink carries."""
    top = (1 << bits) - 1
    return np.rint(np.clip(np.asarray(theta, dtype=np.float64), 0.0, 1.0) * top).astype(np.int32)


def dequantize_probs(levels: np.ndarray, bits: int) -> np.ndarray:
    """float64 probabilities of the levels. Server and clients compute them by this one function, so the range
    coder's model is bit-identical at both ends."""
    return np.asarray(levels, dtype=np.float64) / float((1 << bits) - 1)


def beta_update(alpha: np.ndarray, beta: np.ndarray, masks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Beta-Bernoulli conjugate update (the Bayesian aggregation) with K masks (K, n): alpha + ones, beta +
    zeros, per bit."""
    m = np.asarray(masks, dtype=np.float64).reshape(len(masks), -1)
    ones = m.sum(axis=0)
    return alpha + ones, beta + (m.shape[0] - ones)


def posterior_probs(alpha: np.ndarray, beta: np.ndarray, estimate: str, epsilon: float) -> np.ndarray:
    """theta_G from the posterior: mode (alpha - 1) / (alpha + beta - 2) or mean alpha / (alpha + beta), mapped
    into [epsilon, 1 - epsilon] (the authors' code: received bits count as epsilon / 1 - epsilon)."""
    if estimate == "mode":
        est = (alpha - 1.0) / (alpha + beta - 2.0)
    else:
        est = alpha / (alpha + beta)
    return epsilon + (1.0 - 2.0 * epsilon) * np.clip(est, 0.0, 1.0)


def _entropy_bits(p: np.ndarray) -> float:
    """Mean binary entropy (bits) of the probabilities."""
    q = np.clip(p, 1e-12, 1 - 1e-12)
    return float(np.mean(-(q * np.log2(q) + (1 - q) * np.log2(1 - q))))


class FedPmConfig(Section):
    """FedPM (Isik et al., ICLR 2023): frozen seeded random weights, a trained keep probability per weight and
    bias; clients upload one sampled mask, range-coded; the server's Beta-Bernoulli posterior gives the global
    probabilities it sends down (quantised). The learning rate is [train].lr (the authors use Adam, lr 0.1)."""

    lambda0: float = Field(1.0, gt=0, description="Beta(lambda0, lambda0) prior of every keep probability")
    reset_every: int = Field(1, ge=1, description="reset the posterior to the prior every this many rounds "
                                                  "(1: every round, as the authors' code)")
    estimate: Literal["mode", "mean"] = Field("mode", description="theta_G = posterior mode (authors' code) or mean")
    epsilon: float = Field(0.01, ge=0, lt=0.5, description="theta_G squeezed into [epsilon, 1 - epsilon] (authors' "
                                                            "code: each received bit counts as epsilon / 1 - epsilon)")
    score_init_std: float = Field(1.0, ge=0, description="round-0 scores ~ N(0, std^2), theta = sigmoid(score)")
    weight_scale: float = Field(1.0, gt=0, description="the frozen weights and biases are this times the model's "
                                                       "initial ones (> 1 can help deep models: a half-kept layer "
                                                       "loses signal; the authors scale their init up)")
    down_bits: int = Field(8, ge=2, le=16, description="theta_G sent on a uniform grid of 2^down_bits levels")
    upload_model: Literal["best", "global", "empirical"] = Field(
        "best", description="probability model of the coded mask: theta_G per weight ('global'), one "
                            "Bernoulli(fraction of ones) per layer ('empirical', the cost the authors report), or "
                            "the cheaper of the two per layer ('best')")
    eval_mask: Literal["sample", "threshold"] = Field(
        "sample", description="the global model's mask: one seeded sample from theta_G (authors' code) or "
                              "theta_G >= 0.5")

    @model_validator(mode="after")
    def _mode_needs_lambda(self) -> FedPmConfig:
        if self.estimate == "mode" and self.lambda0 < 1:
            raise ValueError("estimate = 'mode' needs lambda0 >= 1 (the Beta mode is undefined below); use 'mean'")
        return self


class _BernoulliSTE(torch.autograd.Function):
    """m ~ Bernoulli(theta) in the forward pass, dm/dtheta := 1 in the backward pass (straight-through)."""

    @staticmethod
    def forward(ctx: object, theta: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        if generator is not None and generator.device != theta.device:  # a CPU generator, a model on a GPU
            return torch.bernoulli(theta.cpu(), generator=generator).to(theta.device)
        return torch.bernoulli(theta, generator=generator)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Gate(nn.Module):
    """A parametrization of a frozen tensor: x -> x * m, m ~ Bernoulli(sigmoid(score)), one draw per access
    (one per forward pass: the layer reads its weight once)."""

    def __init__(self, shape: torch.Size) -> None:
        super().__init__()
        self.score = nn.Parameter(torch.zeros(shape))
        self.generator: torch.Generator | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * _BernoulliSTE.apply(torch.sigmoid(self.score), self.generator)


def _gen(seed: int, round_idx: int, client_id: int, tag: int) -> torch.Generator:
    ss = np.random.SeedSequence([seed, round_idx, client_id, tag])
    g = torch.Generator()
    g.manual_seed(int(ss.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1)))
    return g


def frozen_model(model_factory: Callable[[], nn.Module], scale: float) -> nn.Module:
    """The network with its frozen parameters: the factory's seeded initial weights and biases times ``scale``,
    as an ordinary (deterministic) network. Server and clients both build it; nothing of it travels."""
    model = make_deterministic(model_factory())
    if scale != 1.0:
        with torch.no_grad():
            for _, layer in bayesian_layers(model):
                layer.weight_mu.mul_(scale)
                if layer.bias is not None:
                    layer.bias.mul_(scale)
    return model


def _decode_down_theta(payload: bytes, info: PointLayer, bits: int) -> np.ndarray:
    levels, n_levels, _ = decode_quantized(payload, max_elements=info.size)
    if n_levels != 1 << bits or levels.shape != (info.size,):
        raise MessageError(f"{info.name}.theta: expected {info.size} levels of {bits} bits, got {levels.size} "
                           f"of {n_levels} levels")
    return dequantize_probs(levels, bits)


# --------------------------------------------------------------------------------------------- messages
@dataclass
class FedPmDownlink:
    round_idx: int
    probs: list[np.ndarray]  # theta_G per layer, as the wire levels decode
    fields: dict[str, bytes]  # for the plain state (PlainState.load_fields)


@dataclass
class FedPmUplink(Upload):
    masks: dict[str, np.ndarray]  # the sampled mask per layer name, uint8
    nll: float  # the client's mean training loss
    size: int  # bytes of the whole upload (bits_per_param_up)


class FedPmMessages:
    """FedPM's two messages, defined once: theta_G down on 2**down_bits levels, one sampled mask per layer up,
    range-coded with theta_G (``upload_model``); specs, encoders, decoders and the uplink bound."""

    def __init__(self, name: str, cfg: Config, layers: list[PointLayer], plain: PlainState) -> None:
        self.cfg, self.layers, self.plain = cfg, layers, plain
        self.bits = cfg.fedpm.down_bits
        self.down = MessageSpec(f"{name}/down", {"meta": "header", "theta": "quantized"})
        self.up = MessageSpec(f"{name}/up", {"meta": "header", "metrics": "header", "mask": "mask"})
        # at most 24 bits per coded bit plus headers: a bound on what an honest client can send
        self.max_uplink_bytes = sum(3 * info.size + 64 for info in layers) + plain.max_bytes() + 4096

    @property
    def layouts(self) -> Layouts:
        return ledger(self.down, self.up)

    def encode_downlink(self, state: State, round_idx: int, total_samples: int) -> bytes:
        fields = {"meta": pack_scalars([round_idx, total_samples])}
        for info in self.layers:
            fields[f"{info.name}.theta"] = encode_quantized(state[f"{info.name}.level"], 1 << self.bits)
        return self.down.frame(fields | self.plain.encode_state(state))

    def decode_downlink(self, data: bytes) -> FedPmDownlink:
        fields = self.down.open(data)
        round_idx, _ = (int(v) for v in unpack_scalars(need(fields, "meta"), 2))
        probs = [_decode_down_theta(need(fields, f"{info.name}.theta"), info, self.bits) for info in self.layers]
        return FedPmDownlink(round_idx, probs, fields)

    def encode_uplink(self, round_idx: int, client_id: int, n_t: int, masks: list[np.ndarray],
                      probs: list[np.ndarray], plain_fields: dict[str, bytes], nll: float) -> bytes:
        up = {"meta": pack_scalars([round_idx, client_id, n_t])}
        for info, mask, theta_g in zip(self.layers, masks, probs, strict=True):
            up[f"{info.name}.mask"] = encode_mask_payload(mask, theta_g, self.cfg.fedpm.upload_model)
        up |= plain_fields
        up["metrics"] = pack_scalars([nll])
        return self.up.frame(up)

    def decode_uplink(self, data: bytes, probs: dict[str, np.ndarray], round_idx: int | None,
                      total_samples: int) -> FedPmUplink:
        """One upload, its masks decoded with theta_G ``probs``; MessageError / CodecError with a reason otherwise
        (wrong kind, stale round, bad n_t, missing layer, malformed or truncated mask)."""
        fields, n_t, client_id = self.up.open_upload(data, round_idx, total_samples, self.max_uplink_bytes)
        masks = {}
        for info in self.layers:
            try:
                masks[info.name] = decode_mask_payload(need(fields, f"{info.name}.mask"), probs[info.name],
                                                       info.size)
            except CodecError as err:
                raise CodecError(f"{info.name}.mask: {err}") from None
        plain = self.plain.decode(fields)
        nll = float(upload_metrics(fields, 1)[0])
        if not math.isfinite(nll):
            raise MessageError(f"non-finite local loss {nll}")
        return FedPmUplink(n_t, plain, masks, nll, len(data), client_id=client_id)


# ----------------------------------------------------------------------------------------------- server
class FedPmServer(ServerBase[FedPmUplink]):
    """Server half: Beta-Bernoulli aggregation of the clients' masks, quantised theta_G down (module docstring)."""

    name = "fedpm"

    def __init__(self, cfg: Config, model_factory: Callable[[], nn.Module], total_samples: int) -> None:
        self.cfg = cfg
        self.model_factory = model_factory
        self.total_samples = int(total_samples)
        model = frozen_model(model_factory, cfg.fedpm.weight_scale)
        self.layers = point_layers(model)
        self.plain = PlainState(model)  # the state outside the Bayesian layers: trained, sent dense both ways
        # the frozen parameters [weight row-major, bias] per layer: only for density; they are never sent
        self.frozen = {info.name: _theta(layer) for info, (_, layer) in zip(self.layers, bayesian_layers(model),
                                                                             strict=True)}
        self.n_params = sum(info.size for info in self.layers)
        self.messages = FedPmMessages(self.name, cfg, self.layers, self.plain)
        self.layouts = self.messages.layouts

    @property
    def bits(self) -> int:
        return self.cfg.fedpm.down_bits

    def negated_payload(self, name: str, payload: bytes, downlink: bytes) -> bytes | None:
        """An upload's mask of field ``name`` inverted, coded again with the keep probabilities of the client's
        ``downlink`` (its coder's model)."""
        layer, suffix = name.rsplit(".", 1)
        if suffix != "mask":
            return None
        probs = self.messages.decode_downlink(downlink).probs
        p = probs[[info.name for info in self.layers].index(layer)]
        bits = decode_mask_payload(payload, p, p.size)
        return encode_mask_payload(1 - bits, p, self.cfg.fedpm.upload_model)

    def _eval_masks(self, probs: dict[str, np.ndarray], rounds_done: int) -> dict[str, np.ndarray]:
        """The global model's mask per layer after ``rounds_done`` rounds (module docstring, Evaluation)."""
        if self.cfg.fedpm.eval_mask == "threshold":
            return {n: (p >= 0.5).astype(np.uint8) for n, p in probs.items()}
        rng = np.random.default_rng([self.cfg.experiment.seed, rounds_done, _TAG_EVAL])
        return {n: (rng.random(p.size) < p).astype(np.uint8) for n, p in probs.items()}

    def init(self) -> State:
        f = self.cfg.fedpm
        rng = np.random.default_rng([self.cfg.experiment.seed, _TAG_SCORES])
        state: State = {}
        probs = {}
        for info in self.layers:
            score = f.score_init_std * rng.standard_normal(info.size)  # the authors' code: randn scores
            level = quantize_probs(1.0 / (1.0 + np.exp(-score)), self.bits)
            probs[info.name] = dequantize_probs(level, self.bits)
            state[f"{info.name}.level"] = level
            state[f"{info.name}.alpha"] = np.full(info.size, f.lambda0)
            state[f"{info.name}.beta"] = np.full(info.size, f.lambda0)
        for n, keep in self._eval_masks(probs, 0).items():
            state[f"{n}.keep"] = keep
        if self.plain:
            state |= self.plain.init(self.model_factory())
        return state

    def probs(self, state: State) -> dict[str, np.ndarray]:
        """theta_G per layer exactly as the clients decode it (the range coder's shared model)."""
        return {info.name: dequantize_probs(state[f"{info.name}.level"], self.bits) for info in self.layers}

    def downlink(self, state: State, round_idx: int) -> bytes:
        return self.messages.encode_downlink(state, round_idx, self.total_samples)

    def decode_uplink(self, state: State, data: bytes, round_idx: int | None = None) -> FedPmUplink:
        """One upload, its masks decoded with this round's theta_G (the range coder's shared model)."""
        return self.messages.decode_uplink(data, self.probs(state), round_idx, self.total_samples)

    def aggregate(self, state: State, uplinks: list[bytes], round_idx: int, senders: list[int] | None = None
                  ) -> RoundResult:
        t0 = time.perf_counter()
        f = self.cfg.fedpm
        got = self.receive(state, uplinks, round_idx, senders)
        ups = got.uploads
        reset = round_idx % f.reset_every == 0
        new = self.aggregate_plain(state, got)
        new_probs = {}
        ones = self._robust_ones(state, got)
        for info in self.layers:
            n = info.name
            a0 = np.full(info.size, f.lambda0) if reset else state[f"{n}.alpha"]
            b0 = np.full(info.size, f.lambda0) if reset else state[f"{n}.beta"]
            if ones is None:
                alpha, beta = beta_update(a0, b0, np.stack([u.masks[n] for u in ups]))
            else:  # the robust mean of the bits, counted for every client that sent
                alpha, beta = a0 + ones[n], b0 + (len(ups) - ones[n])
            level = quantize_probs(posterior_probs(alpha, beta, f.estimate, f.epsilon), self.bits)
            new[f"{n}.alpha"], new[f"{n}.beta"], new[f"{n}.level"] = alpha, beta, level
            new_probs[n] = dequantize_probs(level, self.bits)
        nonzero = total = 0
        for info, (n, keep) in zip(self.layers, self._eval_masks(new_probs, round_idx + 1).items(), strict=True):
            new[f"{n}.keep"] = keep
            w = self.frozen[n][: info.size - info.n_bias] * keep[: info.size - info.n_bias]
            nonzero += int(np.count_nonzero(w))
            total += w.size
        all_p = np.concatenate(list(new_probs.values()))
        metrics = {
            "density": nonzero / total,
            "train_nll": math.fsum(float(w) * u.nll for w, u in zip(got.p, ups, strict=True)),
            **got.counts(),
            # the whole upload, framing included
            "bits_per_param_up": 8.0 * float(np.mean([u.size for u in ups])) / self.n_params,
            "theta_entropy": _entropy_bits(all_p),  # mean H(theta_G): what a mask that follows theta_G costs
            "server_seconds": round(time.perf_counter() - t0, 3),
        }
        return RoundResult(state=new, metrics=metrics, rejected=got.rejected)

    def rows(self, state: State, uploads: list[FedPmUplink]) -> tuple[list[np.ndarray], np.ndarray]:
        """Each upload's masks of every layer as one vector of 0s and 1s, from 0."""
        return ([np.concatenate([u.masks[i.name] for i in self.layers]).astype(np.float64) for u in uploads],
                np.zeros(self.n_params))

    def screen(self, state: State, uploads: list[FedPmUplink]) -> dict[int, str]:
        """``[robust]``'s screens, then the masks far less likely under this round's theta_G than the round's median
        mask (:data:`MASK_SCREEN_BITS`): a flipped or made-up mask, which no bound of one upload can tell."""
        probs = self.probs(state)
        p = np.clip(np.concatenate([probs[i.name] for i in self.layers]), 1e-12, 1 - 1e-12)
        cost = np.array([float(np.mean(-np.log2(np.where(np.concatenate([u.masks[i.name] for i in self.layers]) > 0,
                                                         p, 1 - p)))) for u in uploads])
        median = float(np.median(cost))
        return {k: f"the mask costs {c:.3f} bits per parameter under the global probabilities, {c - median:.3f} more "
                   f"than the round's median (at most {MASK_SCREEN_BITS})"
                for k, c in enumerate(cost) if c - median > MASK_SCREEN_BITS} | super().screen(state, uploads)

    def _robust_ones(self, state: State, got: Received[FedPmUplink]) -> dict[str, np.ndarray] | None:
        """Per layer, the ones of the round's masks as ``[robust]``'s rule counts them (K times its combination of
        the masks, every client alike as in the count); None with the plain mean (the exact count of
        :func:`beta_update`)."""
        if self.robust.plain:
            return None
        ups = got.uploads
        rows, reference = self.rows(state, ups)
        flat = self.robust.combine(rows, np.ones(len(ups)), reference, len(got.rejected))
        sizes = np.cumsum([0] + [info.size for info in self.layers])
        return {info.name: len(ups) * flat[a:b] for info, a, b in zip(self.layers, sizes[:-1], sizes[1:],
                                                                       strict=True)}

    def global_model(self, state: State) -> nn.Module:
        """The ordinary network with weights w_init * mask and biases b_init * mask, in eval mode."""
        model = frozen_model(self.model_factory, self.cfg.fedpm.weight_scale)
        with torch.no_grad():
            for info, (_, layer) in zip(self.layers, bayesian_layers(model), strict=True):
                keep = torch.from_numpy(state[f"{info.name}.keep"].astype(np.float32))
                nw = info.size - info.n_bias
                w_keep = keep[:nw].reshape(layer.weight_mu.shape)
                layer.weight_mu.mul_(w_keep)
                layer.mask.copy_(w_keep)
                if layer.bias is not None:
                    layer.bias.mul_(keep[nw:])
        self.plain.load_state(model, state)
        return model.eval()


# ----------------------------------------------------------------------------------------------- client
class FedPmClient(ClientAlgorithm):
    """Client half: scores from logit(theta_G), local training of the scores through sampled masks, one
    sampled mask uploaded range-coded (module docstring)."""

    name = "fedpm"

    def __init__(self, cfg: Config, model_factory: Callable[[], nn.Module]) -> None:
        self.cfg = cfg
        self.model = frozen_model(model_factory, cfg.fedpm.weight_scale)
        self.device = resolve_device(cfg.experiment.device)
        self.layers = point_layers(self.model)
        self.plain = PlainState(self.model)
        self.messages = FedPmMessages(self.name, cfg, self.layers, self.plain)
        self.gates: list[tuple[_Gate, _Gate | None]] = []
        for _, layer in bayesian_layers(self.model):
            pair: list[_Gate | None] = []
            for pname in ("weight_mu", "bias"):
                tensor = getattr(layer, pname)
                if tensor is None:
                    pair.append(None)
                    continue
                gate = _Gate(tensor.shape)
                # unsafe: skip parametrize's trial forward (it would draw from torch's global RNG)
                parametrize.register_parametrization(layer, pname, gate, unsafe=True)
                layer.parametrizations[pname].original.requires_grad_(False)  # frozen: only scores train
                pair.append(gate)
            self.gates.append((pair[0], pair[1]))  # type: ignore[arg-type]

    def frozen(self) -> dict[str, np.ndarray]:
        """The frozen parameters [weight row-major, bias] per layer as this client holds them (for tests)."""
        out = {}
        for info, (_, layer) in zip(self.layers, bayesian_layers(self.model), strict=True):
            w = layer.parametrizations["weight_mu"].original.detach().double().numpy().reshape(-1)
            b = (layer.parametrizations["bias"].original.detach().double().numpy() if layer.bias is not None
                 else np.zeros(0))
            out[info.name] = np.concatenate([w, b])
        return out

    def _set_scores(self, info: PointLayer, gates: tuple[_Gate, _Gate | None], theta: np.ndarray) -> None:
        p = np.clip(theta, _LOGIT_CLAMP, 1 - _LOGIT_CLAMP)
        score = torch.from_numpy(np.log(p) - np.log1p(-p)).float()
        nw = info.size - info.n_bias
        with torch.no_grad():
            gates[0].score.copy_(score[:nw].reshape(gates[0].score.shape))
            if gates[1] is not None:
                gates[1].score.copy_(score[nw:])

    def fit(self, downlink: bytes, data: ClientData, client_id: int) -> bytes:
        down = self.messages.decode_downlink(downlink)
        round_idx, probs = down.round_idx, down.probs
        seed = self.cfg.experiment.seed
        for info, gates, theta in zip(self.layers, self.gates, probs, strict=True):
            self._set_scores(info, gates, theta)
        self.plain.load_fields(self.model, down.fields)
        mask_gen = _gen(seed, round_idx, client_id, _TAG_GATES)
        for gates in self.gates:
            for gate in gates:
                if gate is not None:
                    gate.generator = mask_gen
        result = train_local(self.model, data, self.cfg.train, client_generator(seed, round_idx, client_id),
                             device=self.device, lr=round_lr(self.cfg, round_idx))
        rng = np.random.default_rng([seed, round_idx, client_id, _TAG_UPLOAD])
        masks = []
        for info, gates in zip(self.layers, self.gates, strict=True):
            scores = [g.score.detach().double().reshape(-1) for g in gates if g is not None]
            theta_local = torch.sigmoid(torch.cat(scores)).numpy()
            # the one sample sent (the authors' code: n_samples = 1)
            masks.append((rng.random(info.size) < theta_local).astype(np.uint8))
        return self.messages.encode_uplink(round_idx, client_id, len(data), masks, probs,
                                           self.plain.encode_model(self.model), result.nll)


# FedPM trains scores, not weights, at its authors' 0.1.
SPEC = AlgorithmSpec("fedpm", FedPmConfig, FedPmServer, FedPmClient,
                     default_lr=0.1, label="FedPM", model_options=sigma_options)
