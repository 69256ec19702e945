"""D-Turbo-VBI: the server and client halves of one round (docs/algorithm.md §7).

Server (Module A closed forms + Module B):  aggregate -> E3 -> E4 -> E1 -> SPMP -> E2 -> support.
Client: set mu, sigma from the downlink, train (E6) on the support only, upload mu on the support
(canonical row-major order, no positions), sigma, biases and n_t. State outside the Bayesian layers (BatchNorm, ...
of a model of one's own) travels dense both ways (:mod:`dturbo.algorithms.plain`).

The support S travels implicitly as the nonzeros of the cluster-coded mu_G (docs/algorithm.md §9). To keep that exact,
the server keeps S equal to the nonzeros of mu_G in float16: a weight whose mean rounds to zero in 16-bit
transmission leaves S, and a weight (re-)entering S restarts from the smallest normal float16, 2^-14,
instead of exactly 0 (docs/algorithm.md §7 says "restarts from 0"; 2^-14 ~ 6e-5 is 0 for every practical purpose).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from scipy.special import expit
from torch import nn

from .. import vbi
from ..codec import (
    decode_dense,
    decode_grid,
    decode_quantized,
    decode_support,
    decode_values,
    encode_dense,
    encode_grid,
    encode_quantized,
    encode_support,
    encode_values,
)
from ..config import Config, ConfigError, PriorConfig, SparsityConfig
from ..device import resolve_device
from ..nn.bayes import BayesianLayer, bayesian_layers, softplus_inverse_tensor
from ..nn.models import layer_scale, weight_uses
from ..prior import LayerPrior, grid_shape, layer_kind, resolve_prior
from ..quantize import decode_stochastic, encode_stochastic
from ..spmp import grid_bp
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

REENTRY_VALUE = float(2.0**-14)
DOWN_KIND, UP_KIND = "dturbo/down", "dturbo/up"


LOG8_LEVELS = 256


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


def density_schedule(round_idx: int, *, target: float, warmup: int, ramp: int) -> float:
    """Scheduled support density of round ``round_idx`` in target mode: dense for ``warmup`` rounds, then a
    cubic ramp to ``target`` over ``ramp`` rounds (the gradual-pruning schedule of Zhu & Gupta, 2017)."""
    if round_idx < warmup:
        return 1.0
    progress = min(1.0, (round_idx - warmup + 1) / ramp)
    return target + (1.0 - target) * (1.0 - progress) ** 3


@dataclass(frozen=True)
class LayerInfo:
    name: str
    weight_shape: tuple[int, ...]
    grid: tuple[int, int]
    prior: LayerPrior
    uses: int = 1  # multiply-adds each weight does for one sample (conv: output positions)

    @property
    def cost(self) -> float:
        """Multiply-adds of the whole layer for one sample, dense."""
        return float(np.prod(self.grid)) * self.uses


def _layer_infos(model: nn.Module, cfg: Config) -> list[LayerInfo]:
    uses = weight_uses(model) if cfg.dturbo.sparsity.budget == "flops" else {}
    infos = []
    for name, layer in bayesian_layers(model):
        pc: PriorConfig = getattr(cfg.dturbo.prior, layer_kind(layer))
        prior = resolve_prior(pc, layer_scale(layer))
        infos.append(LayerInfo(name, tuple(layer.weight_mu.shape), grid_shape(layer), prior, uses.get(name, 1)))
    return infos


def budget_sizes(layers: list[LayerInfo], sp: SparsityConfig) -> np.ndarray:
    """What one layer's full support counts in the density budget: its weights (``budget = "weights"``) or
    its multiply-adds for one sample (``"flops"``)."""
    if sp.budget == "flops":
        return np.array([info.cost for info in layers], dtype=np.float64)
    return np.array([float(np.prod(info.grid)) for info in layers], dtype=np.float64)


def layer_targets(layers: list[LayerInfo], sp: SparsityConfig) -> np.ndarray:
    """Final support density of every layer in target mode (``sparsity.layer_targets``), NaN for layers
    that share one field (scope 'global'). A clear error for unknown layers, or named targets that leave
    the other layers no room in the global budget."""
    names = [info.name for info in layers]
    unknown = sorted(set(sp.layer_targets) - set(names))
    if unknown:
        raise ConfigError(f"dturbo.sparsity.layer_targets names {', '.join(map(repr, unknown))}, which the model "
                          f"does not have; its layers: {', '.join(names)}")
    default = np.nan if sp.scope == "global" else sp.target_density
    out = np.array([sp.layer_targets.get(n, default) for n in names], dtype=np.float64)
    shared = np.isnan(out)
    if sp.scope == "global" and sp.layer_targets:
        sizes = budget_sizes(layers, sp)
        left = sp.target_density * sizes.sum() - (out[~shared] * sizes[~shared]).sum()
        if not shared.any() or not 0 < left <= sizes[shared].sum():
            raise ConfigError(
                f"dturbo.sparsity.layer_targets {dict(sp.layer_targets)} with target_density {sp.target_density} "
                f"(scope 'global') leave the other layers a density of "
                f"{left / max(sizes[shared].sum(), 1):.4f}, outside (0, 1]: name fewer layers or change the targets"
            )
    return out


def _load_layer(layer: BayesianLayer, mu: np.ndarray, mask: np.ndarray, sigma: np.ndarray,
                bias: np.ndarray | None, prior_std: np.ndarray | None) -> None:
    with torch.no_grad():
        shape = layer.weight_mu.shape
        layer.mask.copy_(torch.from_numpy(mask.reshape(shape).astype(np.float32)))
        layer.weight_mu.copy_(torch.from_numpy(mu.reshape(shape).astype(np.float32)) * layer.mask)
        if layer.sigma_mode == "layer":
            layer.sigma_param.copy_(softplus_inverse_tensor(torch.tensor(float(sigma.reshape(-1)[0]))))
        else:
            # per-weight sigma: either the full grid (server) or the values on the support (client)
            full = np.full(mask.size, 1e-3)
            flat_mask = mask.reshape(-1)
            full[flat_mask] = sigma.reshape(-1)[flat_mask] if sigma.size == mask.size else sigma.reshape(-1)
            layer.sigma_param.copy_(softplus_inverse_tensor(torch.from_numpy(full.reshape(shape)).float()))
        if bias is not None and layer.bias is not None:
            layer.bias.copy_(torch.from_numpy(bias.astype(np.float32)))
        if prior_std is not None:
            layer.prior_std.copy_(torch.from_numpy(prior_std.reshape(shape).astype(np.float32)))


class DturboServer:
    """Server half of D-Turbo-VBI. ``model_factory`` builds the (seeded) initial model."""

    def __init__(self, cfg: Config, model_factory: Callable[[], nn.Module], total_samples: int) -> None:
        self.cfg = cfg
        self.model_factory = model_factory
        self.total_samples = int(total_samples)
        model = model_factory()
        self.layers = _layer_infos(model, cfg)
        self.plain = PlainState(model)  # the state outside the Bayesian layers (BatchNorm, ...): sent dense
        self.layer_targets = layer_targets(self.layers, cfg.dturbo.sparsity)
        tr = cfg.dturbo.transmission
        down = {"meta": "header", "sigma": "values", "bias": "dense"}
        down |= {"mu": "grid"} if tr.down_bits == 16 else {"support": "support", "mu": "quantized"}
        if tr.prior_std == "sent":
            down["prior_std"] = "quantized" if cfg.dturbo.prior_std_dtype == "log8" else "values"
        up = {"meta": "header", "mu": "values" if tr.up_bits == 16 else "quantized", "sigma": "values",
              "bias": "dense", "metrics": "header"}
        self.layouts = {DOWN_KIND: down | PLAIN_LAYOUT, UP_KIND: up | PLAIN_LAYOUT}

    def select_clients(self, round_idx: int) -> list[int]:
        f = self.cfg.federation
        return sample_uniform(self.cfg.experiment.seed, round_idx, f.clients, f.clients_per_round)

    # ----------------------------------------------------------------- state
    def init(self) -> State:
        """Initial state (§7): pi = pi~ = 0.5, S = all, q(rho) by E4 from the initial mu and sigma. In target mode
        with no warm-up, pi is instead Module B's prior with its field calibrated to the first scheduled density."""
        model = self.model_factory()
        state: State = {"field": np.zeros(len(self.layers))}
        for info, (_, layer) in zip(self.layers, bayesian_layers(model), strict=True):
            mu = layer.weight_mu.detach().double().numpy().reshape(info.grid)
            mask = np.float16(mu) != 0
            mu = np.where(mask, mu, 0.0)
            sigma = layer.sigma.detach().double().numpy()
            a_t, b_t = vbi.precision_posterior(
                0.5, mu, self._sigma_grid(sigma, info), **info.prior.gamma_kwargs(), form=self.cfg.dturbo.gamma_update
            )
            n = info.name
            state[f"{n}.mu"] = mu.astype(np.float32)
            state[f"{n}.mask"] = mask
            state[f"{n}.sigma"] = sigma.astype(np.float32).reshape(-1)  # (1,) per layer, or one per weight
            bias = layer.bias.detach().numpy().copy() if layer.bias is not None else np.zeros(0, np.float32)
            state[f"{n}.bias"] = bias
            state[f"{n}.pi_lo"] = np.zeros(info.grid)
            state[f"{n}.pt_lo"] = np.zeros(info.grid)
            state[f"{n}.a_t"] = np.asarray(a_t, dtype=np.float64)
            state[f"{n}.b_t"] = np.asarray(b_t, dtype=np.float64)
        state |= self.plain.init(model)
        if self.cfg.dturbo.sparsity.mode == "target" and self.scheduled_density(0) < 1.0:
            # No warm-up: the first support decision must follow the schedule too. Module B has no A->B message
            # yet (unary 0), and the first E3's evidence is already fixed by the initial q(rho), so the field is
            # calibrated for round 1 here exactly as every later round calibrates it for the next.
            evidence = [_tie(vbi.support_evidence(state[f"{i.name}.a_t"], state[f"{i.name}.b_t"],
                                                  **i.prior.gamma_kwargs()), i) for i in self.layers]
            self._module_b(state, [np.zeros(i.grid) for i in self.layers], evidence, 0)
        return state

    @staticmethod
    def _sigma_grid(sigma: np.ndarray, info: LayerInfo) -> np.ndarray:
        return sigma.reshape(info.grid) if sigma.size > 1 else np.full(info.grid, float(sigma.reshape(-1)[0]))

    def prior_std(self, state: State, info: LayerInfo) -> np.ndarray:
        """(E5) sigma_prior = sqrt(b~ / a~) per weight."""
        return vbi.prior_std(state[f"{info.name}.a_t"], state[f"{info.name}.b_t"])

    # -------------------------------------------------------------- downlink
    def downlink(self, state: State, round_idx: int) -> bytes:
        """Cluster-coded mu_G (its nonzeros are S), sigma_G, sigma_prior on S (E5), biases (§7.1, 9).
        With ``transmission.down_bits`` < 16: S's cluster-coded positions, then mu_G on S quantised (unbiased
        stochastic rounding, seeded by the round); with ``prior_std = "rebuilt"`` no sigma_prior."""
        tr = self.cfg.dturbo.transmission
        rng = np.random.default_rng([self.cfg.experiment.seed, round_idx, 0xD0])
        fields = {"meta": pack_scalars([round_idx, self.total_samples])}
        for info in self.layers:
            n = info.name
            mask = state[f"{n}.mask"]
            if tr.down_bits == 16:
                fields[f"{n}.mu"] = encode_grid(state[f"{n}.mu"] * mask)
            else:
                fields[f"{n}.support"] = encode_support(mask, value_bits=tr.down_bits)
                fields[f"{n}.mu"] = encode_stochastic(state[f"{n}.mu"][mask], tr.down_bits, rng)
            fields[f"{n}.sigma"] = self._encode_sigma(state[f"{n}.sigma"], mask)
            if tr.prior_std == "sent":
                fields[f"{n}.prior_std"] = encode_prior_std(
                    self.prior_std(state, info)[mask], self.cfg.dturbo.prior_std_dtype
                )
            fields[f"{n}.bias"] = encode_dense(state[f"{n}.bias"], dtype="float16")
        return frame(DOWN_KIND, fields | self.plain.encode_state(state))

    @staticmethod
    def _sigma_grid_on(sigma: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """sigma as a grid from a layer's scalar or its values on the support ``mask`` (1 elsewhere)."""
        if sigma.size == 1:
            return np.full(mask.shape, float(sigma.reshape(-1)[0]))
        out = np.ones(mask.shape)
        out[mask] = sigma.reshape(-1)
        return out

    @staticmethod
    def _encode_sigma(sigma: np.ndarray, mask: np.ndarray) -> bytes:
        if sigma.size == 1:  # one sigma per layer: a float32 scalar costs nothing
            return encode_values(sigma.reshape(1).astype(np.float32), dtype="float32")
        return encode_values(sigma.reshape(mask.shape)[mask].astype(np.float32), dtype="float16")

    # ------------------------------------------------------------- aggregate
    def decode_uplink(self, state: State, data: bytes, round_idx: int | None = None
                      ) -> tuple[int, dict[str, np.ndarray], np.ndarray]:
        """Decode and validate one client's upload; raises MessageError / CodecError with a reason."""
        fields = fields_dict(data, UP_KIND, max_bytes=self._max_uplink_bytes(state))
        n_t = upload_samples(fields, round_idx, self.total_samples)
        out: dict[str, np.ndarray] = {}
        for info in self.layers:
            n = info.name
            k = int(state[f"{n}.mask"].sum())
            if self.cfg.dturbo.transmission.up_bits == 16:
                mu = decode_values(need(fields, f"{n}.mu"), max_elements=k)
            else:  # the update on S, quantised
                mu = decode_stochastic(need(fields, f"{n}.mu"), self.cfg.dturbo.transmission.up_bits, k)
            if mu.shape != (k,):
                raise MessageError(f"{n}.mu has {mu.size} values, the support has {k}")
            sig_len = 1 if state[f"{n}.sigma"].size == 1 else k
            sigma = decode_values(need(fields, f"{n}.sigma"), max_elements=sig_len)
            if sigma.shape != (sig_len,):
                raise MessageError(f"{n}.sigma has {sigma.size} values, expected {sig_len}")
            nb = state[f"{n}.bias"].size
            bias = decode_dense(need(fields, f"{n}.bias"), max_elements=max(nb, 1)).reshape(-1)
            if bias.size != nb:
                raise MessageError(f"{n}.bias has {bias.size} values, expected {nb}")
            for key, arr in (("mu", mu), ("sigma", sigma), ("bias", bias)):
                if not np.all(np.isfinite(arr)):
                    raise MessageError(f"{n}.{key} contains NaN or Inf")
            if np.any(sigma <= 0):
                raise MessageError(f"{n}.sigma must be > 0")
            out[f"{n}.mu"], out[f"{n}.sigma"], out[f"{n}.bias"] = mu, sigma, bias
        out |= self.plain.decode(fields)
        metrics = unpack_scalars(need(fields, "metrics"), 2)
        return int(n_t), out, metrics

    def _max_uplink_bytes(self, state: State) -> int:
        total = sum(state[f"{i.name}.mu"].size * 2 + state[f"{i.name}.bias"].size * 4 for i in self.layers)
        return 4 * total + 64 * len(self.layers) + self.plain.max_bytes() + 4096

    def aggregate(self, state: State, uplinks: list[bytes], round_idx: int) -> RoundResult:
        """Server step of docs/algorithm.md §7.3-7.5 on the uploads that decode and validate."""
        valid, rejected = decode_uplinks(uplinks, lambda data: self.decode_uplink(state, data, round_idx))
        p = client_weights([v[0] for v in valid], "samples")
        new: State = dict(state) | self.plain.aggregate([v[0] for v in valid], [v[1] for v in valid])
        for info in self.layers:
            n = info.name
            mask = state[f"{n}.mask"]
            mu = np.zeros(info.grid, dtype=np.float64)
            mu[mask] = sum(pt * v[1][f"{n}.mu"].astype(np.float64) for pt, v in zip(p, valid, strict=True))
            if self.cfg.dturbo.transmission.up_bits < 16:
                # Updates: added to the server's own mu_G, so the download's quantisation noise never enters it.
                mu[mask] += state[f"{n}.mu"][mask]
            sig = sum(pt * v[1][f"{n}.sigma"].astype(np.float64) for pt, v in zip(p, valid, strict=True))
            if state[f"{n}.sigma"].size > 1:
                full = state[f"{n}.sigma"].astype(np.float64).reshape(info.grid).copy()
                full[mask] = sig
                sig = full.reshape(-1)
            new[f"{n}.mu"] = mu
            new[f"{n}.sigma"] = np.asarray(sig, dtype=np.float32).reshape(state[f"{n}.sigma"].shape)
            new[f"{n}.bias"] = sum(pt * v[1][f"{n}.bias"] for pt, v in zip(p, valid, strict=True)).astype(np.float32)
        t0 = time.perf_counter()
        metrics = self._server_step(new, round_idx)
        metrics["server_seconds"] = round(time.perf_counter() - t0, 3)
        client_metrics = np.stack([v[2] for v in valid])
        nll = _exact_sum(p * client_metrics[:, 0])
        metrics["train_nll"] = nll
        # The (tempered, beta != 1) negative ELBO of E6 summed over the clients: n * E[-ln p(y|x,w)] + beta * KL,
        # the NLL estimated by the clients' mean training loss. E3/E4 minimise the KL whatever beta is.
        kl = metrics["kl_w"] + metrics["kl_rho"] + metrics["kl_s"]
        metrics["neg_elbo"] = self.total_samples * nll + self.cfg.dturbo.beta * kl
        metrics["clients_ok"] = float(len(valid))
        metrics["clients_rejected"] = float(len(rejected))
        return RoundResult(state=new, metrics=metrics, rejected=rejected)

    def _server_step(self, state: State, round_idx: int) -> dict[str, float]:
        """E3 -> E4 -> E1 -> SPMP -> E2 -> support (docs/algorithm.md §7.3-7.5). Mutates ``state``."""
        d = self.cfg.dturbo
        sp = d.sparsity
        thr_lo = float(vbi.safe_logit(d.support_threshold))
        eta: list[np.ndarray] = []
        eta_next: list[np.ndarray] = []  # next round's E3 evidence, known now (it only needs this E4)
        kl = dict.fromkeys(("kl_w", "kl_rho", "kl_s"), 0.0)
        for info in self.layers:
            n = info.name
            g = info.prior.gamma_kwargs()
            sigma = self._sigma_grid(state[f"{n}.sigma"].astype(np.float64), info)
            mu = state[f"{n}.mu"]
            # E3 with the current q(rho); its data-dependent part is the A->B message E1.
            evidence = _tie(vbi.support_evidence(state[f"{n}.a_t"], state[f"{n}.b_t"], **g), info)
            pt_lo = state[f"{n}.pi_lo"] + evidence
            # E4 with the new q(s) and the aggregated moments.
            a_t, b_t = vbi.precision_posterior(expit(pt_lo), mu, sigma, **g, form=d.gamma_update)
            for key, value in _kl_terms(info, state[f"{n}.mask"], mu, sigma, state[f"{n}.pi_lo"], pt_lo,
                                        a_t, b_t).items():
                kl[key] += value
            state[f"{n}.pt_lo"], state[f"{n}.a_t"], state[f"{n}.b_t"] = pt_lo, a_t, b_t
            eta.append(evidence)
            eta_next.append(_tie(vbi.support_evidence(a_t, b_t, **g), info))
        # Support rule (docs/algorithm.md §7.5), in target mode only after the warm-up rounds.
        apply_support = sp.mode == "prior" or round_idx >= sp.warmup_rounds
        for info in self.layers:
            n = info.name
            old, mu = state[f"{n}.mask"], state[f"{n}.mu"]
            if apply_support:
                keep = state[f"{n}.pt_lo"] >= thr_lo
                mu = np.where(keep & ~old, REENTRY_VALUE, np.where(keep, mu, 0.0))  # re-entry restarts near 0
            else:
                keep = old
            keep = keep & (np.float16(mu) != 0)  # S is exactly the nonzeros of the 16-bit mu_G
            state[f"{n}.mask"], state[f"{n}.mu"] = keep, np.where(keep, mu, 0.0).astype(np.float32)
        # Module B: SPMP on every grid, with the prior's field calibrated in target mode for the next round.
        iters = self._module_b(state, eta, eta_next, round_idx + 1)
        # Metrics of the new state.
        total = kept = 0
        flops = flops_kept = 0.0
        layer_density = {}
        for info in self.layers:
            mask = state[f"{info.name}.mask"]
            total += mask.size
            kept += int(mask.sum())
            flops += info.cost
            flops_kept += float(mask.sum()) * info.uses
            layer_density[f"density_{info.name}"] = float(mask.mean())
        return {
            "density": kept / total,
            **({"flops_density": flops_kept / flops} if sp.budget == "flops" else {}),
            **kl,
            "spmp_iters": float(iters),
            "field_mean": _exact_sum(state["field"]) / len(self.layers),
            # The density this round's support was calibrated to (by the previous round's Module B, or init).
            "scheduled_density": self.scheduled_density(round_idx) if sp.mode == "target" else float("nan"),
            **layer_density,
        }

    def scheduled_density(self, round_idx: int) -> float:
        """The schedule's density for the support chosen in round ``round_idx`` (0-based)."""
        sp = self.cfg.dturbo.sparsity
        return density_schedule(round_idx, target=sp.target_density, warmup=sp.warmup_rounds, ramp=sp.ramp_rounds)

    def _module_b(self, state: State, eta: list[np.ndarray], eta_next: list[np.ndarray], next_round: int) -> int:
        """SPMP on every grid with unary ``eta`` (E1) plus the prior's field; sets the B->A message pi (E2) that
        round ``next_round``'s E3 will use, and the field. In target mode the field is calibrated so that the
        support of that round, {eta_next + lo_h >= logit(threshold)}, has the scheduled density. Returns the
        most SPMP iterations a layer used."""
        sp = self.cfg.dturbo.sparsity
        density = self.scheduled_density(next_round)
        if sp.mode == "target" and density < 1.0:
            targets = np.array([np.nan if np.isnan(t) else density_schedule(
                next_round, target=t, warmup=sp.warmup_rounds, ramp=sp.ramp_rounds) for t in self.layer_targets])
            thr_lo = float(vbi.safe_logit(self.cfg.dturbo.support_threshold))
            fields = self._calibrate_field(eta, eta_next, density, targets, thr_lo, state["field"])
        else:
            fields = np.zeros(len(self.layers))
        iters = 0
        for info, ev, h in zip(self.layers, eta, fields, strict=True):
            res = self._spmp(info, ev, h)
            state[f"{info.name}.pi_lo"] = res[0]
            iters = max(iters, res[1])
        state["field"] = np.asarray(fields, dtype=np.float64)
        return iters

    def _spmp(self, info: LayerInfo, eta: np.ndarray, field: float) -> tuple[np.ndarray, int]:
        """Run SPMP with unary eta + field; return the B->A message (E2) lo_h = belief - eta, which
        includes the field (a factor of Module B's prior), and the iterations used."""
        s = self.cfg.dturbo.spmp
        if info.prior.tie_rows:
            # One variable per row: SPMP on the column chain of row evidences. The field stays a per-weight
            # log-odds (so tied and untied layers share its scale): a row of M weights gets M * field.
            row_field = field * eta.shape[1]
            res = grid_bp(eta[:, :1] + row_field, info.prior.transitions, max_iter=s.max_iter, tol=s.tol,
                          damping=s.damping)
            return np.broadcast_to(res.extrinsic + row_field, eta.shape).copy(), res.iterations
        res = grid_bp(eta + field, info.prior.transitions, max_iter=s.max_iter, tol=s.tol, damping=s.damping)
        return res.extrinsic + field, res.iterations

    def _calibrate_field(
        self, eta: list[np.ndarray], eta_next: list[np.ndarray], density: float, targets: np.ndarray,
        thr_lo: float, previous: np.ndarray,
    ) -> np.ndarray:
        """Field h of the MRF prior such that the support of the next round,
        {eta_next + lo_h(h) >= logit(threshold)}, has the scheduled density. SPMP runs on this round's
        E1 message ``eta``; ``eta_next`` is the next E3's evidence, already fixed by this round's E4, so
        the prediction is exact (bisection on h, bracketed around the previous round's field; the
        predicted density is monotone in h). ``targets`` holds this round's density of layers calibrated alone
        (scope 'layer', or ``layer_targets``), NaN for layers that share one h (scope 'global': they keep
        different densities and together take what the others leave of ``density``). A layer never goes below
        min_layer_density."""
        sp = self.cfg.dturbo.sparsity
        L = len(self.layers)
        sizes = budget_sizes(self.layers, sp)
        # The shared field is a log-odds against activity per unit of cost: with budget "flops" a weight that
        # does u multiply-adds a sample gets u / (the shared layers' mean u) times it, so the costly layers
        # (early convolutions) are thinned hardest and the cheap dense layers keep more (issue 13).
        scale = np.ones(L)
        if sp.budget == "flops":
            uses = np.array([info.uses for info in self.layers], dtype=np.float64)
            weights = np.array([float(np.prod(info.grid)) for info in self.layers])
            shared_idx = np.isnan(targets)
            if shared_idx.any():
                mean_use = (uses * weights)[shared_idx].sum() / weights[shared_idx].sum()
                scale = np.where(shared_idx, uses / mean_use, 1.0)

        def layer_density(i: int, h: float) -> float:
            lo_h, _ = self._spmp(self.layers[i], eta[i], h * scale[i])
            return float(np.mean(eta_next[i] + lo_h >= thr_lo))

        def dens_at(h: float, idx: list[int]) -> float:
            return sum(layer_density(i, h) * sizes[i] for i in idx) / sizes[idx].sum()

        def solve(target: float, idx: list[int], start: float, at_least: bool = False) -> float:
            def met(dens: float) -> bool:
                return 0.0 <= (dens - target if at_least else target - dens) < 5e-4

            # A field that already gives the scheduled support is kept. Once the support has settled, a whole range
            # of fields gives the same support (its evidences are far apart); taking any other point of that range
            # made the field drift by +8 per round (the bracket widens to hi = start + 4 + 16k and bisection
            # returns its middle), until the message pi was 1 everywhere (issue 13).
            if met(dens_at(start, idx)):
                return start
            # The field moves little between rounds: bracket around the last one, widen if needed.
            lo, hi = start - 4.0, start + 4.0
            while dens_at(lo, idx) > target and lo > -200:
                lo -= 16.0
            while dens_at(hi, idx) < target and hi < 200:
                hi += 16.0
            # Density rises with h; lo stays at or under the target, so the schedule is never exceeded
            # ("at most 25% nonzero" means at most). It is approached from below within 5e-4 unless the density
            # jumps by more inside the last 1e-3 step of h (a tied row, equal evidences): then by that jump.
            # A floor is the other way round: at least the target (else a tied layer whose one row is more than
            # the floor would be emptied).
            while hi - lo > 1e-3:
                mid = 0.5 * (lo + hi)
                dens = dens_at(mid, idx)
                if met(dens):
                    return mid
                lo, hi = (lo, mid) if dens > target else (mid, hi)
            return hi if at_least else lo

        fields = np.zeros(L)
        alone = [i for i in range(L) if not np.isnan(targets[i])]
        for i in alone:
            fields[i] = solve(float(targets[i]), [i], float(previous[i]))
        shared = [i for i in range(L) if np.isnan(targets[i])]
        if shared:
            # What the layers calibrated alone leave of the budget, as a density of the shared ones.
            left = density * sizes.sum() - sum(layer_density(i, fields[i]) * sizes[i] for i in alone)
            share = min(1.0, max(left / sizes[shared].sum(), 0.0)) if alone else density  # exact when all share
            fields[shared] = solve(share, shared, float(np.mean(previous[shared] / scale[shared])))
        floor = min(sp.min_layer_density, density)
        for i in range(L):
            if layer_density(i, fields[i]) < floor:
                fields[i] = max(fields[i], solve(floor, [i], float(fields[i]), at_least=True))
        # From here on a layer's field is its own (SPMP applies it as it is).
        return fields * scale

    # ------------------------------------------------------------ the model
    def global_model(self, state: State) -> nn.Module:
        """The global model with mean weights mu_G on S (zeros elsewhere), in eval mode."""
        model = self.model_factory()
        for info, (_, layer) in zip(self.layers, bayesian_layers(model), strict=True):
            n = info.name
            _load_layer(layer, state[f"{n}.mu"], state[f"{n}.mask"], state[f"{n}.sigma"],
                        state[f"{n}.bias"] if layer.bias is not None else None, self.prior_std(state, info))
        self.plain.load_state(model, state)
        return model.eval()

    def support_messages(self, state: State) -> dict[str, np.ndarray]:
        """pi (the B->A message, E2) and the support mask of every layer, as grids (for Fig. 3)."""
        out = {}
        for info in self.layers:
            out[f"{info.name}.pi"] = expit(state[f"{info.name}.pi_lo"]).astype(np.float16)
            out[f"{info.name}.mask"] = state[f"{info.name}.mask"].astype(np.uint8)
        return out


def rebuilt_prior_std(info: LayerInfo, mu: np.ndarray, sigma: np.ndarray, form: str) -> np.ndarray:
    """sigma_prior as a client rebuilds it (``transmission.prior_std = "rebuilt"``): E4 then E5 with pi~ = 1, i.e.
    q(rho) = Gamma(a + 1/2, b + (mu^2 + sigma^2) / 2) from the downloaded mu_G and sigma_G. The server's E4 used its
    own pi~ (>= the support threshold on S) and the unrounded mu: docs/communication.md states how far they differ."""
    a_t, b_t = vbi.precision_posterior(1.0, mu, sigma, **info.prior.gamma_kwargs(), form=form)
    return vbi.prior_std(a_t, b_t)


def _tie(evidence: np.ndarray, info: LayerInfo) -> np.ndarray:
    """The E1 message of a layer with tied rows: all weights of a row share one support variable, whose
    evidence is the sum of theirs (broadcast over the row, so E3 gives every weight the row's posterior)."""
    if not info.prior.tie_rows:
        return evidence
    return np.broadcast_to(evidence.sum(1, keepdims=True), evidence.shape).copy()


def _kl_terms(info: LayerInfo, mask: np.ndarray, mu: np.ndarray, sigma: np.ndarray, pi_lo: np.ndarray,
              pt_lo: np.ndarray, a_t: np.ndarray, b_t: np.ndarray) -> dict[str, float]:
    """One layer's KL terms of the negative ELBO (docs/algorithm.md §5-6) after this round's E3 and E4: q(w) on
    the support the clients trained (``mask``; weights off it are exactly 0, outside the model), q(rho) of every
    weight, q(s) of every support variable (one per row when rows are tied) against Module B's pi."""
    pt = expit(pt_lo)
    g = info.prior.gamma_kwargs()
    support = (slice(None), slice(0, 1)) if info.prior.tie_rows else (slice(None), slice(None))
    return {
        "kl_w": _exact_sum(vbi.kl_weights(mu[mask], sigma[mask], a_t[mask], b_t[mask])),
        "kl_rho": _exact_sum(vbi.kl_precision(pt, a_t, b_t, **g)),
        "kl_s": _exact_sum(vbi.kl_support(pt[support], expit(pi_lo[support]))),
    }


def _exact_sum(values: np.ndarray) -> float:
    """Correctly rounded sum: numpy's SIMD sums depend on memory alignment, and metrics must be
    bit-identical between a resumed and an uninterrupted run."""
    return math.fsum(np.asarray(values, dtype=np.float64).ravel().tolist())




class DturboClient:
    """Client half: decode the downlink, train (E6) on the support, upload mu on the support."""

    def __init__(self, cfg: Config, model_factory: Callable[[], nn.Module]) -> None:
        self.cfg = cfg
        self.model_factory = model_factory
        self.model = model_factory()
        self.layers = _layer_infos(self.model, cfg)
        self.plain = PlainState(self.model)
        self.device = resolve_device(cfg.experiment.device)

    def fit(self, downlink: bytes, data: ClientData, client_id: int) -> bytes:
        fields = fields_dict(downlink, DOWN_KIND)
        round_idx, total = (int(v) for v in unpack_scalars(need(fields, "meta"), 2))
        tr = self.cfg.dturbo.transmission
        model = self.model
        layers = bayesian_layers(model)
        masks, starts = [], []
        for info, (_, layer) in zip(self.layers, layers, strict=True):
            n = info.name
            if tr.down_bits == 16:
                mu = decode_grid(need(fields, f"{n}.mu"), max_elements=int(np.prod(info.grid))).astype(np.float64)
                mask = mu != 0
            else:
                mask = decode_support(need(fields, f"{n}.support"), max_elements=int(np.prod(info.grid)))
                mu = np.zeros(mask.shape)
                mu[mask] = decode_stochastic(need(fields, f"{n}.mu"), tr.down_bits, int(mask.sum()))
            if mu.shape != info.grid:
                raise MessageError(f"{n}.mu grid {mu.shape} does not match the model's {info.grid}")
            k = int(mask.sum())
            sigma = decode_values(need(fields, f"{n}.sigma"), max_elements=max(k, 1))
            if sigma.size not in (1, k) or not np.all(np.isfinite(sigma)) or np.any(sigma <= 0):
                raise MessageError(f"{n}.sigma: expected 1 or {k} finite values > 0")
            ps = np.ones(info.grid)
            if tr.prior_std == "sent":
                ps[mask] = decode_prior_std(need(fields, f"{n}.prior_std"), self.cfg.dturbo.prior_std_dtype, k)
            else:
                ps[mask] = rebuilt_prior_std(info, mu, DturboServer._sigma_grid_on(sigma, mask),
                                             self.cfg.dturbo.gamma_update)[mask]
            bias = decode_dense(need(fields, f"{n}.bias")).reshape(-1)
            _load_layer(layer, mu, mask, sigma, bias if layer.bias is not None else None, ps)
            masks.append(mask)
            starts.append(layer.weight_mu.detach().double().numpy().reshape(info.grid))  # what training starts from
        self.plain.load_fields(model, fields)
        gen = client_generator(self.cfg.experiment.seed, round_idx, client_id)
        for _, layer in layers:
            layer.generator = gen
        beta = self.cfg.dturbo.beta

        def penalty() -> torch.Tensor:
            # E6: beta * KL / n with n the *global* sample count.
            return beta * torch.stack([layer.kl() for _, layer in layers]).sum() / total

        result = train_local(model, data, self.cfg.train, gen, penalty, device=self.device)
        up = {"meta": pack_scalars([round_idx, client_id, len(data)])}
        rng = np.random.default_rng([self.cfg.experiment.seed, round_idx, client_id, 0x0B])
        for info, (_, layer), mask, start in zip(self.layers, layers, masks, starts, strict=True):
            n = info.name
            mu = layer.weight_mu.detach().double().numpy().reshape(info.grid)
            if tr.up_bits == 16:
                up[f"{n}.mu"] = encode_values(mu[mask].astype(np.float32), dtype="float16")
            else:  # the update from the weights received, quantised (the server adds it to its own mu_G)
                up[f"{n}.mu"] = encode_stochastic(mu[mask] - start[mask], tr.up_bits, rng)
            sigma = layer.sigma.detach().numpy()
            up[f"{n}.sigma"] = DturboServer._encode_sigma(sigma, mask)
            bias = layer.bias.detach().numpy() if layer.bias is not None else np.zeros(0, np.float32)
            up[f"{n}.bias"] = encode_dense(bias, dtype="float16")
        up |= self.plain.encode_model(model)
        up["metrics"] = pack_scalars([result.nll, result.penalty])
        return frame(UP_KIND, up)
