"""The D-Turbo-VBI server step on one layer, as math (docs/algorithm.md §4-8): no wire format, no config parsing.

One round of the server, with the clients' aggregated moments mu_G, sigma_G (§7.3-7.5):

    E1    eta          = ln C1 - ln C2 - logit(pi)          the A -> B message, from the current q(rho)
    E3    logit(pi~)   = logit(pi) + eta                    q(s), with the current q(rho)
    E4    a~, b~       = pi~ (a, b) + (1 - pi~) (a_bar, b_bar) + (1/2, (mu_G^2 + sigma_G^2) / 2)
    SPMP  belief       = grid_bp(eta + h)                   Module B on the layer's grid, with the field h
    E2    logit(pi)    = belief - eta                       the B -> A message, for the next round's E3
    §7.5  S            = {pi~ >= threshold}, then restricted to the float16 nonzeros of mu_G

It comes in two halves, :func:`module_a` (E3, E4, E1) and :func:`module_b` (SPMP, E2), and the support rule
:func:`support_rule`, because the field h is the sparsity policy's (:mod:`dturbo.algorithms.dturbo.sparsity`,
docs/algorithm.md §11):
it is chosen for every layer at once from every layer's Module A output, between the two halves.

A layer's state between rounds is :class:`LayerState`. The support S is not part of it: S is the nonzeros of mu_G
in float16 (:func:`support`), exactly what the downlink's cluster coding carries, so the server and the clients
cannot disagree on it. q(s) is not part of it either: pi~ is a temporary of the step (the next E3 recomputes it
from pi and q(rho)), as are the messages eta.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from scipy.special import expit

from . import vbi
from .prior import LayerPrior
from .spmp import grid_bp

if TYPE_CHECKING:
    from .config import SpmpConfig

# A weight (re-)entering S restarts from the smallest normal float16, 2^-14, instead of exactly 0 (docs/algorithm.md
# §7.5 says "restarts from 0"): it must be a nonzero of the 16-bit mu_G to be in S at all.
REENTRY_VALUE = float(2.0**-14)


@dataclass(frozen=True)
class LayerInfo:
    """A Bayesian layer as the server sees it: its name, its support grid (docs/algorithm.md §2) and prior."""

    name: str
    grid: tuple[int, int]
    prior: LayerPrior
    uses: int = 1  # multiply-adds each weight does for one sample (conv: output positions)
    kind: str = "dense"  # "conv" or "dense" (the prior section it takes)
    # Stays dense unless sparsity.layer_targets names it: a conv whose filters read one input channel, in a model
    # with BatchNorm (a filter of a few weights, pruned, detects something else, which BatchNorm scales back up).
    keep_dense: bool = False
    # BatchNorm over its output channels comes next (:func:`dturbo.algorithms.dturbo.layers.followed_by_batchnorm`):
    # the layer's scale is arbitrary, so its evidence cannot be weighed against other layers' (sparsity.distribution).
    normalised: bool = False
    shape: tuple[int, ...] = ()  # the weight tensor's shape; () for the grid's

    @property
    def cost(self) -> float:
        """Multiply-adds of the whole layer for one sample, dense."""
        return float(np.prod(self.grid)) * self.uses


@dataclass(frozen=True)
class LayerState:
    """One layer's part of the server state from one round to the next (docs/algorithm.md §7).

    Between rounds ``mu`` is float32 and exactly 0 off the support; within a step it is the clients' float64
    aggregate. The field names are the suffixes of the layer's entries in the checkpointed server state."""

    mu: np.ndarray  # (K, M) mu_G
    sigma: np.ndarray  # sigma_G, float32: (1,) one per layer, or (K*M,) one per weight
    pi_logodds: np.ndarray  # (K, M) float64 logit(pi): Module B's message (E2) that the next E3 uses
    a_tilde: np.ndarray  # (K, M) float64 shape of q(rho) (E4)
    b_tilde: np.ndarray  # (K, M) float64 rate of q(rho) (E4)

    @classmethod
    def load(cls, state: Mapping[str, Any], name: str) -> LayerState:
        """Layer ``name``'s record from a flat server state (entries ``name.mu``, ``name.sigma``, ...)."""
        return cls(**{f.name: state[f"{name}.{f.name}"] for f in dataclasses.fields(cls)})

    def entries(self, name: str) -> dict[str, np.ndarray]:
        """The flat server state's entries of layer ``name`` (the inverse of :meth:`load`)."""
        return {f"{name}.{f.name}": getattr(self, f.name) for f in dataclasses.fields(self)}


def support(mu: np.ndarray) -> np.ndarray:
    """S: the weights whose mean is nonzero in float16 (16-bit transmission, docs/algorithm.md §9)."""
    return np.float16(mu) != 0


def restrict_to_support(mu: np.ndarray) -> np.ndarray:
    """mu as the float32 mu_G of the state: exactly 0 wherever it is 0 in float16, so that :func:`support` of the
    result is the set of its nonzeros."""
    mu = np.asarray(mu).astype(np.float32)
    return np.where(support(mu), mu, np.float32(0.0))


def sigma_grid(sigma: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """sigma_G on the layer's grid, float64: its one value everywhere, or its per-weight values."""
    sigma = np.asarray(sigma, dtype=np.float64)
    return sigma.reshape(grid) if sigma.size > 1 else np.full(grid, float(sigma.reshape(-1)[0]))


def tie_rows(evidence: np.ndarray, prior: LayerPrior) -> np.ndarray:
    """The E1 message of a layer with tied rows (``prior.tie_rows``): all weights of a row share one support
    variable, whose evidence is the sum of theirs (broadcast over the row, so E3 gives every weight the row's
    posterior). Untied layers: ``evidence`` as it is."""
    if not prior.tie_rows:
        return evidence
    return np.broadcast_to(evidence.sum(1, keepdims=True), evidence.shape).copy()


def support_evidence(a_tilde: np.ndarray, b_tilde: np.ndarray, prior: LayerPrior) -> np.ndarray:
    """(E1) eta = ln C1 - ln C2 - logit(pi) of every support variable under q(rho) = Gamma(a~, b~): the A -> B
    message, i.e. logit(pi~) - logit(pi) of (E3), computed without pi
    (:func:`dturbo.algorithms.dturbo.vbi.support_evidence`)."""
    return tie_rows(vbi.support_evidence(a_tilde, b_tilde, **prior.gamma_kwargs()), prior)


@dataclass(frozen=True)
class ModuleA:
    """Module A's half of the step on one layer (E3, E4, E1), and what the sparsity policy reads of it."""

    pi_tilde_logodds: np.ndarray  # (E3) logit(pi~), with the q(rho) of the round's start
    a_tilde: np.ndarray  # (E4) with pi~ and the aggregated moments
    b_tilde: np.ndarray
    eta: np.ndarray  # (E1) this round's A -> B message: Module B's unary input
    eta_next: np.ndarray  # the next round's E1, already fixed by this E4 (what the next E3 will add to pi)
    kl: dict[str, float]  # the layer's KL terms of the negative ELBO after E3 and E4 (:func:`kl_terms`)


def module_a(layer: LayerState, trained: np.ndarray, prior: LayerPrior,
             gamma_update: Literal["exact", "paper"]) -> ModuleA:
    """E3 with the current q(rho), E4 with the new q(s) and the aggregated moments ``layer.mu``, ``layer.sigma``;
    its data-dependent part is the A -> B message E1. ``trained``: the support the clients trained this round."""
    g = prior.gamma_kwargs()
    sigma = sigma_grid(layer.sigma, layer.mu.shape)
    eta = support_evidence(layer.a_tilde, layer.b_tilde, prior)  # (E1)
    pi_tilde_logodds = layer.pi_logodds + eta  # (E3)
    a_tilde, b_tilde = vbi.precision_posterior(expit(pi_tilde_logodds), layer.mu, sigma, **g,
                                               form=gamma_update)  # (E4)
    kl = kl_terms(prior, trained, layer.mu, sigma, layer.pi_logodds, pi_tilde_logodds, a_tilde, b_tilde)
    eta_next = support_evidence(a_tilde, b_tilde, prior)
    return ModuleA(pi_tilde_logodds, a_tilde, b_tilde, eta, eta_next, kl)


def module_b(eta: np.ndarray, prior: LayerPrior, field: float, spmp: SpmpConfig) -> tuple[np.ndarray, int]:
    """SPMP on the layer's grid with unary eta + field (docs/algorithm.md §8), and the B -> A message (E2)
    logit(pi) = belief - eta, which includes the field (a factor of Module B's prior). Returns it with the
    iterations SPMP used."""
    if prior.tie_rows:
        # One variable per row: SPMP on the column chain of row evidences. The field stays a per-weight
        # log-odds (so tied and untied layers share its scale): a row of M weights gets M * field.
        row_field = field * eta.shape[1]
        res = grid_bp(eta[:, :1] + row_field, prior.transitions, max_iter=spmp.max_iter, tol=spmp.tol,
                      damping=spmp.damping)
        return np.broadcast_to(res.extrinsic + row_field, eta.shape).copy(), res.iterations
    res = grid_bp(eta + field, prior.transitions, max_iter=spmp.max_iter, tol=spmp.tol, damping=spmp.damping)
    return res.extrinsic + field, res.iterations


def support_rule(mu: np.ndarray, trained: np.ndarray, pi_tilde_logodds: np.ndarray, threshold_logodds: float,
                 decide: bool) -> np.ndarray:
    """§7.5: the next mu_G (float32), whose float16 nonzeros are the next support S. With ``decide``,
    S = {logit(pi~) >= logit(threshold)}: a weight leaving S is set to 0, a weight entering it restarts at
    :data:`REENTRY_VALUE`; without (a warm-up round), S stays the support the clients ``trained``. Either way a
    weight whose mean is 0 in float16 leaves S."""
    if decide:
        keep = pi_tilde_logodds >= threshold_logodds
        mu = np.where(keep & ~trained, REENTRY_VALUE, np.where(keep, mu, 0.0))
    else:
        keep = trained
    return restrict_to_support(np.where(keep, mu, 0.0))


def kl_terms(prior: LayerPrior, trained: np.ndarray, mu: np.ndarray, sigma: np.ndarray, pi_logodds: np.ndarray,
             pi_tilde_logodds: np.ndarray, a_tilde: np.ndarray, b_tilde: np.ndarray) -> dict[str, float]:
    """One layer's KL terms of the negative ELBO (docs/algorithm.md §5-6) after this round's E3 and E4: q(w) on
    the support the clients trained (weights off it are exactly 0, outside the model), q(rho) of every weight, q(s)
    of every support variable (one per row when rows are tied) against Module B's pi."""
    pi_tilde = expit(pi_tilde_logodds)
    g = prior.gamma_kwargs()
    variables = (slice(None), slice(0, 1)) if prior.tie_rows else (slice(None), slice(None))
    return {
        "kl_w": exact_sum(vbi.kl_weights(mu[trained], sigma[trained], a_tilde[trained], b_tilde[trained])),
        "kl_rho": exact_sum(vbi.kl_precision(pi_tilde, a_tilde, b_tilde, **g)),
        "kl_s": exact_sum(vbi.kl_support(pi_tilde[variables], expit(pi_logodds[variables]))),
    }


def exact_sum(values: np.ndarray) -> float:
    """Correctly rounded sum: numpy's SIMD sums depend on memory alignment, and metrics must be
    bit-identical between a resumed and an uninterrupted run."""
    return math.fsum(np.asarray(values, dtype=np.float64).ravel().tolist())
