"""D-Turbo-VBI's two messages, each defined once (docs/algorithm.md §7.1, §9; docs/communication.md).

:class:`DturboMessages` holds the :class:`~dturbo.algorithms.message.MessageSpec` of the downlink and the uplink
(which fields, booked by the ledger how) for the configured ``[dturbo.transmission]``, and is the only code that
writes or reads their bytes: the server and the client hand it typed records (:class:`DturboDownlink`,
:class:`DturboUplink`) and get records back. The uplink's size bound lives here too.

* down: per layer, mu_G cluster-coded on its grid (its nonzeros are S), or with ``down_bits`` < 16 S's positions
  then mu_G on S on 2**bits levels (stochastic rounding); sigma_G; sigma_prior on S (E5) unless ``prior_std =
  "rebuilt"``; the biases (in float16; with ``biases = "as_mu"`` as mu travels, in their own field). With
  ``positions = "delta"`` S always travels apart (then mu_G on S, quantised or float16) and each client's downlink
  codes it against the support that client holds, named by the round of the downlink it came in (``meta``'s third
  scalar, -1: none): the positions that flipped, or S whole where that is smaller
  (:func:`dturbo.codec.encode_support_delta`; docs/communication.md, "Positions").
  With ``down_mu = "update"`` (which needs positions = "delta") mu_G travels as the update from the weights R the
  client holds from that same downlink (0 where it holds none), quantised: the client holds R' = R + the decoded
  update on S afterwards (float32, 0 off S), and the server, which knows R, codes the next update from R', so one
  downlink's rounding error is sent again in the next (:meth:`DturboMessages.encode_update`); with ``biases =
  "as_mu"`` the biases travel the same way, from the biases the client holds.
* up: per layer, mu on S in float16 (canonical row-major order, no positions), or with ``up_bits`` < 16 the update
  from the weights received on 2**bits levels (with ``up_quantizer = "sign"``: the signs, times the mean magnitude,
  of the update plus what the client's last upload rounded off, on S); sigma on S; the biases (with ``biases =
  "as_mu"`` and ``up_bits`` < 16 the update from the biases received, on the same levels); then n_t and the
  training figures.
* ``values_code = "range"``: every quantised mu (down and up) is range-coded, layout ``coded`` instead of
  ``quantized`` (:mod:`dturbo.coding.values`): the same symbols, so the same values on both sides, in fewer bits.

sigma travels as one float32 for a layer with one sigma (it costs nothing), else as its values on S in float16.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from torch import nn

from ...codec import (
    decode_dense,
    decode_grid,
    decode_quantized,
    decode_support,
    decode_support_delta,
    decode_values,
    encode_dense,
    encode_grid,
    encode_quantized,
    encode_support,
    encode_support_delta,
    encode_values,
    support_delta_needs_base,
)
from ...config import Config
from ...nn.bayes import bayesian_layers
from ..base import MessageError, need, pack_scalars, unpack_scalars
from ..message import Layouts, MessageSpec, finite, ledger, upload_metrics
from ..plain import PlainState
from ..server import Upload
from .turbo import LayerInfo
from .values import Float16, scheme

DOWN_KIND, UP_KIND = "dturbo/down", "dturbo/up"
LOG8_LEVELS = 256
NO_BASE = -1  # positions = "delta": the base round of a downlink whose supports all travel whole

# positions = "delta": the supports a client holds, by the round of the downlink they came in (one grid per layer)
HeldSupports = Mapping[int, list[np.ndarray]]
# down_mu = "update": the weights a client holds (float32 grids, 0 off the support), by the round of their downlink;
# with biases = "as_mu" each layer's biases (float32) follow the grids of every layer
HeldWeights = Mapping[int, list[np.ndarray]]


def updated_weights(held: np.ndarray, support: np.ndarray, step: np.ndarray) -> np.ndarray:
    """The weights a client holds after a downlink with ``down_mu = "update"``: ``held`` + the decoded ``step`` on
    ``support`` (row-major), 0 off it, in float32; the server and the client compute it alike, bit for bit."""
    out = np.zeros(support.shape, dtype=np.float32)
    out[support] = (held[support].astype(np.float64) + step).astype(np.float32)
    return out


def encode_prior_std(values: np.ndarray, dtype: str) -> bytes:
    """sigma_prior on S (E5) for the downlink: float16 / float32 values, or ``log8``: 8-bit levels uniform in
    log(sigma_prior) between the vector's min and max (two float32 parameters), a relative error of at most
    (log max - log min) / 510 -- §9's "documented cheaper quantisation"; a prior scale needs no more."""
    if dtype != "log8":
        return encode_values(values.astype(np.float32), dtype=dtype)
    logs = np.log(np.asarray(values, dtype=np.float64).reshape(-1))
    lo, hi = (float(logs.min()), float(logs.max())) if logs.size else (0.0, 0.0)
    lo, hi = float(np.float32(lo)), float(np.float32(hi))  # the receiver sees the float32 parameters
    span = hi - lo
    sym = np.zeros(logs.size, np.int64) if span <= 0 else np.rint((logs - lo) / span * (LOG8_LEVELS - 1))
    return encode_quantized(np.clip(sym, 0, LOG8_LEVELS - 1).astype(np.int64), LOG8_LEVELS, [lo, hi])


def decode_prior_std(payload: bytes, dtype: str, count: int) -> np.ndarray:
    """Inverse of :func:`encode_prior_std`; ``count`` values are expected."""
    if dtype != "log8":
        out = decode_values(payload, max_elements=count)
    else:
        sym, levels, params = decode_quantized(payload, max_elements=count)
        if levels != LOG8_LEVELS or params.shape != (2,) or not np.all(np.isfinite(params)):
            raise MessageError("prior_std: expected 256 log levels and a finite range")
        lo, hi = (float(v) for v in params)
        out = np.exp(lo + sym.astype(np.float64) / (LOG8_LEVELS - 1) * (hi - lo))
    if out.shape != (count,):
        raise MessageError(f"prior_std has {out.size} values, the support has {count}")
    return out


def sigma_as_sent(sigma: np.ndarray, support: np.ndarray) -> np.ndarray:
    """A layer's sigma as it travels: its one value, or its values on the support (row-major)."""
    if sigma.size == 1:
        return sigma.reshape(1)
    return sigma.reshape(support.shape)[support]


# ------------------------------------------------------------------------------------------------ records
@dataclass
class DownLayer:
    """One layer of the downlink. ``mu``: mu_G on the grid, 0 off S; ``support``: S (the client reads it from mu's
    nonzeros, or from the positions when ``down_bits`` < 16); ``sigma``: sigma_G as sent (:func:`sigma_as_sent`);
    ``prior_std``: sigma_prior on S (E5), None when the client rebuilds it; ``bias``."""

    mu: np.ndarray
    support: np.ndarray
    sigma: np.ndarray
    prior_std: np.ndarray | None
    bias: np.ndarray


@dataclass
class DturboDownlink:
    round_idx: int
    total_samples: int  # n, the global sample count of E6's KL weight
    layers: list[DownLayer]
    plain: dict[str, np.ndarray]
    base_round: int = NO_BASE  # positions = "delta": the round whose support the flips are against


@dataclass
class UpLayer:
    """One layer of an upload: ``mu`` on S (or, with ``up_bits`` < 16, the update from the weights received),
    ``sigma`` as sent (:func:`sigma_as_sent`), ``bias`` (with ``biases = "as_mu"`` and ``up_bits`` < 16, the update
    from the biases received)."""

    mu: np.ndarray
    sigma: np.ndarray
    bias: np.ndarray


@dataclass
class DturboUplink(Upload):
    layers: dict[str, UpLayer]
    nll: float  # the client's mean training loss
    penalty: float  # its last KL penalty of E6

    def vectors(self) -> dict[str, np.ndarray]:
        return {f"{n}.{key}": getattr(layer, key) for n, layer in self.layers.items()
                for key in ("mu", "sigma", "bias")}

    def losses(self) -> dict[str, float]:
        return {"nll": self.nll, "penalty": self.penalty}


# ------------------------------------------------------------------------------------------------ the spec
class DturboMessages:
    """D-Turbo-VBI's downlink and uplink for one model and ``[dturbo.transmission]`` (module docstring)."""

    def __init__(self, cfg: Config, model: nn.Module, layers: list[LayerInfo], plain: PlainState,
                 settled_after: int | None = None) -> None:
        self.cfg = cfg
        # the 0-based round whose support first has the target density (the server's schedule): the downlinks of
        # later rounds are coded by down_values.at(True); a receiver needs no schedule
        self.settled_after = settled_after
        self.tr = cfg.dturbo.transmission
        self.layers = layers
        self.plain = plain
        bayes = [layer for _, layer in bayesian_layers(model)]
        self.scalar_sigma = [layer.sigma.numel() == 1 for layer in bayes]
        self.n_bias = [0 if layer.bias is None else int(layer.bias.numel()) for layer in bayes]
        self.delta = self.tr.positions == "delta"
        self.update = self.tr.down_mu == "update"
        coded = self.tr.values_code == "range"
        self.up_values = scheme(self.tr.up_bits, coded, self.tr.up_quantizer)
        # signs take one bit whatever down_bits, which sets the levels of a downlink to a client that holds nothing
        self.down_values = scheme(self.tr.down_bits, coded, self.tr.down_quantizer, self.tr.down_share,
                                  self.tr.down_rounding == "nearest")
        # down_mu = "update": a client that holds no weights gets them on the max levels (nothing sends the clipped
        # part again to a client that drops out)
        self.down_first = scheme(self.tr.down_bits, coded)
        # biases = "as_mu": the biases on mu's quantised scheme in each direction (float16 where mu is float16)
        as_mu = self.tr.biases == "as_mu"
        self.bias_up = as_mu and not isinstance(self.up_values, Float16)
        self.bias_down = as_mu and not isinstance(self.down_values, Float16)
        # mu_G cluster-coded on its grid, S its nonzeros; else S travels apart, then mu_G on S
        self.grid = isinstance(self.down_values, Float16) and not self.delta
        down = {"meta": "header", "sigma": "values",
                "bias": self.down_values.layout if self.bias_down else "dense"}
        if self.grid:
            down["mu"] = "grid"
        else:
            down["support"] = "support_delta" if self.delta else "support"
            down["mu"] = self.down_values.layout
        if self.tr.prior_std == "sent":
            down["prior_std"] = "quantized" if cfg.dturbo.prior_std_dtype == "log8" else "values"
        up = {"meta": "header", "mu": self.up_values.layout, "sigma": "values",
              "bias": self.up_values.layout if self.bias_up else "dense", "metrics": "header"}
        self.down, self.up = MessageSpec(DOWN_KIND, down), MessageSpec(UP_KIND, up)
        # The uplink's size bound: 4x the float16 bytes of every grid and the float32 bytes of every bias.
        grids = sum(int(np.prod(i.grid)) * 2 + nb * 4 for i, nb in zip(layers, self.n_bias, strict=True))
        self.max_uplink_bytes = 4 * grids + 64 * len(layers) + plain.max_bytes() + 4096

    @property
    def layouts(self) -> Layouts:
        return ledger(self.down, self.up)

    # ------------------------------------------------------------- downlink
    def encode_downlink(self, msg: DturboDownlink, plain_fields: dict[str, bytes]) -> bytes:
        """The server's downlink; mu_G on S is quantised with a generator seeded by the round (down_bits < 16).
        With ``positions = "delta"``: the downlink of a client that holds no support (every S whole)."""
        if self.delta:
            return self.encode_downlinks(msg, plain_fields, {0: NO_BASE}, {})[0]
        rng = np.random.default_rng([self.cfg.experiment.seed, msg.round_idx, 0xD0])
        fields = {"meta": pack_scalars([msg.round_idx, msg.total_samples])}
        for info, scalar, layer in zip(self.layers, self.scalar_sigma, msg.layers, strict=True):
            n = info.name
            if self.grid:
                fields[f"{n}.mu"] = encode_grid(layer.mu)
            else:
                fields[f"{n}.support"] = encode_support(layer.support, value_bits=self.tr.down_bits)
                fields[f"{n}.mu"] = self.down_values.encode(layer.mu[layer.support], rng)
            fields[f"{n}.sigma"] = _encode_sigma(layer.sigma, scalar)
            if layer.prior_std is not None:
                fields[f"{n}.prior_std"] = encode_prior_std(layer.prior_std, self.cfg.dturbo.prior_std_dtype)
            fields[f"{n}.bias"] = self._bias_values(layer.bias, rng)
        return self.down.frame(fields | plain_fields)

    def encode_downlinks(self, msg: DturboDownlink, plain_fields: dict[str, bytes], bases: Mapping[int, int],
                         held: HeldSupports, weights: Mapping[int, list[np.ndarray]] | None = None
                         ) -> dict[int, bytes]:
        """``positions = "delta"``: client id -> its downlink, each layer's S coded against the support of round
        ``bases[cid]`` (``held[round]``; ``NO_BASE``: whole). Everything else is the same for every client (mu_G on
        S drawn once, seeded by the round as in :meth:`encode_downlink`), and clients with the same base get the
        same bytes. With ``down_mu = "update"`` mu_G is each client's update from ``weights[cid]``, the weights it
        holds from round ``bases[cid]`` (absent: none, zeros), :meth:`encode_update`."""
        rng = np.random.default_rng([self.cfg.experiment.seed, msg.round_idx, 0xD0])
        weights = weights or {}
        rest: list[dict[str, bytes]] = []  # per layer, the fields after the support, in the order they are framed
        whole: list[bytes] = []  # per layer, S's full positions (found once: the rectangle search is the slow part)
        for info, scalar, layer in zip(self.layers, self.scalar_sigma, msg.layers, strict=True):
            n = info.name
            whole.append(encode_support(layer.support, value_bits=self.tr.down_bits))
            mu = layer.mu[layer.support]
            f = {} if self.update else {f"{n}.mu": self.down_values.encode(mu, rng)}
            f[f"{n}.sigma"] = _encode_sigma(layer.sigma, scalar)
            if layer.prior_std is not None:
                f[f"{n}.prior_std"] = encode_prior_std(layer.prior_std, self.cfg.dturbo.prior_std_dtype)
            if not (self.update and self.bias_down):  # else each client's update from the biases it holds
                f[f"{n}.bias"] = self._bias_values(layer.bias, rng)
            rest.append(f)
        framed: dict[int, bytes] = {}
        out: dict[int, bytes] = {}
        for cid, base in bases.items():
            key = cid if self.update else base  # updates differ by client
            if key not in framed:
                fields = {"meta": pack_scalars([msg.round_idx, msg.total_samples, base])}
                steps = self.encode_update(msg, cid, weights.get(cid))[0] if self.update else None
                for i, (info, layer) in enumerate(zip(self.layers, msg.layers, strict=True)):
                    held_s = None if base == NO_BASE else held[base][i]
                    fields[f"{info.name}.support"] = encode_support_delta(
                        layer.support, held_s, value_bits=self.tr.down_bits, full=whole[i])
                    if steps is not None:
                        fields[f"{info.name}.mu"] = steps[i]
                    fields |= rest[i]
                    if steps is not None and self.bias_down:
                        fields[f"{info.name}.bias"] = steps[len(self.layers) + i]
                framed[key] = self.down.frame(fields | plain_fields)
            out[cid] = framed[key]
        return out

    def encode_update(self, msg: DturboDownlink, client_id: int, weights: list[np.ndarray] | None
                      ) -> tuple[list[bytes], list[np.ndarray]]:
        """``down_mu = "update"``: per layer, the update mu_G - R on S on 2**down_bits levels (unbiased stochastic
        rounding, a generator seeded by the round and the client; ``down_rounding = "nearest"``: the nearest of
        2**down_bits - 1), R = ``weights`` the client holds (None: zeros);
        and the weights R' it holds once it decodes them (:func:`updated_weights`): |R' - mu_G| on S stays below one
        level spacing, 2 max|mu_G - R| / (2**down_bits - 1), and what one round rounds off the next one sends.
        With ``biases = "as_mu"`` each layer's biases follow, coded alike from the biases held (``HeldWeights``)."""
        rng = np.random.default_rng([self.cfg.experiment.seed, msg.round_idx, client_id, 0xD1])
        settled = self.settled_after is not None and msg.round_idx > self.settled_after
        values = self.down_first if weights is None else self.down_values.at(settled)
        targets = [(layer.mu, layer.support) for layer in msg.layers]
        if self.bias_down:
            targets += [(layer.bias, np.ones(layer.bias.shape, bool)) for layer in msg.layers]
        steps, after = [], []
        for i, (mu, support) in enumerate(targets):
            held = np.zeros(support.shape, np.float32) if weights is None else weights[i]
            step = values.encode(mu[support] - held[support], rng)
            steps.append(step)
            decoded = values.decode(step, int(support.sum()), "mu")
            after.append(updated_weights(held, support, decoded))
        return steps, after

    def held_entries(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """``down_mu = "update"``: the entries of ``HeldWeights`` in their order, as (layer, ``"mu"`` or ``"bias"``,
        shape): every layer's grid, then with ``biases = "as_mu"`` every layer's biases."""
        entries = [(i.name, "mu", i.grid) for i in self.layers]
        if self.bias_down:
            entries += [(i.name, "bias", (nb,)) for i, nb in zip(self.layers, self.n_bias, strict=True)]
        return entries

    def _bias_values(self, bias: np.ndarray, rng: np.random.Generator) -> bytes:
        """A layer's biases as values in a downlink: float16, or (``biases = "as_mu"``) on mu's levels."""
        return self.down_values.encode(bias, rng) if self.bias_down else encode_dense(bias, dtype="float16")

    def decode_downlink(self, data: bytes, held: HeldSupports | None = None, weights: HeldWeights | None = None
                        ) -> DturboDownlink:
        """The client's reading of a downlink; MessageError / CodecError when it does not fit the model.
        ``positions = "delta"``: ``held`` are the supports this client holds (by round); a downlink coded against
        one it does not hold is a MessageError naming both. ``down_mu = "update"``: ``weights`` are the weights it
        holds (by round), and the layers' mu the weights it holds after this downlink."""
        fields = self.down.open(data)
        meta = unpack_scalars(need(fields, "meta"), 3 if self.delta else 2)
        round_idx, total = int(meta[0]), int(meta[1])
        base = int(meta[2]) if self.delta else NO_BASE
        base_supports = None if held is None else held.get(base)
        layers = []
        for i, info in enumerate(self.layers):
            n, size = info.name, int(np.prod(info.grid))
            if self.grid:
                mu = decode_grid(need(fields, f"{n}.mu"), max_elements=size).astype(np.float64)
                mask = mu != 0
            else:
                mask = self._decode_support(need(fields, f"{n}.support"), info, i, round_idx, base, base_supports,
                                            held)
                mu = np.zeros(mask.shape)
                k = int(mask.sum())
                values = self.down_first if self.update and base == NO_BASE else self.down_values
                on_s = values.decode(need(fields, f"{n}.mu"), k, f"{n}.mu")
                if self.update:  # the step from the weights held
                    held_mu = self._held_weights(info, i, round_idx, base, weights, info.grid)
                    mu = updated_weights(held_mu, mask, on_s)
                    mu = mu.astype(np.float64)
                else:
                    mu[mask] = on_s
            if mu.shape != info.grid:
                raise MessageError(f"{n}.mu grid {mu.shape} does not match the model's {info.grid}")
            k = int(mask.sum())
            sigma = decode_values(need(fields, f"{n}.sigma"), max_elements=max(k, 1))
            if sigma.size not in (1, k) or not np.all(np.isfinite(sigma)) or np.any(sigma <= 0):
                raise MessageError(f"{n}.sigma: expected 1 or {k} finite values > 0")
            prior_std = None
            if self.tr.prior_std == "sent":
                prior_std = decode_prior_std(need(fields, f"{n}.prior_std"), self.cfg.dturbo.prior_std_dtype, k)
            bias = self._decode_bias(need(fields, f"{n}.bias"), i, round_idx, base, weights)
            layers.append(DownLayer(mu, mask, sigma, prior_std, bias))
        return DturboDownlink(round_idx, total, layers, self.plain.decode(fields), base)

    def _decode_bias(self, payload: bytes, i: int, round_idx: int, base: int, weights: HeldWeights | None
                     ) -> np.ndarray:
        """Layer ``i``'s biases from a downlink: float16, or (``biases = "as_mu"``) on mu's levels, as values or as
        the update from the biases this client holds."""
        if not self.bias_down:
            return decode_dense(payload).reshape(-1)
        name, nb = f"{self.layers[i].name}.bias", self.n_bias[i]
        first = self.update and base == NO_BASE
        on = (self.down_first if first else self.down_values).decode(payload, nb, name)
        if not self.update:
            return on
        held = np.zeros(nb, np.float32)
        if base != NO_BASE:
            held = self._held_weights(self.layers[i], len(self.layers) + i, round_idx, base, weights, (nb,))
        return updated_weights(held, np.ones(nb, bool), on)

    def _held_weights(self, info: LayerInfo, slot: int, round_idx: int, base: int, weights: HeldWeights | None,
                      shape: tuple[int, ...]) -> np.ndarray:
        """``down_mu = "update"``: the values of ``HeldWeights`` entry ``slot`` (layer ``info``'s grid, or its
        biases) the update of round ``round_idx`` starts from: those of round ``base`` this client holds (NO_BASE:
        zeros); a MessageError when it holds none of that round."""
        if base == NO_BASE:
            return np.zeros(shape, np.float32)
        mine = None if weights is None else weights.get(base)
        if mine is None:
            holds = sorted(weights) if weights else []
            raise MessageError(
                f"{info.name}.mu: the downlink of round {round_idx} sends mu_G as an update from the weights of round "
                f"{base}, and this client holds {'those of rounds ' + str(holds) if holds else 'none'}")
        held = mine[slot] if slot < len(mine) else None
        if held is None or held.shape != shape:
            what = "grid" if slot < len(self.layers) else "biases"
            raise MessageError(f"{info.name}: the weights held have shape {None if held is None else held.shape}, "
                               f"the model's {what} is {shape}")
        return held

    def _decode_support(self, payload: bytes, info: LayerInfo, i: int, round_idx: int, base: int,
                        base_supports: list[np.ndarray] | None, held: HeldSupports | None) -> np.ndarray:
        """One layer's S from its ``support`` field: whole, or (``positions = "delta"``) the flips applied to the
        support of round ``base`` this client holds."""
        size = int(np.prod(info.grid))
        if not self.delta:
            return decode_support(payload, max_elements=size)
        if support_delta_needs_base(payload):
            if base_supports is None:
                holds = sorted(held) if held else []
                raise MessageError(
                    f"{info.name}.support: the downlink of round {round_idx} sends it as a difference from the "
                    f"support of round {base}, and this client holds "
                    f"{'the supports of rounds ' + str(holds) if holds else 'no support'}")
            if base_supports[i].shape != info.grid:
                raise MessageError(f"{info.name}: the support held has shape {base_supports[i].shape}, the model's "
                                   f"grid is {info.grid}")
            return decode_support_delta(payload, base_supports[i], max_elements=size)
        return decode_support_delta(payload, None, max_elements=size)

    # --------------------------------------------------------------- uplink
    def encode_uplink(self, round_idx: int, client_id: int, msg: DturboUplink, plain_fields: dict[str, bytes],
                      rng: np.random.Generator, received: dict[str, np.ndarray] | None = None) -> bytes:
        """A client's upload (its plain state already encoded, :meth:`PlainState.encode_model`, so ``msg.plain`` is
        not read); the update is quantised with the client's ``rng`` (up_bits < 16). ``received``, when given, is
        filled with each layer's mu as the server decodes it (what error feedback subtracts)."""
        fields = {"meta": pack_scalars([round_idx, client_id, msg.n_t])}
        for info, scalar in zip(self.layers, self.scalar_sigma, strict=True):
            n, layer = info.name, msg.layers[info.name]
            fields[f"{n}.mu"] = self.up_values.encode(layer.mu, rng)
            if received is not None:
                received[n] = self.up_values.decode(fields[f"{n}.mu"], layer.mu.size, f"{n}.mu")
            fields[f"{n}.sigma"] = _encode_sigma(layer.sigma, scalar)
            fields[f"{n}.bias"] = (self.up_values.encode(layer.bias, rng) if self.bias_up
                                   else encode_dense(layer.bias, dtype="float16"))
        fields |= plain_fields
        fields["metrics"] = pack_scalars([msg.nll, msg.penalty])
        return self.up.frame(fields)

    def decode_uplink(self, data: bytes, supports: list[int], round_idx: int | None, total_samples: int
                      ) -> DturboUplink:
        """One upload, validated against the sizes of S this round (``supports``: |S| per layer); MessageError /
        CodecError with the reason it is refused."""
        fields, n_t, client_id = self.up.open_upload(data, round_idx, total_samples, self.max_uplink_bytes)
        layers: dict[str, UpLayer] = {}
        for info, k, scalar, nb in zip(self.layers, supports, self.scalar_sigma, self.n_bias, strict=True):
            n = info.name
            mu = self.up_values.decode(need(fields, f"{n}.mu"), k, f"{n}.mu")
            sig_len = 1 if scalar else k
            sigma = decode_values(need(fields, f"{n}.sigma"), max_elements=sig_len)
            if sigma.shape != (sig_len,):
                raise MessageError(f"{n}.sigma has {sigma.size} values, expected {sig_len}")
            if self.bias_up:
                bias = self.up_values.decode(need(fields, f"{n}.bias"), nb, f"{n}.bias")
            else:
                bias = decode_dense(need(fields, f"{n}.bias"), max_elements=max(nb, 1)).reshape(-1)
            if bias.size != nb:
                raise MessageError(f"{n}.bias has {bias.size} values, expected {nb}")
            for key, arr in (("mu", mu), ("sigma", sigma), ("bias", bias)):
                finite(f"{n}.{key}", arr)
            if np.any(sigma <= 0):
                raise MessageError(f"{n}.sigma must be > 0")
            layers[n] = UpLayer(mu, sigma, bias)
        plain = self.plain.decode(fields)
        metrics = upload_metrics(fields, 2)
        return DturboUplink(n_t, plain, layers, float(metrics[0]), float(metrics[1]), client_id=client_id)


def _encode_sigma(sigma: np.ndarray, scalar: bool) -> bytes:
    if scalar:  # one sigma per layer: a float32 scalar costs nothing
        return encode_values(sigma.reshape(1).astype(np.float32), dtype="float32")
    return encode_values(sigma.astype(np.float32), dtype="float16")
