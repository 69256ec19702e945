"""Module B: grid BP against brute-force enumeration (SPEC 8)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.special import expit

from dturbo.spmp import grid_bp


def brute_force(u, p01_row, p11_row, p01_col, p11_col, start_row=None, start_col=None):
    """Exact marginal log-odds by enumerating all 2^(K*M) supports of the same MRF."""
    k, m = u.shape
    pr = np.array([[1 - p01_row, p01_row], [1 - p11_row, p11_row]])
    pc = np.array([[1 - p01_col, p01_col], [1 - p11_col, p11_col]])
    states = np.array(list(itertools.product([0, 1], repeat=k * m))).reshape(-1, k, m)
    logw = (states * u).sum(axis=(1, 2))
    logw += np.log(pr[states[:, :, :-1], states[:, :, 1:]]).sum(axis=(1, 2))
    logw += np.log(pc[states[:, :-1, :], states[:, 1:, :]]).sum(axis=(1, 2))
    if start_row is not None:
        logw += np.log(np.where(states[:, :, 0] == 1, start_row, 1 - start_row)).sum(axis=1)
    if start_col is not None:
        logw += np.log(np.where(states[:, 0, :] == 1, start_col, 1 - start_col)).sum(axis=1)
    w = np.exp(logw - logw.max())
    p = (w[:, None, None] * states).sum(0) / w.sum()
    return np.log(p) - np.log1p(-p)


COUPLINGS = [
    dict(p01_row=0.288, p11_row=0.49, p01_col=0.288, p11_col=0.49),  # reference demo, conv
    dict(p01_row=0.1, p11_row=0.9, p01_col=0.2, p11_col=0.7),  # strong clustering
    dict(p01_row=0.6, p11_row=0.3, p01_col=0.5, p11_col=0.5),  # anti-clustering rows
]


@pytest.mark.parametrize("shape", [(1, 10), (10, 1), (1, 2), (1, 7)])
@pytest.mark.parametrize("coupling", COUPLINGS)
@pytest.mark.parametrize("start", [None, 0.3])
def test_exact_on_chains(shape, coupling, start):
    rng = np.random.default_rng(hash((shape, start)) % 2**32)
    u = rng.normal(scale=2.0, size=shape)
    res = grid_bp(u, **coupling, start_row=start, start_col=start, tol=1e-13, max_iter=5)
    ref = brute_force(u, **coupling, start_row=start, start_col=start)
    np.testing.assert_allclose(res.belief, ref, atol=1e-9, rtol=0)
    assert res.converged


@pytest.mark.parametrize("shape", [(3, 4), (2, 5), (4, 4)])
def test_close_to_brute_force_on_small_loopy_grids(shape):
    rng = np.random.default_rng(sum(shape))
    for coupling in COUPLINGS[:1] + [dict(p01_row=0.25, p11_row=0.6, p01_col=0.3, p11_col=0.55)]:
        u = rng.normal(scale=1.5, size=shape)
        res = grid_bp(u, **coupling, tol=1e-12, max_iter=500)
        ref = brute_force(u, **coupling)
        # Loopy BP is approximate; at these moderate couplings its marginals are within a few 1e-3.
        assert np.abs(expit(res.belief) - expit(ref)).max() < 0.01
        assert res.converged


def test_extrinsic_is_belief_minus_unary_and_independent_of_own_input_on_chains():
    rng = np.random.default_rng(3)
    u = rng.normal(size=(1, 8))
    c = COUPLINGS[1]
    a = grid_bp(u, **c, tol=1e-13)
    np.testing.assert_array_equal(a.extrinsic, a.belief - u)
    u2 = u.copy()
    u2[0, 4] += 5.0
    b = grid_bp(u2, **c, tol=1e-13)
    assert abs(a.extrinsic[0, 4] - b.extrinsic[0, 4]) < 1e-9  # E2 divides the node's own input out
    assert abs(a.extrinsic[0, 3] - b.extrinsic[0, 3]) > 1e-3  # ... but its neighbours hear about it


def test_symmetric_factor_zero_input_gives_zero_belief():
    res = grid_bp(np.zeros((5, 6)), p01_row=0.3, p11_row=0.7, p01_col=0.3, p11_col=0.7)
    np.testing.assert_allclose(res.belief, 0.0, atol=1e-12)


def test_clustering_prior_pulls_neighbours_together():
    u = np.full((7, 7), -1.0)
    u[2:5, 2:5] = 3.0
    res = grid_bp(u, p01_row=0.2, p11_row=0.8, p01_col=0.2, p11_col=0.8)
    assert res.extrinsic[3, 3] > res.extrinsic[0, 0]  # the block's centre hears active neighbours


def test_damping_reaches_the_same_fixed_point():
    rng = np.random.default_rng(4)
    u = rng.normal(size=(6, 9))
    a = grid_bp(u, **COUPLINGS[0], tol=1e-12, max_iter=500)
    b = grid_bp(u, **COUPLINGS[0], tol=1e-12, max_iter=500, damping=0.5)
    np.testing.assert_allclose(a.belief, b.belief, atol=1e-8)
    assert b.iterations > a.iterations


def test_large_inputs_stay_finite():
    u = np.array([[50.0, -50.0, 50.0], [-50.0, 50.0, -50.0]])
    res = grid_bp(u, **COUPLINGS[1])
    assert np.all(np.isfinite(res.belief)) and np.all(np.isfinite(res.extrinsic))
    assert np.all(np.sign(res.belief) == np.sign(u))


@pytest.mark.parametrize("bad", [dict(p01_row=0.0), dict(p11_col=1.0), dict(damping=1.0), dict(start_row=1.5)])
def test_invalid_parameters_are_rejected(bad):
    kw = {**COUPLINGS[0], **bad}
    with pytest.raises(ValueError):
        grid_bp(np.zeros((2, 2)), **kw)


def test_invalid_unary_is_rejected():
    with pytest.raises(ValueError, match="2-D"):
        grid_bp(np.zeros(3), **COUPLINGS[0])
    with pytest.raises(ValueError, match="finite"):
        grid_bp(np.array([[0.0, np.nan]]), **COUPLINGS[0])
