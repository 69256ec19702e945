"""Module A closed forms: E3 and E4 are exact block minimisers of the negative ELBO (docs/algorithm.md §5)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate, stats
from scipy.optimize import minimize_scalar
from scipy.special import expit

from dturbo.algorithms.dturbo import vbi
from dturbo.algorithms.dturbo.spmp import Transitions, grid_bp

pos = st.floats(0.05, 20.0)
small_pos = st.floats(1e-4, 5.0)
prob = st.floats(0.01, 0.99)


def _hyper(draw_a, draw_b, draw_abar, draw_bbar):
    return {"a": draw_a, "b": draw_b, "a_bar": draw_abar, "b_bar": draw_bbar}


@settings(max_examples=300, deadline=None)
@given(pi=prob, pt=prob, at=pos, bt=small_pos, mu=st.floats(-3, 3), sigma=small_pos,
       a=pos, b=small_pos, abar=pos, bbar=small_pos)
def test_e3_never_increases_negative_elbo(pi, pt, at, bt, mu, sigma, a, b, abar, bbar):
    h = _hyper(a, b, abar, bbar)
    before = vbi.module_a_negative_elbo(pi, pt, at, bt, mu, sigma, **h)
    new_pt = vbi.support_posterior(pi, at, bt, **h)
    after = vbi.module_a_negative_elbo(pi, new_pt, at, bt, mu, sigma, **h)
    assert after <= before + 1e-9 * (1 + abs(before))


@settings(max_examples=300, deadline=None)
@given(pi=prob, pt=st.floats(0.0, 1.0), at=pos, bt=small_pos, mu=st.floats(-3, 3), sigma=small_pos,
       a=pos, b=small_pos, abar=pos, bbar=small_pos)
def test_e4_never_increases_negative_elbo(pi, pt, at, bt, mu, sigma, a, b, abar, bbar):
    h = _hyper(a, b, abar, bbar)
    before = vbi.module_a_negative_elbo(pi, pt, at, bt, mu, sigma, **h)
    new_at, new_bt = vbi.precision_posterior(pt, mu, sigma, **h)
    after = vbi.module_a_negative_elbo(pi, pt, new_at, new_bt, mu, sigma, **h)
    assert after <= before + 1e-9 * (1 + abs(before))


def test_e3_is_the_exact_minimiser():
    rng = np.random.default_rng(0)
    for _ in range(20):
        h = {"a": rng.uniform(0.5, 3), "b": rng.uniform(0.01, 2), "a_bar": rng.uniform(0.5, 3),
             "b_bar": rng.uniform(1e-4, 0.1)}
        pi, at, bt, mu, sigma = rng.uniform(0.05, 0.95), rng.uniform(0.5, 5), rng.uniform(0.01, 2), rng.normal(), 0.1
        def f(p, pi=pi, at=at, bt=bt, mu=mu, sigma=sigma, h=h):
            return float(vbi.module_a_negative_elbo(pi, p, at, bt, mu, sigma, **h))

        best = minimize_scalar(f,
                               bounds=(1e-12, 1 - 1e-12), method="bounded", options={"xatol": 1e-12})
        assert abs(float(vbi.support_posterior(pi, at, bt, **h)) - best.x) < 1e-5


def test_e4_is_the_exact_minimiser_and_paper_form_differs():
    rng = np.random.default_rng(1)
    h = {"a": 1.0, "b": 0.5, "a_bar": 1.0, "b_bar": 0.005}
    pt, mu, sigma = 0.7, 0.3, 0.05
    at, bt = vbi.precision_posterior(pt, mu, sigma, **h)
    f0 = vbi.module_a_negative_elbo(0.5, pt, at, bt, mu, sigma, **h)
    for _ in range(200):  # random perturbations of (a~, b~) never do better
        da, db = rng.normal(scale=0.2, size=2)
        f = vbi.module_a_negative_elbo(0.5, pt, max(at + da, 1e-3), max(bt + db, 1e-4), mu, sigma, **h)
        assert f >= f0 - 1e-12
    pa, pb = vbi.precision_posterior(pt, mu, sigma, **h, form="paper")
    # the printed form (docs/algorithm.md §5): +1 and mu^2 + sigma^2, written out; it is not the real-Gaussian minimiser
    assert np.isclose(pa, pt * 1.0 + (1 - pt) * 1.0 + 1.0)
    assert np.isclose(pb, pt * 0.5 + (1 - pt) * 0.005 + mu**2 + sigma**2)
    assert vbi.module_a_negative_elbo(0.5, pt, pa, pb, mu, sigma, **h) > f0 + 1e-3


def test_log_space_is_stable_for_extreme_inputs():
    # Huge precisions and tiny rates make C1, C2 overflow if formed; log-odds stay finite.
    pt = vbi.support_posterior(np.array([1e-300, 0.5, 1 - 1e-16]), np.array([1e4, 1e-3, 2.0]),
                               np.array([1e-30, 1e5, 1e-8]), a=1.0, b=1.0, a_bar=1.0, b_bar=1e-6)
    assert np.all(np.isfinite(pt)) and np.all((pt >= 0) & (pt <= 1))


def test_e3_matches_quadrature_and_e1_does_not_depend_on_pi():
    """(E3) against its definition, logit(pi~) = logit(pi) + E_q[ln Gamma(rho; a, b)] - E_q[ln Gamma(rho; a_bar,
    b_bar)], the expectations over q(rho) = Gamma(a~, b~) computed by numerical integration (no digamma). The
    A->B message (E1) logit(pi~) - logit(pi) is then that expectation alone, whatever pi is."""
    rng = np.random.default_rng(2)
    h = {"a": 1.3, "b": 0.1, "a_bar": 0.8, "b_bar": 0.001}
    for _ in range(6):
        at, bt = rng.uniform(0.5, 3), rng.uniform(0.01, 1)
        q = stats.gamma(at, scale=1 / bt)

        def diff(r, at=at, bt=bt, q=q):
            log_active = stats.gamma.logpdf(r, h["a"], scale=1 / h["b"])
            log_inactive = stats.gamma.logpdf(r, h["a_bar"], scale=1 / h["b_bar"])
            return (log_active - log_inactive) * q.pdf(r)

        mid = q.median()
        ev = integrate.quad(diff, 0, mid, limit=200)[0] + integrate.quad(diff, mid, np.inf, limit=200)[0]
        for pi_logodds in (-3.0, 0.0, 2.5):
            pi_tilde_logodds = float(vbi.support_posterior_logodds(pi_logodds, at, bt, **h))
            assert abs(pi_tilde_logodds - (pi_logodds + ev)) < 1e-6 * (1 + abs(ev))
            assert abs((pi_tilde_logodds - pi_logodds) - ev) < 1e-6 * (1 + abs(ev))
            # the server's E1 (turbo.support_evidence): vbi.support_evidence, the same quantity without pi
            assert abs(float(vbi.support_evidence(at, bt, **h)) - ev) < 1e-6 * (1 + abs(ev))
            p = vbi.support_posterior(expit(pi_logodds), at, bt, **h)
            assert abs(float(p) - expit(pi_logodds + ev)) < 1e-9


def test_e2_divides_out_exactly_the_node_own_input():
    """(E2) on the smallest grid, a 1 x 2 chain, by enumeration: belief minus the node's own unary input is the
    log-odds the node has when its own input is removed (u_0 = 0), i.e. the message from its neighbour. The server's
    E2 is grid_bp's ``extrinsic`` (turbo.module_b)."""
    p01, p11 = 0.3, 0.7
    P = np.array([[1 - p01, p01], [1 - p11, p11]])

    def marginal0(u0, u1):  # exact log-odds of s_0 = 1 by enumerating the 4 supports
        w = {(s0, s1): P[s0, s1] * np.exp(u0 * s0 + u1 * s1) for s0 in (0, 1) for s1 in (0, 1)}
        return np.log(w[1, 0] + w[1, 1]) - np.log(w[0, 0] + w[0, 1])

    for u0, u1 in [(0.0, 0.0), (2.0, -1.0), (-3.0, 4.0), (5.0, 5.0)]:
        assert abs((marginal0(u0, u1) - u0) - marginal0(0.0, u1)) < 1e-12
        res = grid_bp(np.array([[u0, u1]]), Transitions(p01_row=p01, p11_row=p11, p01_col=0.5, p11_col=0.5))
        lo_h = float(res.extrinsic[0, 0])
        assert lo_h == float(res.belief[0, 0] - u0)  # E2 literally: belief minus the node's own input
        assert abs(lo_h - marginal0(0.0, u1)) < 1e-9
        off = grid_bp(np.array([[-7.0, u1]]), Transitions(p01_row=p01, p11_row=p11, p01_col=0.5, p11_col=0.5))
        assert abs(float(off.extrinsic[0, 0]) - lo_h) < 1e-12  # u_0-free


def test_negative_elbo_terms_match_monte_carlo():
    """module_a_negative_elbo (the objective E3 and E4 are tested to minimise) against a Monte Carlo estimate of
    its definition, the KL part of the negative ELBO,
    E_q[ln q(w) q(rho) q(s) - ln N(w; 0, 1/rho) p(rho | s) Bern(s; pi)], with s, rho, w drawn from q (fixed seed;
    tolerance 5 standard errors of the estimate)."""
    rng = np.random.default_rng(4)
    h = {"a": 1.5, "b": 0.2, "a_bar": 1.0, "b_bar": 0.004}
    n = 400_000
    for pi, pt, at, bt, mu, sigma in [(0.3, 0.6, 2.0, 0.1, 0.4, 0.05), (0.8, 0.1, 1.2, 0.01, -0.05, 0.02)]:
        s = rng.random(n) < pt
        rho = rng.gamma(at, 1 / bt, n)
        w = rng.normal(mu, sigma, n)
        log_q_s = np.where(s, np.log(pt), np.log1p(-pt))
        log_p_s = np.where(s, np.log(pi), np.log1p(-pi))
        log_q_rho = stats.gamma.logpdf(rho, at, scale=1 / bt)
        log_p_rho = np.where(s, stats.gamma.logpdf(rho, h["a"], scale=1 / h["b"]),
                             stats.gamma.logpdf(rho, h["a_bar"], scale=1 / h["b_bar"]))
        log_q_w, log_p_w = stats.norm.logpdf(w, mu, sigma), stats.norm.logpdf(w, 0, 1 / np.sqrt(rho))
        sample = log_q_w + log_q_s + log_q_rho - log_p_w - log_p_s - log_p_rho
        exact = float(vbi.module_a_negative_elbo(pi, pt, at, bt, mu, sigma, **h))
        assert abs(sample.mean() - exact) < 5 * sample.std() / np.sqrt(n), (sample.mean(), exact)


def test_prior_std_and_kl():
    assert np.isclose(vbi.prior_std(2.0, 8.0), 2.0)
    assert np.isclose(vbi.gaussian_kl(0.0, 1.0, 1.0), 0.0)
    assert vbi.gaussian_kl(0.5, 0.1, 1.0) > 0
