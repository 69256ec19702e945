"""Module A closed forms of D-Turbo-VBI (docs/algorithm.md §4-5).

Everything here works on float64 arrays that broadcast against each other, in log space:
C1 and C2 of (E3) are never formed (they under/overflow), only their logarithms' difference.

Notation (docs/algorithm.md §2-5): pi is the prior probability of s_n = 1 coming from Module B (E2);
pi_tilde = q(s_n = 1); (a_tilde, b_tilde) are the shape/rate of q(rho_n); mu, sigma the
mean/std of q(w_n); (a, b) the active and (a_bar, b_bar) the inactive Gamma prior on rho_n.

The turbo messages: E1 (A -> B) is :func:`support_evidence`; E2 (B -> A) is the ``extrinsic`` output of
:func:`dturbo.algorithms.dturbo.spmp.grid_bp`.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from scipy.special import digamma, expit, gammaln, logit

ArrayLike = np.ndarray | float

# Log-odds are clipped to this range when probabilities are turned into log-odds, so that a
# probability of exactly 0 or 1 (float rounding) never produces an infinity downstream.
LOGIT_CLIP = 50.0


def _f64(x: ArrayLike) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def safe_logit(p: ArrayLike) -> np.ndarray:
    """logit(p) clipped to [-LOGIT_CLIP, LOGIT_CLIP]; p outside [0, 1] is a caller bug."""
    p = _f64(p)
    with np.errstate(divide="ignore"):
        return np.clip(logit(p), -LOGIT_CLIP, LOGIT_CLIP)


def expected_log_rho(a_tilde: ArrayLike, b_tilde: ArrayLike) -> np.ndarray:
    """<ln rho> = digamma(a~) - ln b~ under q(rho) = Gamma(a~, b~) (shape/rate)."""
    return digamma(_f64(a_tilde)) - np.log(_f64(b_tilde))


def expected_rho(a_tilde: ArrayLike, b_tilde: ArrayLike) -> np.ndarray:
    """<rho> = a~ / b~."""
    return _f64(a_tilde) / _f64(b_tilde)


def _gamma_log_density_terms(
    shape: ArrayLike, rate: ArrayLike, e_log_rho: np.ndarray, e_rho: np.ndarray
) -> np.ndarray:
    """E_q[ln Gamma(rho; shape, rate)] = shape ln rate - lgamma(shape) + (shape-1)<ln rho> - rate <rho>."""
    shape, rate = _f64(shape), _f64(rate)
    return shape * np.log(rate) - gammaln(shape) + (shape - 1.0) * e_log_rho - rate * e_rho


def support_evidence(
    a_tilde: ArrayLike, b_tilde: ArrayLike, *, a: ArrayLike, b: ArrayLike, a_bar: ArrayLike, b_bar: ArrayLike
) -> np.ndarray:
    """ln C1 - ln C2 - logit(pi): the log-odds that Module A's own factors give s_n = 1.

    This is the A -> B message of (E1) in log-odds. Because (E3) is
    logit(pi_tilde) = logit(pi) + [this quantity], the extrinsic message
    logit(pi_tilde) - logit(pi) does not depend on pi at all; computing it directly avoids
    the loss of precision of logit(sigmoid(.)) when pi_tilde saturates.
    """
    e_log_rho = expected_log_rho(a_tilde, b_tilde)
    e_rho = expected_rho(a_tilde, b_tilde)
    return _gamma_log_density_terms(a, b, e_log_rho, e_rho) - _gamma_log_density_terms(
        a_bar, b_bar, e_log_rho, e_rho
    )


def support_posterior_logodds(
    pi_logodds: ArrayLike,
    a_tilde: ArrayLike,
    b_tilde: ArrayLike,
    *,
    a: ArrayLike,
    b: ArrayLike,
    a_bar: ArrayLike,
    b_bar: ArrayLike,
) -> np.ndarray:
    """(E3) in log-odds: logit(pi_tilde) = ln C1 - ln C2, with pi given as log-odds."""
    return _f64(pi_logodds) + support_evidence(a_tilde, b_tilde, a=a, b=b, a_bar=a_bar, b_bar=b_bar)


def support_posterior(
    pi: ArrayLike,
    a_tilde: ArrayLike,
    b_tilde: ArrayLike,
    *,
    a: ArrayLike,
    b: ArrayLike,
    a_bar: ArrayLike,
    b_bar: ArrayLike,
) -> np.ndarray:
    """(E3): pi_tilde_n = sigmoid(ln C1 - ln C2), computed in log space and float64."""
    lo = support_posterior_logodds(safe_logit(pi), a_tilde, b_tilde, a=a, b=b, a_bar=a_bar, b_bar=b_bar)
    return expit(lo)


def precision_posterior(
    pi_tilde: ArrayLike,
    mu: ArrayLike,
    sigma: ArrayLike,
    *,
    a: ArrayLike,
    b: ArrayLike,
    a_bar: ArrayLike,
    b_bar: ArrayLike,
    form: Literal["exact", "paper"] = "exact",
) -> tuple[np.ndarray, np.ndarray]:
    """(E4): the Gamma posterior q(rho_n) = Gamma(a_tilde_n, b_tilde_n).

    ``form="exact"`` is the exact VBI update for a real Gaussian weight
    (+1/2 and (mu^2 + sigma^2)/2); ``form="paper"`` is the printed variant (+1 and
    mu^2 + sigma^2), which belongs to a complex-valued Gaussian and is kept only to
    reproduce the paper.
    """
    pt = _f64(pi_tilde)
    second_moment = _f64(mu) ** 2 + _f64(sigma) ** 2
    if form == "exact":
        shape_extra, rate_extra = 0.5, 0.5 * second_moment
    elif form == "paper":
        shape_extra, rate_extra = 1.0, second_moment
    else:
        raise ValueError(f"gamma_update form must be 'exact' or 'paper', got {form!r}")
    a_tilde = pt * _f64(a) + (1.0 - pt) * _f64(a_bar) + shape_extra
    b_tilde = pt * _f64(b) + (1.0 - pt) * _f64(b_bar) + rate_extra
    return np.broadcast_arrays(a_tilde, b_tilde)  # type: ignore[return-value]


def prior_std(a_tilde: ArrayLike, b_tilde: ArrayLike) -> np.ndarray:
    """(E5): the std of the Gaussian prior each client uses in its KL term, sqrt(b~ / a~)."""
    return np.sqrt(_f64(b_tilde) / _f64(a_tilde))


def gaussian_kl(mu: ArrayLike, sigma: ArrayLike, sigma_prior: ArrayLike) -> np.ndarray:
    """KL(N(mu, sigma^2) || N(0, sigma_prior^2)) per weight (the term of E6)."""
    mu, sigma, sp = _f64(mu), _f64(sigma), _f64(sigma_prior)
    return np.log(sp / sigma) + (sigma**2 + mu**2) / (2.0 * sp**2) - 0.5


def kl_weights(mu: ArrayLike, sigma: ArrayLike, a_tilde: ArrayLike, b_tilde: ArrayLike) -> np.ndarray:
    """E_q(rho)[KL(N(mu, sigma^2) || N(0, 1/rho))] per weight: the weights' part of the negative ELBO,
    E_q[ln q(w) - ln p(w | rho)] = -ln sigma - 1/2 - <ln rho>/2 + <rho> (mu^2 + sigma^2) / 2 (never negative).

    Its gradient in (mu, sigma) is that of the Gaussian KL of (E6) with sigma_prior from (E5), since
    <rho> = a~/b~ = 1/sigma_prior^2 and <ln rho> does not depend on q(w): the clients' SGD minimises it."""
    second_moment = _f64(mu) ** 2 + _f64(sigma) ** 2
    return (-np.log(_f64(sigma)) - 0.5 - 0.5 * expected_log_rho(a_tilde, b_tilde)
            + 0.5 * expected_rho(a_tilde, b_tilde) * second_moment)


def kl_precision(
    pi_tilde: ArrayLike, a_tilde: ArrayLike, b_tilde: ArrayLike, *, a: ArrayLike, b: ArrayLike, a_bar: ArrayLike,
    b_bar: ArrayLike,
) -> np.ndarray:
    """E_q(s)[KL(q(rho) || p(rho | s))] per weight = E_q[ln q(rho) - ln p(rho | s)] (never negative)."""
    pi_tilde, a_tilde, b_tilde = _f64(pi_tilde), _f64(a_tilde), _f64(b_tilde)
    e_log_rho, e_rho = expected_log_rho(a_tilde, b_tilde), expected_rho(a_tilde, b_tilde)
    # Entropy of Gamma(a~, b~): a~ - ln b~ + lgamma(a~) + (1 - a~) digamma(a~).
    entropy = a_tilde - np.log(b_tilde) + gammaln(a_tilde) + (1.0 - a_tilde) * digamma(a_tilde)
    log_prior = (pi_tilde * _gamma_log_density_terms(a, b, e_log_rho, e_rho)
                 + (1.0 - pi_tilde) * _gamma_log_density_terms(a_bar, b_bar, e_log_rho, e_rho))
    return -entropy - log_prior


def kl_support(pi_tilde: ArrayLike, pi: ArrayLike) -> np.ndarray:
    """KL(Bern(pi~) || Bern(pi)) per support variable: q(s) against Module A's prior on s, the B->A message
    pi (E2), with 0 ln 0 = 0."""
    pt, pi = _f64(pi_tilde), _f64(pi)
    with np.errstate(divide="ignore", invalid="ignore"):
        on = np.where(pt > 0, pt * (np.log(pt) - np.log(pi)), 0.0)
        off = np.where(pt < 1, (1.0 - pt) * (np.log1p(-pt) - np.log1p(-pi)), 0.0)
    return on + off


def module_a_negative_elbo(
    pi: ArrayLike,
    pi_tilde: ArrayLike,
    a_tilde: ArrayLike,
    b_tilde: ArrayLike,
    mu: ArrayLike,
    sigma: ArrayLike,
    *,
    a: ArrayLike,
    b: ArrayLike,
    a_bar: ArrayLike,
    b_bar: ArrayLike,
) -> np.ndarray:
    """Per-weight KL part of Module A's negative ELBO (the likelihood term is the clients'):

    KL_n = E_q[ln q(w_n) q(rho_n) q(s_n) - ln N(w_n; 0, 1/rho_n) p(rho_n | s_n) Bern(s_n; pi_n)]
         = kl_weights + kl_precision + kl_support  (each never negative).

    (E3) minimises it over pi~ with q(rho) fixed, (E4, exact form) over (a~, b~) with pi~ fixed."""
    return (kl_weights(mu, sigma, a_tilde, b_tilde)
            + kl_precision(pi_tilde, a_tilde, b_tilde, a=a, b=b, a_bar=a_bar, b_bar=b_bar)
            + kl_support(pi_tilde, pi))
