"""D-Turbo-VBI's server half (docs/algorithm.md §7.3-7.5): the state, the downlinks, the aggregation and the turbo
step."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from scipy.special import expit
from torch import nn

from ...config import Config
from ...nn.bayes import bayesian_layers
from ..base import RoundResult, State
from ..bounds import Limit, UploadBounds, magnitude, sigma_limit
from ..held import HeldSupports as ClientHeld
from ..plain import PlainState
from ..server import Received, ServerBase
from . import turbo, vbi
from .checks import announce_dense
from .layers import layer_infos, load_layer
from .messages import (
    NO_BASE,
    DownLayer,
    DturboDownlink,
    DturboMessages,
    DturboUplink,
    HeldSupports,
    sigma_as_sent,
)
from .sparsity import local_steps_a_round, make_policy, pruning_schedule
from .turbo import LayerInfo, LayerState
from .units import DeadUnits


class DturboServer(ServerBase[DturboUplink]):
    """Server half of D-Turbo-VBI. ``model_factory`` builds the (seeded) initial model."""

    def __init__(self, cfg: Config, model_factory: Callable[[], nn.Module], total_samples: int) -> None:
        self.cfg = cfg
        self.model_factory = model_factory
        self.total_samples = int(total_samples)
        model = model_factory()
        self.layers = layer_infos(model, cfg)
        self.plain = PlainState(model)  # the state outside the Bayesian layers (BatchNorm, ...): sent dense
        # Values outside every support (biases, the plain state): they travel dense and count as nonzero.
        self.dense_values = self.plain.size + sum(layer.bias.numel() for _, layer in bayesian_layers(model)
                                                  if layer.bias is not None)
        if self.plain:
            weights = sum(int(np.prod(i.grid)) for i in self.layers)
            announce_dense(self.plain, self.dense_values, self.dense_values + weights)
        # docs/algorithm.md §11; the schedule paced by the mean client's local steps unless set in rounds.
        self.schedule = pruning_schedule(cfg.dturbo.sparsity, cfg.experiment.rounds, local_steps_a_round(
            cfg.train, self.total_samples, cfg.federation.clients))
        self.sparsity = make_policy(self.layers, cfg.dturbo, self.schedule)  # checks layer_targets now
        self.messages = DturboMessages(cfg, model, self.layers, self.plain, self.schedule.reached_at)
        self.dead_units = DeadUnits(model, self.layers) if cfg.dturbo.dead_units == "cut" else None
        self.layouts = self.messages.layouts
        # positions = "delta": what each client holds (docs/communication.md, "Positions")
        self.held = ClientHeld([i.name for i in self.layers], [i.grid for i in self.layers], cfg.federation.clients)

    # ----------------------------------------------------------------- state
    def init(self) -> State:
        """Initial state (§7): pi = pi~ = 0.5, S = all, q(rho) by E4 from the initial mu and sigma. When the sparsity
        policy steers round 0's support (target mode with no warm-up), pi is instead Module B's prior with its field
        calibrated to the first scheduled density."""
        model = self.model_factory()
        state: State = {"field": np.zeros(len(self.layers))}
        for info, (_, layer) in zip(self.layers, bayesian_layers(model), strict=True):
            mu = layer.weight_mu.detach().double().numpy().reshape(info.grid)
            mu = np.where(turbo.support(mu), mu, 0.0)
            sigma = layer.sigma.detach().double().numpy()
            a_tilde, b_tilde = vbi.precision_posterior(0.5, mu, turbo.sigma_grid(sigma, info.grid),
                                                       **info.prior.gamma_kwargs(), form=self.cfg.dturbo.gamma_update)
            state |= LayerState(
                mu=turbo.restrict_to_support(mu),
                sigma=sigma.astype(np.float32).reshape(-1),  # (1,) per layer, or one per weight
                pi_logodds=np.zeros(info.grid),
                a_tilde=np.asarray(a_tilde, dtype=np.float64),
                b_tilde=np.asarray(b_tilde, dtype=np.float64),
            ).entries(info.name)
            bias = layer.bias.detach().numpy().copy() if layer.bias is not None else np.zeros(0, np.float32)
            state[f"{info.name}.bias"] = bias
            if self.trained_model:
                state[f"{info.name}.mu_trained"] = state[f"{info.name}.mu"].copy()
        state |= self.plain.init(model)
        if self.messages.delta:  # no client holds a support yet
            state |= self.held.init()
            if self.messages.update:
                state |= {key: np.zeros((self.held.clients, int(np.prod(shape))), dtype=np.float32)
                          for key, shape in self._held_state()}
        if self.sparsity.steers(0):
            # The first support decision must follow the schedule too. Module B has no A->B message yet (unary 0),
            # and the first E3's evidence is already fixed by the initial q(rho), so the field is calibrated for
            # round 1 here exactly as every later round calibrates it for the next.
            evidence = [turbo.support_evidence(state[f"{i.name}.a_tilde"], state[f"{i.name}.b_tilde"], i.prior)
                        for i in self.layers]
            pis, state["field"], _ = self._module_b([np.zeros(i.grid) for i in self.layers], evidence, 0,
                                                    state["field"])
            state |= {f"{info.name}.pi_logodds": pi for info, pi in zip(self.layers, pis, strict=True)}
        return state

    def support(self, state: State, info: LayerInfo) -> np.ndarray:
        """S of a layer: the nonzeros of its mu_G in float16, the weights the downlink carries."""
        return turbo.support(state[f"{info.name}.mu"])

    @property
    def trained_model(self) -> bool:
        """``global_model = "trained"``: the round's model is its aggregate on the support its clients trained."""
        return self.cfg.dturbo.global_model == "trained"

    def model_mu(self, state: State, info: LayerInfo) -> np.ndarray:
        """A layer's weights in the round's model (:meth:`global_model`): mu_G, or with ``global_model = "trained"``
        the round's aggregate before the support rule (§7.5) cut it."""
        return state[f"{info.name}.mu_trained" if self.trained_model else f"{info.name}.mu"]

    def prior_std(self, state: State, info: LayerInfo) -> np.ndarray:
        """(E5) sigma_prior = sqrt(b~ / a~) per weight."""
        return vbi.prior_std(state[f"{info.name}.a_tilde"], state[f"{info.name}.b_tilde"])

    # -------------------------------------------------------------- downlink
    def downlink(self, state: State, round_idx: int) -> bytes:
        """Cluster-coded mu_G (its nonzeros are S), sigma_G, sigma_prior on S (E5), biases (§7.1, 9).
        With ``transmission.down_bits`` < 16: S's cluster-coded positions, then mu_G on S quantised (unbiased
        stochastic rounding, seeded by the round); with ``prior_std = "rebuilt"`` no sigma_prior. With ``positions
        = "delta"``: the downlink of a client that holds no support."""
        return self.messages.encode_downlink(self._downlink_record(state, round_idx), self.plain.encode_state(state))

    def downlinks(self, state: State, round_idx: int, clients: list[int]) -> dict[int, bytes]:
        """Each selected client's downlink. With ``positions = "delta"`` each client's S is coded against the
        support it holds (``held_round``; none known: whole); else one broadcast."""
        if not self.messages.delta:
            return super().downlinks(state, round_idx, clients)
        bases = {cid: int(state["held_round"][cid]) for cid in clients}
        return self.messages.encode_downlinks(self._downlink_record(state, round_idx), self.plain.encode_state(state),
                                              bases, self.held_supports(state, set(bases.values())),
                                              self.held_weights(state, clients))

    def evaluation_downlink(self, state: State, round_idx: int) -> bytes:
        """The round's model (:meth:`global_model`) as the downlink of a client that holds nothing: what BatchNorm
        calibration measures and Flower's federated evaluation tests."""
        if self.trained_model:
            state = dict(state) | {f"{i.name}.mu": self.model_mu(state, i) for i in self.layers}
        return self.downlink(state, round_idx)

    def _held_state(self) -> list[tuple[str, tuple[int, ...]]]:
        """``down_mu = "update"``: the state's key and shape of each entry of ``HeldWeights``, in its order
        (``held_mu.<layer>``, then with ``biases = "as_mu"`` ``held_bias.<layer>``)."""
        return [(f"held_{kind}.{n}", shape) for n, kind, shape in self.messages.held_entries()]

    def held_weights(self, state: State, clients: list[int]) -> dict[int, list[np.ndarray]]:
        """``down_mu = "update"``: the weights each of ``clients`` that holds a downlink holds (none: absent)."""
        if not self.messages.update:
            return {}
        entries = self._held_state()
        return {cid: [state[key][cid].reshape(shape) for key, shape in entries]
                for cid in clients if int(state["held_round"][cid]) != NO_BASE}

    def held_supports(self, state: State, rounds: set[int]) -> HeldSupports:
        """The supports of ``rounds`` some client holds (every client that holds round b's holds the same: S_b)."""
        return {b: self.held.supports(state, int(np.flatnonzero(state["held_round"] == b)[0]))
                for b in rounds - {NO_BASE}}

    def _downlink_record(self, state: State, round_idx: int) -> DturboDownlink:
        sent = self.cfg.dturbo.transmission.prior_std == "sent"
        layers = []
        for info in self.layers:
            n = info.name
            mask = self.support(state, info)
            layers.append(DownLayer(mu=state[f"{n}.mu"] * mask, support=mask,
                                    sigma=sigma_as_sent(state[f"{n}.sigma"], mask),
                                    prior_std=self.prior_std(state, info)[mask] if sent else None,
                                    bias=state[f"{n}.bias"]))
        return DturboDownlink(round_idx, self.total_samples, layers, {})

    # ------------------------------------------------------------- aggregate
    def decode_uplink(self, state: State, data: bytes, round_idx: int | None = None) -> DturboUplink:
        """Decode and validate one client's upload against this round's supports; raises MessageError /
        CodecError with a reason."""
        supports = [int(self.support(state, info).sum()) for info in self.layers]
        return self.messages.decode_uplink(data, supports, round_idx, self.total_samples)

    def bounds(self, state: State, round_idx: int) -> UploadBounds:
        """Per layer: mu on S (for updates, the weights they make) and the biases within the magnitude of the global
        layer, sigma > 0 within the growth of the global sigma (:mod:`~dturbo.algorithms.bounds`)."""
        updates = self.messages.up_values.sends_update
        limits = {}
        for info in self.layers:
            n = info.name
            mu, bias = state[f"{n}.mu"], state[f"{n}.bias"]
            largest = magnitude(mu, bias)
            limits[f"{n}.mu"] = Limit(largest, mu[self.support(state, info)] if updates else None)
            limits[f"{n}.bias"] = Limit(largest, bias if self.messages.bias_up else None)
            limits[f"{n}.sigma"] = Limit(sigma_limit(state[f"{n}.sigma"]), positive=True)
        return UploadBounds(limits, self.partitions)

    def rows(self, state: State, uploads: list[DturboUplink]) -> tuple[list[np.ndarray], np.ndarray]:
        """Each upload's (mu on S, sigma as sent, bias) of every layer as one vector, and the global values they move
        from (for an update, 0 on S)."""
        updates = self.messages.up_values.sends_update
        reference = []
        for info in self.layers:
            n, mask = info.name, self.support(state, info)
            mu = state[f"{n}.mu"][mask]
            bias = state[f"{n}.bias"]
            reference += [np.zeros(mu.size) if updates else mu, sigma_as_sent(state[f"{n}.sigma"], mask),
                          np.zeros(bias.size) if self.messages.bias_up else bias]
        rows = [np.concatenate([np.concatenate([(x := u.layers[i.name]).mu, x.sigma, x.bias]).astype(np.float64)
                                for i in self.layers]) for u in uploads]
        return rows, np.concatenate([np.asarray(r, np.float64).reshape(-1) for r in reference])

    def _combined(self, state: State, got: Received[DturboUplink]
                  ) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per layer, the combination of the uploads' (mu on S, sigma as sent, bias): their weighted mean, or
        ``[robust]``'s rule on the whole vectors (the global values as the reference of an update)."""
        p, ups = got.p, got.uploads
        if self.robust.plain:
            out = {}
            for info in self.layers:
                mine = [u.layers[info.name] for u in ups]
                out[info.name] = (sum(pt * x.mu.astype(np.float64) for pt, x in zip(p, mine, strict=True)),
                                  sum(pt * x.sigma.astype(np.float64) for pt, x in zip(p, mine, strict=True)),
                                  sum(pt * x.bias for pt, x in zip(p, mine, strict=True)))
            return out
        rows, reference = self.rows(state, ups)
        flat = self.robust.combine(rows, p, reference, len(got.rejected))
        out, pos = {}, 0
        for info in self.layers:
            first = ups[0].layers[info.name]
            ends = np.cumsum([pos, first.mu.size, first.sigma.size, first.bias.size])
            out[info.name] = (flat[ends[0]:ends[1]], flat[ends[1]:ends[2]], flat[ends[2]:ends[3]])
            pos = int(ends[3])
        return out

    def aggregate(self, state: State, uplinks: list[bytes], round_idx: int, senders: list[int] | None = None
                  ) -> RoundResult:
        """Server step of docs/algorithm.md §7.3-7.5 on the uploads that decode and validate."""
        got = self.receive(state, uplinks, round_idx, senders)
        p, ups = got.p, got.uploads
        trained = [self.support(state, info) for info in self.layers]  # the S this round's clients trained on
        new = self.aggregate_plain(state, got)
        if self.messages.delta:
            new |= self._held_after(state, round_idx, trained, [u.client_id for u in ups])
        combined = self._combined(state, got)
        for info, mask in zip(self.layers, trained, strict=True):
            n = info.name
            mu_on_s, sig, bias = combined[n]
            mu = np.zeros(info.grid, dtype=np.float64)
            mu[mask] = mu_on_s
            if self.messages.up_values.sends_update:
                # Updates: added to the server's own mu_G, so the download's quantisation noise never enters it.
                mu[mask] += state[f"{n}.mu"][mask]
            if state[f"{n}.sigma"].size > 1:
                full = state[f"{n}.sigma"].astype(np.float64).reshape(info.grid).copy()
                full[mask] = sig
                sig = full.reshape(-1)
            new[f"{n}.mu"] = mu
            if self.trained_model:
                new[f"{n}.mu_trained"] = turbo.restrict_to_support(mu)
            new[f"{n}.sigma"] = np.asarray(sig, dtype=np.float32).reshape(state[f"{n}.sigma"].shape)
            if self.messages.bias_up:  # an update, added to the server's own biases as mu's is
                bias = bias + state[f"{n}.bias"]
            new[f"{n}.bias"] = np.asarray(bias).astype(np.float32)
        t0 = time.perf_counter()
        metrics = self._server_step(new, trained, round_idx)
        metrics["server_seconds"] = round(time.perf_counter() - t0, 3)
        nll = turbo.exact_sum(p * np.array([u.nll for u in ups], dtype=np.float64))
        metrics["train_nll"] = nll
        # The (tempered, beta != 1) negative ELBO of E6 summed over the clients: n * E[-ln p(y|x,w)] + beta * KL,
        # the NLL estimated by the clients' mean training loss. E3/E4 minimise the KL whatever beta is.
        kl = metrics["kl_w"] + metrics["kl_rho"] + metrics["kl_s"]
        metrics["neg_elbo"] = self.total_samples * nll + self.cfg.dturbo.beta * kl
        metrics |= got.counts()
        return RoundResult(state=new, metrics=metrics, rejected=got.rejected)

    def _held_after(self, state: State, round_idx: int, trained: list[np.ndarray], senders: list[int]) -> State:
        """``positions = "delta"``: what each client holds after this round. A client selected this round whose
        upload is valid decoded the downlink, so it holds this round's S (``trained``; and with ``down_mu =
        "update"`` the weights it decoded, coded again here exactly as its downlink was); one selected without a
        valid upload (dropped, late, failed, rejected) may or may not have decoded it, so the server assumes nothing
        and sends it S whole (and mu_G from zeros) next time; the others keep theirs."""
        selected = self.select_clients(round_idx)
        out = self.held.after_round(state, round_idx, selected, senders, trained)
        confirmed = out["held_round"] == round_idx
        if self.messages.update:
            record = self._downlink_record(state, round_idx)  # what was sent, to code each update again
            weights = {key: state[key].copy() for key, _ in self._held_state()}
            before = self.held_weights(state, np.flatnonzero(confirmed).tolist())
            for key in weights:
                weights[key][selected] = 0
            for cid in np.flatnonzero(confirmed):
                after = self.messages.encode_update(record, int(cid), before.get(int(cid)))[1]
                for key, w in zip(weights, after, strict=True):
                    weights[key][cid] = w.reshape(-1)
            out |= weights
        return out

    def _server_step(self, state: State, trained: list[np.ndarray], round_idx: int) -> dict[str, float]:
        """The turbo step E3 -> E4 -> E1 -> SPMP -> E2 -> support (docs/algorithm.md §7.3-7.5) of every layer on the
        aggregated ``state``, whose clients trained on the supports ``trained``. Mutates ``state``."""
        d = self.cfg.dturbo
        layers = [LayerState.load(state, info.name) for info in self.layers]
        halves = [turbo.module_a(layer, mask, info.prior, d.gamma_update)  # E3 -> E4 -> E1
                  for info, layer, mask in zip(self.layers, layers, trained, strict=True)]
        kl = dict.fromkeys(("kl_w", "kl_rho", "kl_s"), 0.0)
        for a in halves:
            for key, value in a.kl.items():
                kl[key] += value
        # SPMP -> E2 on every grid, with the prior's field set by the sparsity policy for the next round.
        pis, state["field"], iters = self._module_b([a.eta for a in halves], [a.eta_next for a in halves],
                                                    round_idx + 1, state["field"])
        # Support rule (§7.5); in target mode only after the warm-up rounds.
        threshold_logodds = float(vbi.safe_logit(d.support_threshold))
        decide = self.sparsity.decides_support(round_idx)
        for info, layer, mask, a, pi_logodds in zip(self.layers, layers, trained, halves, pis, strict=True):
            mu = turbo.support_rule(layer.mu, mask, a.pi_tilde_logodds, threshold_logodds, decide)
            state |= LayerState(mu, layer.sigma, pi_logodds, a.a_tilde, a.b_tilde).entries(info.name)
        if self.dead_units is not None and decide:
            cut = self.dead_units.cut([state[f"{info.name}.mu"] for info in self.layers])
            state |= {f"{info.name}.mu": mu for info, mu in zip(self.layers, cut, strict=True)}
        # Metrics of the new state.
        total = kept = 0
        flops = flops_kept = 0.0
        layer_density = {}
        for info in self.layers:  # of the round's model
            mask = turbo.support(self.model_mu(state, info))
            total += mask.size
            kept += int(mask.sum())
            flops += info.cost
            flops_kept += float(mask.sum()) * info.uses
            layer_density[f"density_{info.name}"] = float(mask.mean())
        decided = sum(int(turbo.support(state[f"{info.name}.mu"]).sum()) for info in self.layers)
        return {
            "density": kept / total,
            # The support this round decides, which the next round trains: "density" with global_model = "cut".
            "support_density": decided / total,
            # Over every value of the model: what travels dense beside the supports, and all that is nonzero.
            "dense_share": self.dense_values / (total + self.dense_values),
            "density_all": (kept + self.dense_values) / (total + self.dense_values),
            **({"flops_density": flops_kept / flops} if d.sparsity.budget == "flops" else {}),
            **kl,
            "spmp_iters": float(iters),
            "field_mean": turbo.exact_sum(state["field"]) / len(self.layers),
            # The density the support this round decides was calibrated to (by the previous round's Module B, or init).
            "scheduled_density": self.sparsity.scheduled_density(round_idx),
            **layer_density,
        }

    def _module_b(self, eta: list[np.ndarray], eta_next: list[np.ndarray], next_round: int,
                  previous: np.ndarray) -> tuple[list[np.ndarray], np.ndarray, int]:
        """SPMP -> E2 on every grid with unary ``eta`` (E1) plus the field the sparsity policy sets for round
        ``next_round`` (from ``eta_next``, that round's E3 evidence, and the ``previous`` fields). Returns the B->A
        message logit(pi) of every layer that round's E3 will use, the fields, and the most SPMP iterations a layer
        used."""
        fields = self.sparsity.fields(eta, eta_next, next_round, previous)
        out = [turbo.module_b(ev, info.prior, h, self.cfg.dturbo.spmp)
               for info, ev, h in zip(self.layers, eta, fields, strict=True)]
        return [pi for pi, _ in out], np.asarray(fields, dtype=np.float64), max((it for _, it in out), default=0)

    # ------------------------------------------------------------ the model
    def global_model(self, state: State) -> nn.Module:
        """The global model with mean weights mu_G on S (zeros elsewhere; with ``global_model = "trained"`` the
        round's aggregate on the support its clients trained), in eval mode."""
        model = self.model_factory()
        for info, (_, layer) in zip(self.layers, bayesian_layers(model), strict=True):
            n = info.name
            mu = self.model_mu(state, info)
            load_layer(layer, mu, turbo.support(mu), state[f"{n}.sigma"],
                        state[f"{n}.bias"] if layer.bias is not None else None, self.prior_std(state, info))
        self.plain.load_state(model, state)
        return model.eval()

    def support_messages(self, state: State) -> dict[str, np.ndarray]:
        """pi (the B->A message, E2) and the support mask of every layer, as grids (for Fig. 3)."""
        out = {}
        for info in self.layers:
            out[f"{info.name}.pi"] = expit(state[f"{info.name}.pi_logodds"]).astype(np.float16)
            out[f"{info.name}.mask"] = self.support(state, info).astype(np.uint8)
        return out


