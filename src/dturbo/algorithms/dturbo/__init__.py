"""D-Turbo-VBI, one package: its server half (:mod:`.server`, on the shared skeleton :mod:`dturbo.algorithms.server`),
its client half (:mod:`.client`), the bytes of its two messages (:mod:`.messages`), its config section
(:mod:`.config`), the warnings a run raises before it starts (:mod:`.checks`) and its view of a model's layers
(:mod:`.layers`); :data:`SPEC` registers it.

One round (docs/algorithm.md §7): the server sends mu_G on S, sigma_G and sigma_prior on S (E5); a client sets
mu, sigma from it, trains (E6) on the support only and uploads mu on the support (canonical row-major order, no
positions), sigma, biases and n_t; the server aggregates the uploads that decode and validate, then runs the turbo
step of :mod:`dturbo.algorithms.dturbo.turbo` (E3 -> E4 -> E1 -> SPMP -> E2 -> support) with the field of Module B set
by the sparsity
policy of :mod:`dturbo.algorithms.dturbo.sparsity`. State outside the Bayesian layers (BatchNorm, ... of a model of
one's own) travels
dense both ways (:mod:`dturbo.algorithms.plain`).

The support S travels implicitly as the nonzeros of the cluster-coded mu_G (docs/algorithm.md §9). To keep that exact,
S *is* the nonzeros of mu_G in float16 (:func:`dturbo.algorithms.dturbo.turbo.support`), derived from the state, never
stored: a weight
whose mean rounds to zero in 16-bit transmission leaves S, and a weight (re-)entering S restarts from the smallest
normal float16, 2^-14, instead of exactly 0 (docs/algorithm.md §7 says "restarts from 0"; 2^-14 ~ 6e-5 is 0 for every
practical purpose).

The server state (checkpointed) holds, per Bayesian layer ``name``: the fields of
:class:`dturbo.algorithms.dturbo.turbo.LayerState`
(``name.mu``, ``name.sigma``, ``name.pi_logodds``, ``name.a_tilde``, ``name.b_tilde``) and ``name.bias``; ``field``:
the field of every layer's Module B in its last SPMP (the sparsity policy starts its next search there); and the
plain state. With ``transmission.positions = "delta"`` also what each client holds (docs/communication.md,
"Positions"): ``held_round`` (per client, the round of the downlink whose S it holds, -1: none known) and
``held.name`` (per client, that S as packed bits), so that a resumed run codes the same differences; with
``down_mu = "update"`` also ``held_mu.name`` (per client, the weights it holds from that downlink, float32, 0 off S)
and with ``biases = "as_mu"`` ``held_bias.name`` (the biases it holds).
"""

from __future__ import annotations

from ...protocol import AlgorithmSpec
from .checks import run_warnings
from .client import DturboClient
from .config import DturboConfig, describe
from .layers import layer_infos, rebuilt_prior_std, sigma_grid_on, sigma_options
from .server import DturboServer

__all__ = ["SPEC", "DturboClient", "DturboConfig", "DturboServer", "layer_infos", "rebuilt_prior_std", "sigma_grid_on"]

SPEC = AlgorithmSpec("dturbo", DturboConfig, DturboServer, DturboClient, default_lr=5e-3, label="D-Turbo-VBI",
                     run_warnings=run_warnings, model_options=sigma_options,
                     describe=describe)
