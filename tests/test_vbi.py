"""Module A closed forms: E3 and E4 are exact block minimisers of the negative ELBO (SPEC 5)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize_scalar
from scipy.special import expit

from dturbo import vbi

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
    assert np.isclose(pa, at + 0.5) and np.isclose(pb, bt + 0.5 * (mu**2 + sigma**2))


def test_log_space_is_stable_for_extreme_inputs():
    # Huge precisions and tiny rates make C1, C2 overflow if formed; log-odds stay finite.
    pt = vbi.support_posterior(np.array([1e-300, 0.5, 1 - 1e-16]), np.array([1e4, 1e-3, 2.0]),
                               np.array([1e-30, 1e5, 1e-8]), a=1.0, b=1.0, a_bar=1.0, b_bar=1e-6)
    assert np.all(np.isfinite(pt)) and np.all((pt >= 0) & (pt <= 1))


def test_messages_e1_e2_are_extrinsic():
    rng = np.random.default_rng(2)
    pi_lo, at, bt = rng.normal(size=50), rng.uniform(0.5, 3, 50), rng.uniform(0.01, 1, 50)
    h = {"a": 1.0, "b": 0.1, "a_bar": 1.0, "b_bar": 0.001}
    pt_lo = vbi.support_posterior_logodds(pi_lo, at, bt, **h)
    eta = vbi.message_a_to_b(pt_lo, pi_lo)
    # E1 does not depend on the incoming message pi: it equals Module A's own evidence.
    np.testing.assert_allclose(eta, vbi.support_evidence(at, bt, **h), atol=1e-12)
    np.testing.assert_allclose(expit(pt_lo), vbi.support_posterior(expit(pi_lo), at, bt, **h), atol=1e-12)
    belief = eta + 0.7
    np.testing.assert_allclose(vbi.message_b_to_a(belief, eta), 0.7)


def test_prior_std_and_kl():
    assert np.isclose(vbi.prior_std(2.0, 8.0), 2.0)
    assert np.isclose(vbi.gaussian_kl(0.0, 1.0, 1.0), 0.0)
    assert vbi.gaussian_kl(0.5, 0.1, 1.0) > 0
