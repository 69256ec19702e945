"""Module B: loopy sum-product message passing on a layer's support grid (SPEC 8).

The grid MRF has a unary input per node (the A -> B message of E1, as log-odds), pairwise factors
P_row between horizontal neighbours (k, m) -> (k, m+1) and P_col between vertical neighbours
(k, m) -> (k+1, m), and optional start factors (P(active) on the first column of every row chain and on
the first row of every column chain). A transition matrix is used as the pairwise factor as it is:
psi(s_prev, s_next) = P[s_prev, s_next].

Everything is in the log domain and vectorised over the whole grid: every binary message is one
log-odds number per edge and direction, updated by a closed form (one exp and one log per edge). The
schedule is flooding (every message from the previous iteration's beliefs), with damping and a
tolerance / max-iteration stop.
On a chain (1 x M or K x 1) flooding BP is exact once messages have crossed the chain, so the iteration
cap is raised to the chain length there.

Output: beliefs and the extrinsic log-odds, belief minus the unary input (E2): the product of the
messages from the neighbours and the start factors, i.e. everything Module B knows except what Module A
told it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class GridBPResult:
    belief: np.ndarray  # (K, M) log-odds of the marginal of every s_n
    extrinsic: np.ndarray  # (K, M) log-odds, belief - unary (E2)
    iterations: int
    converged: bool


def _factor(p01: float, p11: float, name: str) -> np.ndarray:
    """psi[s_prev, s_next] = P[s_prev, s_next] (SPEC 2)."""
    for label, p in ((f"p01_{name}", p01), (f"p11_{name}", p11)):
        if not (0.0 < float(p) < 1.0):
            raise ValueError(f"{label} must be a probability in (0, 1), got {p}")
    return np.array([[1.0 - p01, p01], [1.0 - p11, p11]], dtype=np.float64)


# Cavity log-odds are clipped before exponentiation: beyond +-60 a message is saturated anyway
# (the factor's entries bound it), and exp(60) ~ 1e26 keeps float64 far from overflow.
_CLIP = 60.0


def _through(x: np.ndarray, f: np.ndarray) -> np.ndarray:
    """Log-odds of the message through a 2x2 factor f[s_sender, s_receiver] from the sender's cavity
    log-odds x: log (f[0,1] + e^x f[1,1]) / (f[0,0] + e^x f[1,0]). One exp and one log per edge."""
    e = np.exp(np.clip(x, -_CLIP, _CLIP, out=x), out=x)  # x is a temporary: reuse its memory
    num = e * f[1, 1]
    num += f[0, 1]
    e *= f[1, 0]
    e += f[0, 0]
    num /= e
    return np.log(num, out=num)


def _start_logodds(p: float | None, name: str) -> float:
    if p is None:
        return 0.0
    if not (0.0 < float(p) < 1.0):
        raise ValueError(f"{name} must be a probability in (0, 1) or None, got {p}")
    return float(np.log(p) - np.log1p(-p))


def grid_bp(
    unary: np.ndarray,
    *,
    p01_row: float,
    p11_row: float,
    p01_col: float,
    p11_col: float,
    start_row: float | None = None,
    start_col: float | None = None,
    max_iter: int = 50,
    tol: float = 1e-6,
    damping: float = 0.0,
    schedule: str = "flooding",
) -> GridBPResult:
    """Loopy sum-product on a K x M grid MRF with unary log-odds ``unary`` (SPEC 8, E2)."""
    u = np.asarray(unary, dtype=np.float64)
    if u.ndim != 2 or u.size == 0:
        raise ValueError(f"unary must be a non-empty 2-D array, got shape {u.shape}")
    if not np.all(np.isfinite(u)):
        raise ValueError("unary log-odds must be finite")
    if not 0.0 <= damping < 1.0:
        raise ValueError(f"damping must be in [0, 1), got {damping}")
    if max_iter < 1 or not tol > 0:
        raise ValueError("max_iter must be >= 1 and tol > 0")
    if schedule != "flooding":
        raise ValueError(f"unknown schedule {schedule!r} (only 'flooding')")
    fr = _factor(p01_row, p11_row, "row")
    fc = _factor(p01_col, p11_col, "col")
    # Sending towards a smaller index (right-to-left, bottom-to-top) uses the transposed factor.
    fr_t, fc_t = fr.T.copy(), fc.T.copy()
    k, m = u.shape
    prior = np.zeros_like(u)
    prior[:, 0] += _start_logodds(start_row, "start_row")
    prior[0, :] += _start_logodds(start_col, "start_col")
    base = u + prior
    if k == 1 or m == 1:
        max_iter = max(max_iter, max(k, m) + 1)  # exact on chains: let messages cross the whole chain
    right = np.zeros((k, m - 1))  # into (k, m+1) from (k, m)
    left = np.zeros((k, m - 1))  # into (k, m) from (k, m+1)
    down = np.zeros((k - 1, m))  # into (k+1, m) from (k, m)
    up = np.zeros((k - 1, m))  # into (k, m) from (k+1, m)

    def beliefs() -> np.ndarray:
        b = base.copy()
        b[:, 1:] += right
        b[:, :-1] += left
        b[1:, :] += down
        b[:-1, :] += up
        return b

    converged = False
    iterations = 0
    b = beliefs()
    for _ in range(max_iter):
        iterations += 1
        new_right = _through(b[:, :-1] - left, fr)
        new_left = _through(b[:, 1:] - right, fr_t)
        new_down = _through(b[:-1, :] - up, fc)
        new_up = _through(b[1:, :] - down, fc_t)
        if damping:
            new_right = (1 - damping) * new_right + damping * right
            new_left = (1 - damping) * new_left + damping * left
            new_down = (1 - damping) * new_down + damping * down
            new_up = (1 - damping) * new_up + damping * up
        delta = max((float(np.abs(a - o).max()) if a.size else 0.0) for a, o in
                    ((new_right, right), (new_left, left), (new_down, down), (new_up, up)))
        right, left, down, up = new_right, new_left, new_down, new_up
        b = beliefs()
        if delta < tol:
            converged = True
            break
    return GridBPResult(belief=b, extrinsic=b - u, iterations=iterations, converged=converged)
