"""Module B: grid BP (docs/algorithm.md §8, E2) against brute-force enumeration of the same MRF."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.special import expit

from dturbo.algorithms.dturbo.spmp import GridBPResult, Transitions, grid_bp

DEMO_CONV = dict(p01_row=0.288, p11_row=0.49, p01_col=0.288, p11_col=0.49)  # reference demo, conv layers
DEMO_DENSE = dict(p01_row=0.3, p11_row=0.48, p01_col=0.3, p11_col=0.48)  # reference demo, dense layers
STRONG = dict(p01_row=0.1, p11_row=0.9, p01_col=0.2, p11_col=0.7)  # large clusters
ANTI = dict(p01_row=0.6, p11_row=0.3, p01_col=0.5, p11_col=0.5)  # anti-clustering rows, flat columns
COUPLINGS = {"demo_conv": DEMO_CONV, "strong": STRONG, "anti": ANTI}
TRANSITION_KEYS = ("p01_row", "p11_row", "p01_col", "p11_col", "start_row", "start_col")


def brute_force(
    u: np.ndarray,
    p01_row: float,
    p11_row: float,
    p01_col: float,
    p11_col: float,
    start_row: float | None = None,
    start_col: float | None = None,
) -> np.ndarray:
    """Exact marginal log-odds by enumerating all 2^(K*M) supports, with the factors of docs/algorithm.md §2 as grid_bp
    defines them: psi = P[s_prev, s_next] on every horizontal and vertical edge, start factors on the first
    column (start_row) and the first row (start_col), and exp(u * s) per node."""
    k, m = u.shape
    pr = np.array([[1 - p01_row, p01_row], [1 - p11_row, p11_row]])
    pc = np.array([[1 - p01_col, p01_col], [1 - p11_col, p11_col]])
    states = np.array(list(itertools.product([0, 1], repeat=k * m)), dtype=np.int8).reshape(-1, k, m)
    logw = (states * u).sum(axis=(1, 2))
    logw += np.log(pr[states[:, :, :-1], states[:, :, 1:]]).sum(axis=(1, 2))
    logw += np.log(pc[states[:, :-1, :], states[:, 1:, :]]).sum(axis=(1, 2))
    if start_row is not None:
        logw += np.log(np.where(states[:, :, 0] == 1, start_row, 1 - start_row)).sum(axis=1)
    if start_col is not None:
        logw += np.log(np.where(states[:, 0, :] == 1, start_col, 1 - start_col)).sum(axis=1)
    w = np.exp(logw - logw.max())
    p1 = (w[:, None, None] * states).sum(0)
    p0 = (w[:, None, None] * (1 - states)).sum(0)
    return np.log(p1) - np.log(p0)  # not log(p) - log1p(-p): keeps accuracy when p is close to 1


# ---------------------------------------------------------------------------------------------- chains


@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (1, 7), (1, 10), (2, 1), (10, 1)])
@pytest.mark.parametrize("coupling", list(COUPLINGS))
@pytest.mark.parametrize("start", [None, 0.3, "mixed"])
def test_chain_is_exact(shape: tuple[int, int], coupling: str, start: float | str | None) -> None:
    seed = 1000 * shape[0] + 10 * shape[1] + list(COUPLINGS).index(coupling) + (start == 0.3) + 2 * (start == "mixed")
    rng = np.random.default_rng(seed)
    u = rng.normal(scale=2.0, size=shape)
    st = dict(start_row=0.2, start_col=0.7) if start == "mixed" else dict(start_row=start, start_col=start)
    ref = brute_force(u, **COUPLINGS[coupling], **st)
    res = grid_bp(u, Transitions(**COUPLINGS[coupling], **st))
    np.testing.assert_allclose(res.belief, ref, atol=1e-9, rtol=0)
    assert res.converged and res.iterations >= 1


def test_long_chain_is_exact_and_finite() -> None:
    # A chain much longer than max_iter: forward-backward needs no propagation iterations. Brute force is out of
    # reach, so compare with a plain sequential forward-backward in the log domain.
    rng = np.random.default_rng(7)
    u = rng.normal(scale=3.0, size=(1, 2000))
    p01, p11, s = 0.05, 0.95, 0.3
    logf = np.log(np.array([[1 - p01, p01], [1 - p11, p11]]))
    n = u.shape[1]
    own = np.stack([np.zeros(n), u[0]], axis=1)
    own[0] += np.log([1 - s, s])
    fwd = np.zeros((n, 2))
    bwd = np.zeros((n, 2))
    for j in range(1, n):
        fwd[j] = np.logaddexp.reduce(fwd[j - 1][:, None] + own[j - 1][:, None] + logf, axis=0)
        fwd[j] -= fwd[j].max()
    for j in range(n - 2, -1, -1):
        bwd[j] = np.logaddexp.reduce(bwd[j + 1][None, :] + own[j + 1][None, :] + logf, axis=1)
        bwd[j] -= bwd[j].max()
    lp = fwd + bwd + own
    ref = lp[:, 1] - lp[:, 0]
    res = grid_bp(u, Transitions(p01_row=p01, p11_row=p11, p01_col=0.5, p11_col=0.5, start_row=s), max_iter=3)
    np.testing.assert_allclose(res.belief[0], ref, atol=1e-9, rtol=0)
    assert res.converged


# ------------------------------------------------------------------------------------- small loopy grids

# Loopy BP is approximate; the bounds come from measurement. Over 30 seeds x {3x4, 2x5, 4x4} x {no start,
# start 0.3} with unary ~ N(0, 2^2), the largest marginal error of converged BP was 0.0022 at the demo's
# transitions and 0.0195 at random p01 in [0.2, 0.4], p11 in [0.4, 0.7] (its strongest couplings are well beyond
# the demo's; at p01 = 0.3, p11 = 0.7 with zero evidence errors reach 0.05). The fixed cases below measure
# <= 8e-4 (demo) and <= 2.5e-3 (random couplings); the bounds keep 2x-2.5x headroom over those.
LOOPY_CASES = [
    ((3, 4), DEMO_CONV, None, 0.002),
    ((2, 5), DEMO_CONV, 0.3, 0.002),
    ((4, 4), DEMO_CONV, 0.3, 0.002),
    ((4, 4), DEMO_DENSE, None, 0.002),
    ((3, 4), dict(p01_row=0.25, p11_row=0.6, p01_col=0.33, p11_col=0.55), None, 0.006),
    ((4, 4), dict(p01_row=0.21, p11_row=0.66, p01_col=0.37, p11_col=0.45), 0.3, 0.006),
]


@pytest.mark.parametrize("case", range(len(LOOPY_CASES)))
def test_close_to_brute_force_on_small_loopy_grids(case: int) -> None:
    shape, coupling, start, bound = LOOPY_CASES[case]
    rng = np.random.default_rng(100 + case)
    u = rng.normal(scale=2.0, size=shape)
    res = grid_bp(u, Transitions(**coupling, start_row=start, start_col=start), tol=1e-12, max_iter=500)
    ref = brute_force(u, **coupling, start_row=start, start_col=start)
    assert res.converged
    err = np.abs(expit(res.belief) - expit(ref)).max()
    assert err < bound, err
    # Loopy BP is approximate, not arbitrary: it is much closer to the truth than the unary alone.
    assert err < 0.5 * np.abs(expit(u) - expit(ref)).max()


# ------------------------------------------------------------------------------------------- extrinsic


@pytest.mark.parametrize("shape", [(1, 8), (8, 1), (3, 4)])
def test_extrinsic_is_the_marginal_without_the_own_input(shape: tuple[int, int]) -> None:
    # E2 by brute force: exactly, logit P(s_n | all inputs) = u_n + logit P(s_n | all inputs but u_n), so the
    # extrinsic of node n is the exact marginal log-odds of s_n with u_n set to 0. BP is exact on chains (1e-9);
    # on the loopy 3 x 4 grid it is approximate (bound as in LOOPY_CASES: measured 5.7e-4 here, 3.5x headroom).
    rng = np.random.default_rng(3)
    u = rng.normal(scale=2.0, size=shape)
    mrf = dict(**DEMO_CONV, start_row=0.3, start_col=0.4) if shape == (3, 4) else dict(**STRONG, start_row=0.3,
                                                                                          start_col=0.4)
    res = grid_bp(u, Transitions(**mrf), tol=1e-12, max_iter=500)
    assert isinstance(res, GridBPResult) and res.converged
    assert res.belief.shape == res.extrinsic.shape == shape
    assert res.belief.dtype == res.extrinsic.dtype == np.float64
    cavity = np.empty(shape)
    for node in range(u.size):
        u0 = u.copy()
        u0.flat[node] = 0.0
        cavity.flat[node] = brute_force(u0, **mrf).flat[node]
    if shape == (3, 4):
        assert np.abs(expit(res.extrinsic) - expit(cavity)).max() < 0.002
    else:
        np.testing.assert_allclose(res.extrinsic, cavity, atol=1e-9, rtol=0)
    np.testing.assert_allclose(res.belief, res.extrinsic + u, atol=1e-12, rtol=0)  # and belief = extrinsic + input


@pytest.mark.parametrize("shape", [(1, 8), (8, 1)])
@pytest.mark.parametrize("start", [None, 0.3])
def test_extrinsic_does_not_depend_on_own_unary_on_chains(shape: tuple[int, int], start: float | None) -> None:
    # E2 divides the node's own input out; on a tree BP is exact and the incoming messages do not depend on it.
    rng = np.random.default_rng(4)
    u = rng.normal(scale=2.0, size=shape)
    a = grid_bp(u, Transitions(**STRONG, start_row=start, start_col=start))
    for node in (0, 4, 7):
        u2 = u.copy()
        u2.flat[node] += 5.0
        b = grid_bp(u2, Transitions(**STRONG, start_row=start, start_col=start))
        assert abs(a.extrinsic.flat[node] - b.extrinsic.flat[node]) < 1e-9
        other = node - 1 if node else 1  # ... but a neighbour hears about it
        assert abs(a.extrinsic.flat[other] - b.extrinsic.flat[other]) > 1e-3


def test_start_factors_are_part_of_the_extrinsic() -> None:
    # With symmetric factors and zero unary the only information is the start factor; it must reach Module A.
    sym = dict(p01_row=0.3, p11_row=0.7, p01_col=0.3, p11_col=0.7)
    chain = grid_bp(np.zeros((1, 6)), Transitions(**sym, start_row=0.2))
    # On the chain the messages into the first node carry nothing (zero evidence, symmetric factor), so its
    # extrinsic is exactly the start factor's log-odds; further along the start's influence decays.
    assert abs(chain.extrinsic[0, 0] - np.log(0.2 / 0.8)) < 1e-12
    assert np.all(chain.extrinsic < 0) and np.all(np.diff(chain.extrinsic[0]) > 0)
    # On a loopy grid: the start factors move the extrinsic the right way, as brute force says.
    u = np.zeros((3, 4))
    plain = grid_bp(u, Transitions(**DEMO_CONV), tol=1e-12, max_iter=500)
    started = grid_bp(u, Transitions(**DEMO_CONV, start_row=0.1, start_col=0.9), tol=1e-12, max_iter=500)
    ref_plain = brute_force(u, **DEMO_CONV)
    ref_started = brute_force(u, **DEMO_CONV, start_row=0.1, start_col=0.9)
    assert np.abs(expit(started.extrinsic) - expit(ref_started)).max() < 0.005
    np.testing.assert_array_equal(np.sign(started.extrinsic - plain.extrinsic), np.sign(ref_started - ref_plain))


def test_symmetric_factor_zero_unary_gives_zero_belief() -> None:
    # psi symmetric under 0 <-> 1 (p11 = 1 - p01) and no evidence: every marginal is exactly 1/2.
    for shape in [(5, 6), (1, 9), (9, 1)]:
        res = grid_bp(np.zeros(shape), Transitions(p01_row=0.3, p11_row=0.7, p01_col=0.2, p11_col=0.8))
        np.testing.assert_allclose(res.belief, 0.0, atol=1e-12)
        np.testing.assert_allclose(res.extrinsic, 0.0, atol=1e-12)
        assert res.converged


def test_clustering_prior_pulls_neighbours_together() -> None:
    u = np.full((7, 7), -1.0)
    u[2:5, 2:5] = 3.0
    res = grid_bp(u, Transitions(**STRONG))
    assert res.extrinsic[3, 3] > res.extrinsic[0, 0]  # the block's centre hears active neighbours
    assert res.extrinsic[3, 1] > res.extrinsic[3, 0]  # next to the block more than far from it


# -------------------------------------------------------------------------------- iterations and damping


def test_damping_reaches_the_same_fixed_point() -> None:
    rng = np.random.default_rng(4)
    u = rng.normal(scale=2.0, size=(6, 9))
    a = grid_bp(u, Transitions(**DEMO_CONV, start_row=0.3), tol=1e-12, max_iter=1000)
    b = grid_bp(u, Transitions(**DEMO_CONV, start_row=0.3), tol=1e-12, max_iter=1000, damping=0.5)
    assert a.converged and b.converged
    np.testing.assert_allclose(a.belief, b.belief, atol=1e-9, rtol=0)
    assert b.iterations > a.iterations


def test_damping_is_in_log_odds() -> None:
    # One damped iteration from uninformative messages (log-odds 0) gives (1 - damping) x the undamped messages.
    rng = np.random.default_rng(8)
    u = rng.normal(scale=2.0, size=(3, 4))
    full = grid_bp(u, Transitions(**STRONG), max_iter=1)
    half = grid_bp(u, Transitions(**STRONG), max_iter=1, damping=0.25)
    np.testing.assert_allclose(half.extrinsic, 0.75 * full.extrinsic, atol=1e-12)


def test_iteration_cap_and_convergence_flag() -> None:
    rng = np.random.default_rng(9)
    u = rng.normal(scale=2.0, size=(20, 30))
    capped = grid_bp(u, Transitions(**DEMO_DENSE), max_iter=2)
    assert capped.iterations == 2 and not capped.converged
    free = grid_bp(u, Transitions(**DEMO_DENSE))
    assert free.converged and 2 < free.iterations < 50
    stricter = grid_bp(u, Transitions(**DEMO_DENSE), tol=1e-10)
    assert stricter.iterations > free.iterations
    np.testing.assert_allclose(free.belief, stricter.belief, atol=1e-5)  # tol bounds the message change
    assert not grid_bp(u, Transitions(**DEMO_DENSE), tol=0.0, max_iter=7).converged


# ------------------------------------------------------------------------------------ numerics and input


@pytest.mark.parametrize("scale", [50.0, 1e4])
def test_large_unary_stays_finite(scale: float) -> None:
    u = np.array([[1.0, -1.0, 1.0, 1.0], [-1.0, 1.0, -1.0, 1.0], [1.0, 1.0, -1.0, -1.0]]) * scale
    for grid in (u, u[:1], u[:, :1]):
        res = grid_bp(grid, Transitions(**STRONG, start_row=0.3, start_col=0.3))
        assert np.all(np.isfinite(res.belief)) and np.all(np.isfinite(res.extrinsic))
        assert np.all(np.sign(res.belief) == np.sign(grid))
        # Saturated nodes send the factor's limit messages, so the extrinsic is a bounded prior-size number.
        assert np.abs(res.extrinsic).max() < 20
    small = np.array([[50.0, -50.0, 3.0], [-50.0, 0.5, -50.0]])
    # Here every unclamped node has only clamped neighbours: the loops are cut, and BP is exact up to e^-50.
    exact = brute_force(small, **STRONG)
    res = grid_bp(small, Transitions(**STRONG), tol=1e-13, max_iter=500)
    np.testing.assert_allclose(res.belief, exact, atol=1e-9, rtol=0)


@pytest.mark.parametrize(
    "bad, name",
    [
        (dict(p01_row=0.0), "p01_row"),
        (dict(p11_row=1.0), "p11_row"),
        (dict(p01_col=-0.1), "p01_col"),
        (dict(p11_col=float("nan")), "p11_col"),
        (dict(start_row=1.5), "start_row"),
        (dict(start_col=0.0), "start_col"),
        (dict(damping=1.0), "damping"),
        (dict(damping=-0.1), "damping"),
        (dict(max_iter=0), "max_iter"),
        (dict(max_iter=2.5), "max_iter"),
        (dict(tol=-1e-6), "tol"),
    ],
)
def test_invalid_parameters_are_rejected(bad: dict, name: str) -> None:
    mrf = {key: value for key, value in bad.items() if key in TRANSITION_KEYS}
    solver = {key: value for key, value in bad.items() if key not in TRANSITION_KEYS}
    with pytest.raises(ValueError, match=name):
        grid_bp(np.zeros((2, 2)), Transitions(**{**DEMO_CONV, **mrf}), **solver)


def test_transitions_must_be_a_record() -> None:
    with pytest.raises(TypeError, match="Transitions"):
        grid_bp(np.zeros((2, 2)), DEMO_CONV)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "unary, match",
    [
        (np.zeros(3), "2-D"),
        (np.zeros((2, 2, 2)), "2-D"),
        (np.zeros((0, 3)), "non-empty"),
        (np.array([[0.0, np.nan]]), "finite"),
        (np.array([[0.0, np.inf], [1.0, 2.0]]), "finite"),
    ],
)
def test_invalid_unary_is_rejected(unary: np.ndarray, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        grid_bp(unary, Transitions(**DEMO_CONV))


def test_input_is_not_modified_and_integer_input_is_accepted() -> None:
    u = np.arange(12.0).reshape(3, 4) - 6
    before = u.copy()
    res = grid_bp(u, Transitions(**DEMO_CONV, start_row=0.3))
    np.testing.assert_array_equal(u, before)
    res_int = grid_bp(u.astype(int), Transitions(**DEMO_CONV, start_row=0.3))
    np.testing.assert_array_equal(res.belief, res_int.belief)


# -------------------------------------------------------------------------------------------- many layers


def test_alexnet_grids_converge_quickly_at_demo_couplings() -> None:
    # The performance requirement rests on BP converging in few iterations at the demo's weak couplings.
    rng = np.random.default_rng(12)
    for shape, p in [((16, 150), DEMO_CONV), ((84, 120), DEMO_DENSE)]:
        res = grid_bp(rng.normal(scale=2.0, size=shape), Transitions(**p))
        assert res.converged and res.iterations <= 25


# ------------------------------------------------------------------------------------------- tied rows
@pytest.mark.parametrize("start", [None, 0.3])
def test_tied_rows_are_one_variable_per_row_on_the_column_chain(start: float | None) -> None:
    """prior.tie_rows: each row is one support variable with the summed evidence of its M weights and M times
    the per-weight field, the rows coupled by the column chain; checked against brute force on that chain."""
    from dturbo.algorithms.dturbo.config import SpmpConfig
    from dturbo.algorithms.dturbo.prior import LayerPrior
    from dturbo.algorithms.dturbo.turbo import module_b, tie_rows

    rng = np.random.default_rng(7)
    k, m, field = 5, 3, -0.4
    eta = rng.normal(scale=1.5, size=(k, m))
    transitions = Transitions(0.3, 0.48, STRONG["p01_col"], STRONG["p11_col"], start_row=start, start_col=start)
    prior = LayerPrior(1.0, 1.0, 1.0, 0.01, transitions, tie_rows=True)
    tied = tie_rows(eta, prior)
    assert np.allclose(tied, eta.sum(1, keepdims=True))
    lo, _ = module_b(tied, prior, field, SpmpConfig())
    posterior = tied + lo  # E3 in the next round with the same evidence: the row's posterior log-odds
    assert np.allclose(posterior, posterior[:, :1])  # one value per row
    ref = brute_force(eta.sum(1, keepdims=True) + m * field, 0.3, 0.48, STRONG["p01_col"], STRONG["p11_col"],
                      start_row=start, start_col=start)  # a row's start factor: once per row variable
    np.testing.assert_allclose(posterior, np.broadcast_to(ref, (k, m)), atol=1e-9)
