"""The sparsity policy of D-Turbo-VBI: the replaceable part of the server step (docs/algorithm.md §11,
docs/sparsity.md).

The literal algorithm decides the support by pi~ >= threshold alone, and its density is all-or-nothing in the
prior ratio r (§11). A policy makes it controllable through two levers of the turbo step
(:mod:`dturbo.algorithms.dturbo.turbo`):
whether a round's support rule applies at all (warm-up), and the field h of Module B's prior, a log-odds of
activity on every node of a layer's grid, which enters the B -> A message (E2) and so the next E3.

:class:`SparsityPolicy` is that interface; :func:`make_policy` builds the one ``[dturbo.sparsity] mode`` names:

* ``"prior"``: :class:`LiteralPrior`, no field, the support rule every round;
* ``"target"``: :class:`TargetDensity`, a density schedule (:func:`density_schedule`, its warm-up and ramp paced by
  local training unless set in rounds: :func:`pruning_schedule`) and a field calibrated each
  round so that the next support has the scheduled density, counted in weights or in multiply-adds
  (:func:`budget_sizes`), per layer or over the model, with named layers on their own targets
  (:func:`layer_targets`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ...config import ConfigError
from ...nn.shapes import erk_densities
from ..local import num_local_steps
from . import vbi
from .turbo import LayerInfo, module_b

if TYPE_CHECKING:
    from ...config import TrainConfig
    from .config import DturboConfig, SparsityConfig


class SparsityPolicy(Protocol):
    """What the server step asks the sparsity policy (docs/algorithm.md §11)."""

    def scheduled_density(self, round_idx: int) -> float:
        """The density the support chosen in round ``round_idx`` (0-based) is calibrated to; NaN if none."""
        ...

    def decides_support(self, round_idx: int) -> bool:
        """Whether round ``round_idx``'s support rule applies (§7.5); else the support stays as it is."""
        ...

    def steers(self, round_idx: int) -> bool:
        """Whether Module B's field is calibrated for the support of round ``round_idx`` (at initialisation: whether
        Module B runs before round 0)."""
        ...

    def fields(self, eta: list[np.ndarray], eta_next: list[np.ndarray], next_round: int,
               previous: np.ndarray) -> np.ndarray:
        """The field h of every layer's Module B in this round's SPMP, whose message (E2) the E3 of round
        ``next_round`` uses. ``eta``: this round's E1 messages (SPMP's unary inputs); ``eta_next``: the evidences the
        next E3 adds to it; ``previous``: the fields of the last SPMP."""
        ...


# Once the schedule holds still (TargetDensity.calibrate_field, settled): the shortfall below the target accepted,
# as a fraction of it, and the most the field rises in one round to add weights (log-odds; e^4 ~ 55x prior odds).
SETTLED_SHORTFALL = 0.01
SETTLED_RISE = 4.0


def density_schedule(round_idx: int, *, target: float, warmup: int, ramp: int) -> float:
    """Scheduled support density of round ``round_idx`` in target mode: dense for ``warmup`` rounds, then a
    cubic ramp to ``target`` over ``ramp`` rounds (the gradual-pruning schedule of Zhu & Gupta, 2017)."""
    if round_idx < warmup:
        return 1.0
    progress = min(1.0, (round_idx - warmup + 1) / ramp)
    return target + (1.0 - target) * (1.0 - progress) ** 3


@dataclass(frozen=True)
class PruningSchedule:
    """The warm-up and ramp of :func:`density_schedule`, in rounds; ``paced``: derived from local steps (the
    warm-up, the ramp or both were not set in rounds)."""

    warmup: int
    ramp: int
    paced: bool = False

    def density(self, round_idx: int, target: float) -> float:
        """The scheduled density of round ``round_idx`` (0-based) for a final density ``target``."""
        return density_schedule(round_idx, target=target, warmup=self.warmup, ramp=self.ramp)

    @property
    def reached_at(self) -> int:
        """The 0-based round whose support first has the target density."""
        return self.warmup + self.ramp - 1


def local_steps_a_round(train: TrainConfig, total_samples: int, clients: int) -> int:
    """Local steps the mean client (``total_samples / clients`` samples) trains in a round, as
    :func:`dturbo.algorithms.local.num_local_steps` counts them."""
    return num_local_steps(train, max(1, round(total_samples / max(clients, 1))))


def pruning_schedule(sp: SparsityConfig, rounds: int, steps: int) -> PruningSchedule:
    """The schedule's warm-up and ramp in rounds (docs/sparsity.md §2, docs/models.md#tune-for-a-new-dataset).

    ``warmup_rounds`` and ``ramp_rounds`` as set; unset, each is paced by local training, ``steps`` local steps a
    round (:func:`local_steps_a_round`): the warm-up lasts until the clients have trained ``warmup_steps`` steps, so
    that the first support is chosen on a model that has learned something rather than on its initial magnitudes
    (pruning an untrained network costs most of the accuracy that few local steps a round lose, docs/sparsity.md);
    the ramp lasts ``ramp_steps`` steps. Both are capped to fit the run: the warm-up takes at most
    ``(rounds - 1) // 2`` rounds (and leaves an explicit ramp room to end) and the ramp ends at the latest one round
    before the last (so one round trains at the target): a paced schedule always reaches ``target_density``, and a
    half-paced one whenever its explicit half fits the run. Rounds set explicitly are kept as they are (a ramp that
    ends after the run is :func:`dturbo.algorithms.dturbo.checks.schedule_warning`'s business)."""
    steps = max(int(steps), 1)
    warmup = sp.warmup_rounds
    if warmup is None:
        warmup = min(math.ceil(sp.warmup_steps / steps), max(rounds - 1, 0) // 2)
        if sp.ramp_rounds is not None:  # leave an explicit ramp room to end within the run where it can
            warmup = min(warmup, max(rounds - sp.ramp_rounds, 0))
    ramp = sp.ramp_rounds
    if ramp is None:
        ramp = max(1, min(math.ceil(sp.ramp_steps / steps), rounds - warmup - 1))
    return PruningSchedule(warmup, ramp, paced=sp.warmup_rounds is None or sp.ramp_rounds is None)


def budget_sizes(layers: list[LayerInfo], sp: SparsityConfig) -> np.ndarray:
    """What one layer's full support counts in the density budget: its weights (``budget = "weights"``) or
    its multiply-adds for one sample (``"flops"``)."""
    if sp.budget == "flops":
        return np.array([info.cost for info in layers], dtype=np.float64)
    return np.array([float(np.prod(info.grid)) for info in layers], dtype=np.float64)


# Keys of ``sparsity.layer_targets`` that select layers by position or group instead of by name, so that one setting
# fits any model: a layer's own name first, then its position, then its position in a group, then its group. The
# groups: the layers whose rows are tied (``tied``: whole channels or units, [dturbo.prior] tie_rows) and the kinds.
KINDS = ("conv", "dense")
GROUPS = ("tied", *KINDS)
SELECTORS = ("first", "last", *(f"{end}_{group}" for group in GROUPS for end in ("first", "last")), *GROUPS)


def resolve_layer_targets(names: list[str], kinds: list[str], targets: dict[str, float],
                          tied: list[bool] | None = None) -> dict[str, float]:
    """``layer_targets`` as layer names: ``first`` / ``last`` (the first / last Bayesian layer), ``first_tied`` ..
    ``last_dense`` (the first / last layer of a group), ``tied`` / ``conv`` / ``dense`` (every layer of the group:
    ``tied``, the layers whose rows ``tied`` marks) or a name; a name wins over a position, a position over a
    position in a group, that over a group, and ``tied`` over a kind. A key that is neither a selector nor a layer
    of the model is a ConfigError naming the layers."""
    unknown = sorted(set(targets) - set(names) - set(SELECTORS))
    if unknown:
        raise ConfigError(f"dturbo.sparsity.layer_targets names {', '.join(map(repr, unknown))}, which the model "
                          f"does not have; its layers: {', '.join(names)} (or select them by "
                          f"{', '.join(SELECTORS)})")
    tied = tied or [False] * len(names)
    groups = [("tied", kind) if t else (kind,) for kind, t in zip(kinds, tied, strict=True)]
    members = {g: [i for i, gs in enumerate(groups) if g in gs] for g in GROUPS}
    out: dict[str, float] = {}
    for i, name in enumerate(names):
        # a layer both first and last (of the model or a group) answers to either, "first" first
        position = [end for end, j in (("first", 0), ("last", len(names) - 1)) if i == j]
        among = [f"{end}_{g}" for g in groups[i] for end, j in (("first", 0), ("last", -1)) if i == members[g][j]]
        for key in (name, *position, *among, *groups[i]):
            if key in targets:
                out[name] = targets[key]
                break
    return out


def layer_targets(layers: list[LayerInfo], sp: SparsityConfig) -> np.ndarray:
    """Final support density of every layer in target mode (``sparsity.layer_targets``, names or selectors:
    :func:`resolve_layer_targets`; a layer that keeps dense, :attr:`LayerInfo.keep_dense`: 1 unless its name or
    position is named; with scope 'global', the layers ``sparsity.distribution`` gives to the Erdos-Renyi-kernel
    rule: :func:`erk_densities`), NaN for layers that share one field (scope 'global'). A clear error for unknown
    layers, or targets by name or position that leave the other layers no room in the global budget; a warning when
    targets by group (written for any model) leave them none (they take the nearest density they can), or when
    every layer has a target (they set the model's density, not target_density)."""
    names = [info.name for info in layers]
    kinds = [info.kind for info in layers]
    tied = [info.prior.tie_rows for info in layers]
    named = resolve_layer_targets(names, kinds, dict(sp.layer_targets), tied)
    # a layer that keeps dense yields to its name or position, not to a whole group
    specific = resolve_layer_targets(names, kinds, {k: v for k, v in sp.layer_targets.items() if k not in GROUPS},
                                     tied)
    named |= {info.name: 1.0 for info in layers if info.keep_dense and info.name not in specific}
    default = np.nan if sp.scope == "global" else sp.target_density
    out = np.array([named.get(n, default) for n in names], dtype=np.float64)
    shared = np.isnan(out)
    sizes = budget_sizes(layers, sp)
    if sp.scope == "global" and named:
        if not shared.any():  # every layer has its own target: together they set the model's density
            overall = float((out * sizes).sum() / sizes.sum())
            if abs(overall - sp.target_density) > 0.005:
                warnings.warn(f"dturbo.sparsity.layer_targets {dict(sp.layer_targets)} give every layer of this "
                              f"model its own target: it ends at {overall:.1%} of its weights, and target_density = "
                              f"{sp.target_density} is not used", UserWarning, stacklevel=2)
            return out
        left = sp.target_density * sizes.sum() - (out[~shared] * sizes[~shared]).sum()
        if not 0 < left <= sizes[shared].sum():
            if not any(k in SELECTORS and k not in ("first", "last") for k in sp.layer_targets):
                raise ConfigError(
                    f"dturbo.sparsity.layer_targets {dict(sp.layer_targets)} with target_density "
                    f"{sp.target_density} (scope 'global'): the layers they name ({int((~shared).sum())} of "
                    f"{len(names)}) hold {(out[~shared] * sizes[~shared]).sum() / sizes.sum():.1%} of the model's "
                    f"weights at their targets, which leaves the other layers a density of "
                    f"{left / sizes[shared].sum():.4f}, outside (0, 1]: name fewer layers, lower their targets or "
                    f"raise target_density")
            # Targets by group are written for any model (a preset's): on one they do not fit, the other layers
            # take the nearest density they can, and the run says so before it starts.
            out[shared] = min(max(left / sizes[shared].sum(), sp.min_layer_density), 1.0)
            overall = float((out * sizes).sum() / sizes.sum())
            warnings.warn(f"dturbo.sparsity.layer_targets {dict(sp.layer_targets)} leave the other layers of this "
                          f"model no room in target_density = {sp.target_density}: they keep {out[shared][0]:.0%} "
                          f"and the model ends at {overall:.1%} of its weights", UserWarning, stacklevel=2)
            return out
    if sp.scope == "global":
        spread = shared & np.array([sp.distribution == "erk" or (sp.distribution == "auto" and info.normalised)
                                    for info in layers])
        if spread.any():
            # Every layer's share by the rule, the named ones fixed; the layers left to the field share the rest.
            erk = erk_densities([info.shape or info.grid for info in layers], sizes, sp.target_density,
                                np.where(shared, np.nan, out))
            out = np.where(spread, erk, out)
    return out


def make_policy(layers: list[LayerInfo], cfg: DturboConfig, schedule: PruningSchedule) -> SparsityPolicy:
    """The policy of ``cfg.sparsity.mode``; ``schedule``: the target mode's warm-up and ramp
    (:func:`pruning_schedule`). ``sparsity.layer_targets`` is checked against the layers in either mode (a
    ConfigError before the run starts)."""
    targets = layer_targets(layers, cfg.sparsity)
    if cfg.sparsity.mode == "prior":
        return LiteralPrior(len(layers))
    return TargetDensity(layers, cfg, targets, schedule)


class LiteralPrior:
    """``mode = "prior"``: the literal algorithm. The support rule applies every round, Module B has no field."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers

    def scheduled_density(self, round_idx: int) -> float:
        return float("nan")

    def decides_support(self, round_idx: int) -> bool:
        return True

    def steers(self, round_idx: int) -> bool:
        return False

    def fields(self, eta: list[np.ndarray], eta_next: list[np.ndarray], next_round: int,
               previous: np.ndarray) -> np.ndarray:
        return np.zeros(self.num_layers)


class TargetDensity:
    """``mode = "target"`` (docs/sparsity.md §2): dense for the schedule's warm-up (the support rule waits), then the
    support follows :func:`density_schedule` down to ``target_density``: the field of Module B's prior is
    calibrated every round so that the next support, {eta_next + logit(pi) >= logit(threshold)}, has the
    scheduled density."""

    def __init__(self, layers: list[LayerInfo], cfg: DturboConfig, targets: np.ndarray,
                 schedule: PruningSchedule) -> None:
        self.layers = layers
        self.sp = cfg.sparsity
        self.spmp = cfg.spmp
        self.targets = targets  # final density of the layers calibrated alone, NaN for those sharing one field
        self.schedule = schedule
        self.threshold_logodds = float(vbi.safe_logit(cfg.support_threshold))

    def scheduled_density(self, round_idx: int) -> float:
        return self.schedule.density(round_idx, self.sp.target_density)

    def decides_support(self, round_idx: int) -> bool:
        return round_idx >= self.schedule.warmup

    def steers(self, round_idx: int) -> bool:
        return self.scheduled_density(round_idx) < 1.0

    def fields(self, eta: list[np.ndarray], eta_next: list[np.ndarray], next_round: int,
               previous: np.ndarray) -> np.ndarray:
        if not self.steers(next_round):
            return np.zeros(len(self.layers))
        targets = np.array([np.nan if np.isnan(t) else self.schedule.density(next_round, float(t))
                            for t in self.targets])
        # Round reached_at is the first at the target; from the next one on the schedule holds still.
        settled = next_round > self.schedule.reached_at
        return self.calibrate_field(eta, eta_next, self.scheduled_density(next_round), targets, previous,
                                    settled=settled)

    def calibrate_field(
        self, eta: list[np.ndarray], eta_next: list[np.ndarray], density: float, targets: np.ndarray,
        previous: np.ndarray, *, settled: bool = False,
    ) -> np.ndarray:
        """Field h of the MRF prior such that the support of the next round,
        {eta_next + lo_h(h) >= logit(threshold)}, has the scheduled density. SPMP runs on this round's
        E1 message ``eta``; ``eta_next`` is the next E3's evidence, already fixed by this round's E4, so
        the prediction is exact (bisection on h, bracketed around the previous round's field; the
        predicted density is monotone in h). ``targets`` holds this round's density of layers calibrated alone
        (scope 'layer', or ``layer_targets``), NaN for layers that share one h (scope 'global': they keep
        different densities and together take what the others leave of ``density``). A layer never goes below
        min_layer_density.

        ``settled``: the schedule already held this target last round. Then a support up to SETTLED_SHORTFALL
        (relative) below the target is accepted, and the field rises by at most SETTLED_RISE to add weights: when
        even that adds too few, the evidence refuses them and the field stays (docs/sparsity.md §2). Without this
        the bracket would widen until pi was ~1 on every weight to add a few dozen."""
        sp = self.sp
        L = len(self.layers)
        thr_lo = self.threshold_logodds
        sizes = budget_sizes(self.layers, sp)
        # The shared field is a log-odds against activity per unit of cost: with budget "flops" a weight that
        # does u multiply-adds a sample gets (u / the shared layers' mean u) ** cost_power times it, so the costly
        # layers (early convolutions) are thinned hardest and the cheap dense layers keep more.
        scale = np.ones(L)
        if sp.budget == "flops":
            uses = np.array([info.uses for info in self.layers], dtype=np.float64)
            weights = np.array([float(np.prod(info.grid)) for info in self.layers])
            shared_idx = np.isnan(targets)
            if shared_idx.any():
                mean_use = (uses * weights)[shared_idx].sum() / weights[shared_idx].sum()
                scale = np.where(shared_idx, (uses / mean_use) ** sp.cost_power, 1.0)

        def layer_density(i: int, h: float) -> float:
            lo_h, _ = module_b(eta[i], self.layers[i].prior, h * scale[i], self.spmp)
            return float(np.mean(eta_next[i] + lo_h >= thr_lo))

        def dens_at(h: float, idx: list[int]) -> float:
            return sum(layer_density(i, h) * sizes[i] for i in idx) / sizes[idx].sum()

        def solve(target: float, idx: list[int], start: float, at_least: bool = False) -> float:
            tol = max(5e-4, SETTLED_SHORTFALL * target) if settled and not at_least else 5e-4

            def met(dens: float) -> bool:
                return 0.0 <= (dens - target if at_least else target - dens) < tol

            # A field that already gives the scheduled support is kept. Once the support has settled, a whole range
            # of fields gives the same support (its evidences are far apart); any other point of that range would
            # let the field drift round after round (the bracket widens to hi = start + 4 + 16k and bisection
            # returns its middle), until the message pi is 1 everywhere.
            if met(dens_at(start, idx)):
                return start
            # The field moves little between rounds: bracket around the last one, widen if needed.
            lo, hi = start - 4.0, start + 4.0
            while dens_at(lo, idx) > target and lo > -200:
                lo -= 16.0
            if settled and not at_least:
                # Settled: a rise of at most SETTLED_RISE, or none when that cannot reach the target.
                hi = start + SETTLED_RISE
                if dens_at(hi, idx) < target - tol:
                    return start
            else:
                while dens_at(hi, idx) < target and hi < 200:
                    hi += 16.0
            # Density rises with h; lo stays at or under the target, so the schedule is never exceeded
            # ("at most 25% nonzero" means at most). It is approached from below within tol unless the density
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
