"""Module B: loopy sum-product message passing (SPMP) on a layer's support grid (docs/algorithm.md §2, 4, 8).

The grid MRF of a layer (docs/algorithm.md §2) has, for every node s_n of the K x M grid,

- a unary input: the A -> B message of E1, given as log-odds ``unary``;
- pairwise factors psi(s_prev, s_next) = P_row[s_prev, s_next] between horizontal neighbours
  (k, m) -> (k, m+1) and P_col[s_prev, s_next] between vertical neighbours (k, m) -> (k+1, m). A transition
  matrix is used as the factor as it is (in a 2-D MRF it is not a normalised joint, and need not be);
- optional start factors: P(active) = ``start_row`` on the first node (m = 0) of every row chain and
  ``start_col`` on the first node (k = 0) of every column chain. They belong to the prior (Module B).

The pairwise and start factors of a layer are one record, :class:`Transitions` (a layer's prior holds it:
``prior.LayerPrior.transitions``); :func:`grid_bp` takes the unary input, that record and the solver's settings.

Output (E2): the belief log-odds of every s_n and the extrinsic log-odds ``belief - unary``, i.e. the product
of everything Module B knows (messages from the grid neighbours and the start factors) without what Module A
told it.

Implementation. Every variable is binary, so a message is one number per edge and direction. The flooding
schedule keeps messages as odds (exp of log-odds) and a message through a 2x2 factor f[s_sender, s_receiver]
from the sender's cavity odds x is the Moebius map

    x -> (f01 + f11 x) / (f00 + f10 x) = c1 (x + c2) / (x + c3),

so an iteration costs a few multiply/divide passes over the grid and no exp/log at all (those are the
expensive part of a log-domain update). This is exact arithmetic on the same log-odds quantities: all terms
are positive, so there is no cancellation, and messages are bounded by the factor's odds ratios, so nothing
overflows; node odds are formed from log-odds clipped to +-_CLIP (a node beyond that is saturated, and the
returned beliefs use the unclipped log-odds). The tolerance is on the log-odds change of the messages,
|log(new/old)|. Everything is vectorised over the whole grid: the only Python loops are over iterations and
over the four message directions.

On a chain (1 x M or K x 1) the result is computed exactly by forward-backward, vectorised as a parallel
prefix product of the 2x2 matrices of the Moebius maps (log2(M) steps, no loop over nodes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["GridBPResult", "Transitions", "grid_bp"]

# Node log-odds are clipped to +-_CLIP before exponentiation. exp(300) ~ 1e130, and a cavity odds is at most
# that times four bounded messages, far from float64 overflow; beyond +-300 a node is saturated anyway (its
# outgoing messages equal the factor's limit to within exp(-300)).
_CLIP = 300.0


@dataclass
class GridBPResult:
    """Result of :func:`grid_bp` (docs/algorithm.md §8, E2)."""

    belief: np.ndarray  # (K, M) float64 log-odds of the posterior marginal of each s_n
    extrinsic: np.ndarray  # (K, M) float64 log-odds = belief - unary  (E2)
    iterations: int  # iterations used
    converged: bool


def _probability(p: Any, name: str, *, allow_none: bool = False) -> float | None:
    """Validate a probability parameter; the message names the parameter."""
    if p is None and allow_none:
        return None
    try:
        v = float(p)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a probability in (0, 1), got {p!r}") from None
    if not 0.0 < v < 1.0:  # also rejects NaN
        raise ValueError(f"{name} must be a probability in (0, 1){' or None' if allow_none else ''}, got {p!r}")
    return v


@dataclass(frozen=True)
class Transitions:
    """The grid MRF's factors of one layer (docs/algorithm.md §2), Module B's prior.

    ``p01_row``, ``p11_row``: the factor between horizontal neighbours (k, m) and (k, m+1) is
    P_row = [[1-p01_row, p01_row], [1-p11_row, p11_row]] (rows: s_prev, columns: s_next); ``p01_col``,
    ``p11_col`` the same between vertical neighbours (k, m) and (k+1, m). ``start_row``: P(active) start factor on
    the first column (m = 0) of every row chain, or None; ``start_col``: on the first row (k = 0) of every column
    chain, or None. Every probability is checked when the record is made (in (0, 1); a ValueError names the
    parameter) and stored as a float."""

    p01_row: float
    p11_row: float
    p01_col: float
    p11_col: float
    start_row: float | None = None
    start_col: float | None = None

    def __post_init__(self) -> None:
        for name in ("p01_row", "p11_row", "p01_col", "p11_col", "start_row", "start_col"):
            value = _probability(getattr(self, name), name, allow_none=name.startswith("start"))
            object.__setattr__(self, name, value)


def _factor(p01: float, p11: float) -> np.ndarray:
    """psi[s_prev, s_next] = P[s_prev, s_next] with P = [[1-p01, p01], [1-p11, p11]] (docs/algorithm.md §2)."""
    return np.array([[1.0 - p01, p01], [1.0 - p11, p11]], dtype=np.float64)


def _moebius(f: np.ndarray) -> tuple[float, float, float]:
    """(c1, c2, c3) with (f01 + f11 x) / (f00 + f10 x) = c1 (x + c2) / (x + c3), f = f[s_sender, s_receiver]."""
    return float(f[1, 1] / f[1, 0]), float(f[0, 1] / f[1, 1]), float(f[0, 0] / f[1, 0])


def _logit(p: float | None) -> float:
    return 0.0 if p is None else math.log(p) - math.log1p(-p)


def _chain_forward(a: np.ndarray, f: np.ndarray) -> np.ndarray:
    """Exact forward messages on a batch of chains (odds, one chain per row of ``a``).

    ``a`` (B, L): log-odds of every node's own factors (everything but the chain's pairwise ones).
    ``f`` = f[s_j, s_{j+1}]: the pairwise factor. Returns (B, L) odds of the message into node j from node
    j-1 (1 at j = 0). The unnormalised message vector obeys v_{j+1} = G_j v_j with
    G_j[t, s] = f[s, t] w_j(s), w_j = (P(s_j=0), P(s_j=1)) up to scale; so v_{j+1} = (G_j ... G_0) (1, 1) and
    the prefix products come from a Hillis-Steele scan: log2(L) vectorised steps, each matrix rescaled to
    unit entry sum (only ratios matter; this prevents under/overflow along long chains).
    """
    bsz, n = a.shape
    out = np.ones((bsz, n))
    if n == 1:
        return out
    x = a[:, :-1]
    w0 = np.exp(-np.maximum(x, 0.0))  # (w0, w1) = (1, e^a) / max(1, e^a): never overflows
    w1 = np.exp(np.minimum(x, 0.0))
    # q[t, s] = G[t, s], shape (2, 2, B, L-1)
    q = np.empty((2, 2, bsz, n - 1))
    for t in range(2):
        q[t, 0] = f[0, t] * w0
        q[t, 1] = f[1, t] * w1
    d = 1
    while d < n - 1:
        later, earlier = q[:, :, :, d:], q[:, :, :, :-d]
        # (later @ earlier)[t, s] = sum_r later[t, r] earlier[r, s]; RHS is built before assignment.
        prod = later[:, 0:1] * earlier[0:1] + later[:, 1:2] * earlier[1:2]
        prod /= prod.sum(axis=(0, 1))
        q[:, :, :, d:] = prod
        d *= 2
    out[:, 1:] = (q[1, 0] + q[1, 1]) / (q[0, 0] + q[0, 1])  # v = Q (1, 1): odds v1 / v0
    return out


def _chain_messages(a: np.ndarray, f: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact forward (from the left) and backward (from the right) message odds on a batch of chains."""
    fwd = _chain_forward(a, f)
    bwd = _chain_forward(a[:, ::-1], f.T)[:, ::-1]  # the backward pass is a forward pass on the reversed chain
    return fwd, bwd


def _check_unary(unary: Any) -> np.ndarray:
    u = np.asarray(unary, dtype=np.float64)
    if u.ndim != 2:
        raise ValueError(f"unary must be a 2-D (K, M) array of log-odds, got shape {u.shape}")
    if u.size == 0:
        raise ValueError(f"unary must be a non-empty 2-D array, got shape {u.shape}")
    if not np.isfinite(u).all():
        raise ValueError("unary log-odds must be finite (no NaN or +-inf)")
    return u


def grid_bp(
    unary: np.ndarray,
    transitions: Transitions,
    *,
    max_iter: int = 50,
    tol: float = 1e-6,
    damping: float = 0.0,
) -> GridBPResult:
    """Loopy sum-product on the K x M support grid of one layer (Module B; docs/algorithm.md §8, E2).

    Args:
        unary: (K, M) log-odds, the A -> B message of E1. Must be finite; any magnitude is handled.
        transitions: the layer's pairwise and start factors (:class:`Transitions`).
        max_iter: iteration cap (>= 1).
        tol: stop when the largest change of any message, in log-odds, is below ``tol``.
        damping: in [0, 1); new = (1 - damping) * computed + damping * old, in log-odds.

    Returns:
        :class:`GridBPResult` with ``belief`` (log-odds of the marginals), ``extrinsic`` = ``belief - unary``
        (E2: the neighbours' messages and the start factors, the B -> A message), ``iterations`` and
        ``converged``. ``extrinsic`` is formed as the float difference ``belief - unary`` (E2 literally), so
        its absolute precision is that of ``belief`` (about 1e-16 * |unary|; irrelevant below |unary| ~ 1e6).
        On a chain (K == 1 or M == 1) the result is exact forward-backward with
        ``iterations = 1`` and ``converged = True`` for any damping (the fixed point is unique).

    Raises:
        ValueError: for a non-2-D, empty or non-finite ``unary``, or invalid ``max_iter``, ``tol`` or ``damping``
            (a probability outside (0, 1) is refused when the :class:`Transitions` record is made).
        TypeError: when ``transitions`` is not a :class:`Transitions` record.
    """
    if not isinstance(transitions, Transitions):
        raise TypeError(f"transitions must be a Transitions record, got {type(transitions).__name__}")
    u = _check_unary(unary)
    fr = _factor(transitions.p01_row, transitions.p11_row)
    fc = _factor(transitions.p01_col, transitions.p11_col)
    s_row, s_col = transitions.start_row, transitions.start_col
    if isinstance(max_iter, bool) or not isinstance(max_iter, int | np.integer) or max_iter < 1:
        raise ValueError(f"max_iter must be an integer >= 1, got {max_iter!r}")
    if not (isinstance(tol, int | float | np.floating) and tol >= 0.0):
        raise ValueError(f"tol must be a number >= 0, got {tol!r}")
    if not (isinstance(damping, int | float | np.floating) and 0.0 <= damping < 1.0):
        raise ValueError(f"damping must be in [0, 1), got {damping!r}")

    k, m = u.shape
    # Log-odds of each node's own factors: the unary input plus the start factors (Module B's prior).
    own = u.copy()
    own[:, 0] += _logit(s_row)
    own[0, :] += _logit(s_col)

    if k == 1 or m == 1:
        # A chain is a tree: forward-backward is exact and BP's unique fixed point.
        line = own.reshape(1, -1)
        fwd, bwd = _chain_messages(line, fr if k == 1 else fc)
        belief = (line + np.log(fwd) + np.log(bwd)).reshape(k, m)
        return GridBPResult(belief=belief, extrinsic=belief - u, iterations=1, converged=True)

    right, left, down, up, iterations, converged = _flooding(own, fr, fc, int(max_iter), float(tol), float(damping))
    belief = own
    belief[:, 1:] += np.log(right)
    belief[:, :-1] += np.log(left)
    belief[1:, :] += np.log(down)
    belief[:-1, :] += np.log(up)
    return GridBPResult(belief=belief, extrinsic=belief - u, iterations=iterations, converged=converged)


_Messages = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, bool]


def _flooding(own: np.ndarray, fr: np.ndarray, fc: np.ndarray, max_iter: int, tol: float, damping: float) -> _Messages:
    """Flooding schedule in the odds domain with preallocated buffers (the hot path: docs/algorithm.md §8 asks the whole
    model's grids to cost far less than local training, and the support calibration calls this many times).

    Messages (odds, 1 = uninformative): right[k, m] from (k, m) into (k, m+1); left[k, m] from (k, m+1) into
    (k, m); down[k, m] from (k, m) into (k+1, m); up[k, m] from (k+1, m) into (k, m).
    """
    k, m = own.shape
    node = np.exp(np.clip(own, -_CLIP, _CLIP))
    belief = node.copy()
    msgs = [np.ones((k, m - 1)), np.ones((k, m - 1)), np.ones((k - 1, m)), np.ones((k - 1, m))]
    new = [np.empty_like(x) for x in msgs]
    tmp = [np.empty((k, m - 1)), np.empty((k - 1, m))]
    # Per direction: the sender's belief slice, the index of the message the receiver sent back (divided out
    # to form the cavity), the Moebius constants (a factor f[s_prev, s_next] read backwards is f.T).
    senders = [
        (belief[:, :-1], 1, _moebius(fr), tmp[0]),
        (belief[:, 1:], 0, _moebius(fr.T), tmp[0]),
        (belief[:-1, :], 3, _moebius(fc), tmp[1]),
        (belief[1:, :], 2, _moebius(fc.T), tmp[1]),
    ]
    iterations, converged = 0, False
    for _ in range(max_iter):
        iterations += 1
        delta = 0.0
        for i, (src, back, (c1, c2, c3), t) in enumerate(senders):
            out = new[i]
            np.divide(src, msgs[back], out=t)  # cavity odds of the sender
            np.add(t, c2, out=out)
            t += c3
            out /= t
            out *= c1
            np.divide(out, msgs[i], out=t)  # ratio new / old, i.e. exp of the log-odds change
            if damping:
                np.power(t, 1.0 - damping, out=t)  # damped in log-odds: old * (new/old)^(1-damping)
                np.multiply(msgs[i], t, out=out)
            delta = max(delta, math.log(t.max()), -math.log(t.min()))
        msgs, new = new, msgs
        np.copyto(belief, node)
        belief[:, 1:] *= msgs[0]
        belief[:, :-1] *= msgs[1]
        belief[1:, :] *= msgs[2]
        belief[:-1, :] *= msgs[3]
        if delta < tol:
            converged = True
            break
    return msgs[0], msgs[1], msgs[2], msgs[3], iterations, converged
