"""The D-Turbo-VBI server step and client half against independent references (docs/algorithm.md §4-9, issue 11).

The references below are written from those sections' formulas with numpy / scipy (digamma, gammaln): they do not call
``dturbo.vbi``. Module B's SPMP is either brute-force enumeration (chain grids, where loopy BP is exact) or
``grid_bp`` itself (loopy grids; grid_bp is tested against brute force in test_spmp.py), as each test says.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from run_helpers import PAPER_TRANSMISSION
from scipy.special import digamma, expit, gammaln, log_expit

import dturbo.algorithms.dturbo as dt
from dturbo.algorithms.base import ClientData, frame, message_bits, pack_scalars
from dturbo.algorithms.dturbo import turbo
from dturbo.algorithms.dturbo.messages import UP_KIND
from dturbo.algorithms.dturbo.spmp import Transitions, grid_bp
from dturbo.algorithms.local import LocalResult
from dturbo.codec import decode_grid, decode_message, decode_values, encode_dense, encode_values
from dturbo.nn.bayes import bayesian_layers
from dturbo.nn.models import build_model
from dturbo.settings import parse_config

DENSE_MRF = {"p01_row": 0.3, "p11_row": 0.48, "p01_col": 0.3, "p11_col": 0.48}  # config defaults, dense layers
R = 20.0  # active / inactive prior variance ratio used here (scale-matched prior, docs/algorithm.md §2)


def _config(*, mode: str = "prior", hidden=(5,), gamma: str = "exact", threshold: float = 0.5, beta: float = 1.0,
            local_steps: int = 3, **sparsity) -> dict:
    return {
        "experiment": {"seed": 0},
        "model": {"name": "mlp", "hidden": list(hidden)},
        "train": {"local_steps": local_steps, "batch_size": 8, "lr": 0.01},
        "dturbo": {"gamma_update": gamma, "support_threshold": threshold, "beta": beta,
                   "transmission": PAPER_TRANSMISSION, "prior_std_dtype": "float16",
                   "prior": {"dense": {"r": R, **DENSE_MRF}},
                   "sparsity": {"mode": mode, **sparsity}},
    }


def _make(cfg_dict: dict, n_in: int, n_out: int, total: int = 10):
    cfg = parse_config(cfg_dict)

    def factory():
        return build_model("mlp", (n_in,), n_out, hidden=cfg.model.hidden, seed=cfg.experiment.seed,
                           sigma_mode=cfg.dturbo.sigma_mode, sigma_init_ratio=cfg.dturbo.sigma_init_ratio)

    return cfg, factory, dt.DturboServer(cfg, factory, total)


def _hyper(factory) -> dict[str, dict[str, float]]:
    """docs/algorithm.md §2, scale-matched: a = a_bar = 1, b = s_l^2, b_bar = s_l^2 / r, s_l the initial weight std."""
    out = {}
    for name, layer in bayesian_layers(factory()):
        s2 = float(np.var(layer.weight_mu.detach().double().numpy(), ddof=1))
        out[name] = {"a": 1.0, "b": s2, "a_bar": 1.0, "b_bar": s2 / R}
    return out


def _scramble(server, state, hyper, rng, *, keep=0.7) -> None:
    """A state in the middle of a run: old q(rho) unrelated to the current mu (so E3-with-old-q(rho) and
    E4-first give different results), random pi, a partial support (the nonzeros of mu; the state holds no pi~
    for the step to read: it is a temporary of the step)."""
    for info in server.layers:
        n, shape = info.name, info.grid
        state[f"{n}.a_tilde"] = rng.uniform(0.6, 2.5, shape)
        state[f"{n}.b_tilde"] = hyper[n]["b"] * rng.uniform(0.05, 2.0, shape)
        state[f"{n}.pi_logodds"] = rng.normal(0.0, 1.5, shape)
        rng.normal(0.0, 3.0, shape)  # drawn as when the state held a stale pi~, so that the test data stay the same
        mask = rng.random(shape) < keep
        mask.flat[0] = False
        state[f"{n}.mu"] = np.where(mask, state[f"{n}.mu"], 0.0).astype(np.float32)


def _support(state, n: str) -> np.ndarray:
    """S of layer n: the float16 nonzeros of mu_G (the state holds no mask)."""
    return np.float16(state[f"{n}.mu"]) != 0


def _record_module_a(monkeypatch) -> list:
    """Every Module A half the server step computes (E3, E4, E1), in layer order: pi~ is the step's temporary."""
    seen = []
    module_a = turbo.module_a

    def recording(*args, **kwargs):
        seen.append(module_a(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(turbo, "module_a", recording)
    return seen


def _upload(server, state, round_idx: int, cid: int, n_t: int, mus: dict, sigmas: dict, biases: dict) -> bytes:
    """A client's upload written field by field (as DturboClient.fit writes it)."""
    fields = {"meta": pack_scalars([round_idx, cid, n_t])}
    for info in server.layers:
        n = info.name
        fields[f"{n}.mu"] = encode_values(mus[n][_support(state, n)].astype(np.float32), dtype="float16")
        fields[f"{n}.sigma"] = encode_values(np.array([sigmas[n]], np.float32), dtype="float32")
        fields[f"{n}.bias"] = encode_dense(biases[n], dtype="float16")
    fields["metrics"] = pack_scalars([0.7, 0.01])
    return frame(UP_KIND, fields)


def _brute_marginals(u: np.ndarray, p01_row, p11_row, p01_col, p11_col) -> np.ndarray:
    """Exact marginal log-odds of the grid MRF of §2 (no start factor) by enumerating every support."""
    k, m = u.shape
    pr = np.array([[1 - p01_row, p01_row], [1 - p11_row, p11_row]])
    pc = np.array([[1 - p01_col, p01_col], [1 - p11_col, p11_col]])
    s = np.array(list(itertools.product([0, 1], repeat=k * m)), dtype=np.int64).reshape(-1, k, m)
    logw = (s * u).sum(axis=(1, 2))
    logw = logw + np.log(pr[s[:, :, :-1], s[:, :, 1:]]).sum(axis=(1, 2))
    logw = logw + np.log(pc[s[:, :-1, :], s[:, 1:, :]]).sum(axis=(1, 2))
    w = np.exp(logw - logw.max())
    return np.log((w[:, None, None] * s).sum(0)) - np.log((w[:, None, None] * (1 - s)).sum(0))


def _reference_step(before, mu_agg, sig_agg, hyper, *, thr, fields, spmp, gamma="exact", spmp_kw=None):
    """docs/algorithm.md §7.3-7.5 written out: E3 with the OLD q(rho), E4 with the new pi~ and the aggregated moments,
    E1, SPMP (+ the field h of target mode), E2, support {pi~ >= thr} with re-entry at 2^-14 and S equal to
    the float16 nonzeros of mu_G (module docstrings of turbo.py and algorithms/dturbo/)."""
    out = {}
    for i, (n, h) in enumerate(hyper.items()):
        a, b, ab, bb = h["a"], h["b"], h["a_bar"], h["b_bar"]
        a_old, b_old, pi_logodds = before[f"{n}.a_tilde"], before[f"{n}.b_tilde"], before[f"{n}.pi_logodds"]
        e_ln_rho, e_rho = digamma(a_old) - np.log(b_old), a_old / b_old
        ln_pi, ln_1_pi = log_expit(pi_logodds), log_expit(-pi_logodds)  # ln pi, ln(1 - pi), accurate near pi = 0, 1
        ln_c1 = ln_pi + a * np.log(b) - gammaln(a) + (a - 1) * e_ln_rho - b * e_rho
        ln_c2 = ln_1_pi + ab * np.log(bb) - gammaln(ab) + (ab - 1) * e_ln_rho - bb * e_rho
        pi_tilde_logodds = ln_c1 - ln_c2  # (E3)
        pt = expit(pi_tilde_logodds)
        m2 = mu_agg[n] ** 2 + sig_agg[n] ** 2
        if gamma == "exact":  # (E4)
            a_tilde, b_tilde = pt * a + (1 - pt) * ab + 0.5, pt * b + (1 - pt) * bb + m2 / 2
        else:  # the paper's printed form
            a_tilde, b_tilde = pt * a + (1 - pt) * ab + 1.0, pt * b + (1 - pt) * bb + m2
        eta = pi_tilde_logodds - before[f"{n}.pi_logodds"]  # (E1)
        unary = eta + fields[i]
        if spmp == "brute":
            belief = _brute_marginals(unary, **DENSE_MRF)
        else:
            belief = grid_bp(unary, Transitions(**DENSE_MRF), **spmp_kw).belief
        pi_logodds = belief - unary + fields[i]  # (E2): extrinsic, the field being a factor of Module B
        old = _support(before, n)
        keep = pt >= thr
        mu = np.where(keep & ~old, 2.0**-14, np.where(keep, mu_agg[n], 0.0))
        keep &= np.float16(mu) != 0
        out[n] = {"pi_tilde_logodds": pi_tilde_logodds, "a_tilde": a_tilde, "b_tilde": b_tilde,
                  "pi_logodds": pi_logodds, "mask": keep, "mu": np.where(keep, mu, 0.0).astype(np.float32)}
    return out


# (hidden, inputs, outputs, SPMP reference): chain grids 1x4 and 3x1 are exact for BP, so brute force is the
# reference there; the loopy 5x6 and 3x5 grids are too big to enumerate, so grid_bp itself is used for SPMP.
CASES = {"chains-bruteforce": ((1,), 4, 3, "brute"), "loopy-grid_bp": ((5,), 6, 3, "grid_bp")}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["prior", "target"])
def test_server_step_matches_independent_reference(case, mode, monkeypatch):
    hidden, n_in, n_out, spmp = CASES[case]
    extra = {"target_density": 0.5, "warmup_rounds": 1, "ramp_rounds": 2} if mode == "target" else {}
    cfg, factory, server = _make(_config(mode=mode, hidden=hidden, **extra), n_in, n_out)
    hyper = _hyper(factory)
    rng = np.random.default_rng(11)
    state = server.init()
    _scramble(server, state, hyper, rng)
    # Two clients, n_t = 3 and 7 (p = 0.3, 0.7). Weight 1 of every layer sits on S with pi~ ~ 1 but an
    # aggregated value below float16's resolution (it must leave S); weight 0 is off S with pi~ ~ 1 (re-entry).
    mus, sigs, biases = [], [], []
    for _ in range(2):
        mus.append({n: rng.normal(0, 0.3, info.grid) for n, info in zip(hyper, server.layers, strict=True)})
        sigs.append({n: float(rng.uniform(0.01, 0.05)) for n in hyper})
        biases.append({n: rng.normal(0, 0.1, info.grid[0]).astype(np.float32)
                       for n, info in zip(hyper, server.layers, strict=True)})
    for n in hyper:
        state[f"{n}.mu"].flat[1] = 0.25  # on S (the uploads replace its value)
        state[f"{n}.pi_logodds"].flat[:2] = 30.0
        mus[0][n].flat[1], mus[1][n].flat[1] = 2.0**-24, 0.0  # 0.3 * 2^-24 rounds to 0 in float16
    round_idx = 3
    ups = [_upload(server, state, round_idx, c, nt, mus[c], sigs[c], biases[c]) for c, nt in enumerate((3, 7))]
    before = {k: np.copy(v) for k, v in state.items()}

    module_a = _record_module_a(monkeypatch)
    result = server.aggregate(state, ups, round_idx)
    new = result.state

    p = np.array([3.0, 7.0]) / 10.0
    f16 = [{n: np.float16(m[n]).astype(np.float64) for n in m} for m in mus]  # what the wire carried
    mu_agg = {n: np.where(_support(before, n), p[0] * f16[0][n] + p[1] * f16[1][n], 0.0) for n in hyper}
    # sigma_G is kept in the state as float32 (as the model holds it)
    sig_agg = {n: float(np.float32(p[0] * np.float32(sigs[0][n]) + p[1] * np.float32(sigs[1][n]))) for n in hyper}
    fields = np.zeros(len(hyper))
    if mode == "prior":
        np.testing.assert_array_equal(new["field"], 0.0)
    else:  # the calibrated field is taken from the state; everything that follows from it is checked
        fields = np.asarray(new["field"], dtype=np.float64)
        assert np.all(fields != 0.0) and np.all(np.isfinite(fields))
    s = cfg.dturbo.spmp
    ref = _reference_step(before, mu_agg, sig_agg, hyper, thr=0.5, fields=fields, spmp=spmp,
                          spmp_kw={"max_iter": s.max_iter, "tol": s.tol, "damping": s.damping})
    reentered = dropped = 0
    assert len(module_a) == len(ref)
    for (n, r), a in zip(ref.items(), module_a, strict=True):
        np.testing.assert_allclose(a.pi_tilde_logodds, r["pi_tilde_logodds"], rtol=0, atol=1e-9,
                                   err_msg=f"{n} pi~ (E3)")
        np.testing.assert_allclose(new[f"{n}.a_tilde"], r["a_tilde"], rtol=1e-12, err_msg=f"{n} a~ (E4)")
        np.testing.assert_allclose(new[f"{n}.b_tilde"], r["b_tilde"], rtol=1e-9, err_msg=f"{n} b~ (E4)")
        np.testing.assert_allclose(new[f"{n}.pi_logodds"], r["pi_logodds"], rtol=0, atol=1e-9,
                                   err_msg=f"{n} pi (E1-SPMP-E2)")
        np.testing.assert_array_equal(_support(new, n), r["mask"], err_msg=f"{n} support")
        np.testing.assert_allclose(new[f"{n}.mu"], r["mu"], rtol=1e-6, atol=0, err_msg=f"{n} mu_G")
        assert new[f"{n}.mu"].flat[0] == 2.0**-14 and _support(new, n).flat[0]  # re-entered
        assert not _support(new, n).flat[1] and new[f"{n}.mu"].flat[1] == 0  # float16 zero: left S
        reentered += int((r["mask"] & ~_support(before, n)).sum())
        dropped += int((_support(before, n) & ~r["mask"]).sum())
        # the step's own non-trivial outcome: weights both enter and leave, pi~ on both sides of 1/2
        assert 0 < r["mask"].sum() < r["mask"].size
    assert reentered >= 2 and dropped >= 3


def _toy_clients(n_in: int, n_out: int, sizes=(24, 40), seed=0) -> list[ClientData]:
    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        x = rng.normal(size=(n, n_in)).astype(np.float32)
        y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0) * (n_out > 2)
        out.append(ClientData(torch.from_numpy(x), torch.from_numpy(y)))
    return out


def test_upload_has_no_positions_and_costs_two_bytes_per_support_weight():
    """§1, 9: the upload is the float16 values on the common support, in a fixed order, with no position
    bits: its size is 2 |S| + a constant that does not depend on S. (Grids here are at most 48 weights, so every
    varint count and length stays one byte; beyond 127 they would grow by a byte, independent of S too.)"""
    torch.set_num_threads(1)
    cfg, factory, server = _make(_config(hidden=(8,)), 6, 3, total=64)
    client = dt.DturboClient(cfg, factory)
    data = _toy_clients(6, 3)[0]
    rng = np.random.default_rng(5)
    sizes = {}
    for keep in (1.0, 0.6, 0.25):
        state = server.init()
        for info in server.layers:
            n = info.name
            mask = rng.random(info.grid) < keep
            state[f"{n}.mu"] = np.where(mask, state[f"{n}.mu"], 0.0).astype(np.float32)
        support = sum(int(_support(state, i.name).sum()) for i in server.layers)
        up = client.fit(server.downlink(state, 0), data, 0)
        bits = message_bits(up, server.layouts)
        assert bits["positions"] == 0
        _, fields = decode_message(up)
        values = dict(fields)
        for info in server.layers:  # the mu field is exactly the values of S, in row-major order
            n = info.name
            assert len(values[f"{n}.mu"]) == 2 + 2 * int(_support(state, n).sum())
            assert decode_values(values[f"{n}.mu"]).size == int(_support(state, n).sum())
        sizes[support] = len(up) - 2 * support
    assert len(sizes) == 3 and len(set(sizes.values())) == 1, sizes


def _capture_penalty(monkeypatch, cfg, factory, server, state, data, total=None):
    """Run DturboClient.fit with train_local replaced by a probe that evaluates the E6 penalty closure on
    the model as the client set it up from the downlink. Returns (penalty value, the client's model)."""
    seen = {}

    def probe(model, data, train, gen, penalty, **_):  # e.g. device='cpu
        seen["value"] = float(penalty().detach().double())
        seen["model"] = model
        return LocalResult(steps=0, nll=0.0, penalty=seen["value"])

    monkeypatch.setattr(dt.client, "train_local", probe)
    if total is not None:
        server.total_samples = total
    dt.DturboClient(cfg, factory).fit(server.downlink(state, 0), data, 0)
    return seen["value"], seen["model"]


def _kl_reference(server, state, beta, total):
    """beta * sum over S of KL(N(mu, sigma^2) || N(0, sigma_prior^2)) / n (E6), with mu and sigma_prior as
    the downlink carries them (float16) and sigma_prior = sqrt(b~ / a~) (E5), written out here."""
    kl = 0.0
    for info in server.layers:
        n = info.name
        mask = _support(state, n)
        mu = np.float16(state[f"{n}.mu"][mask]).astype(np.float64)
        sigma = float(state[f"{n}.sigma"].reshape(-1)[0])
        sp = np.float16(np.sqrt(state[f"{n}.b_tilde"] / state[f"{n}.a_tilde"])[mask]).astype(np.float64)
        kl += float(np.sum(np.log(sp / sigma) + (sigma**2 + mu**2) / (2 * sp**2) - 0.5))
    return beta * kl / total


def test_client_penalty_is_beta_kl_over_global_n_with_downloaded_prior(monkeypatch):
    """E6: the penalty is beta * KL / n with n the GLOBAL sample count (not n_t), the KL against the
    downloaded sigma_prior (E5), over the support only."""
    torch.set_num_threads(1)
    n_in, n_out = 6, 3
    cfg, factory, server = _make(_config(hidden=(5,)), n_in, n_out, total=500)
    rng = np.random.default_rng(3)
    state = server.init()
    hyper = _hyper(factory)
    _scramble(server, state, hyper, rng, keep=0.6)
    small, large = _toy_clients(n_in, n_out)
    value, model = _capture_penalty(monkeypatch, cfg, factory, server, state, small)
    ref = _kl_reference(server, state, 1.0, 500)
    assert value == pytest.approx(ref, rel=2e-5)
    # the client's layers hold the downloaded prior (float16 of E5) on S
    for info, (_, layer) in zip(server.layers, bayesian_layers(model), strict=True):
        mask = _support(state, info.name)
        sp = np.float16(np.sqrt(state[f"{info.name}.b_tilde"] / state[f"{info.name}.a_tilde"]))
        np.testing.assert_allclose(layer.prior_std.numpy().reshape(info.grid)[mask], sp[mask], rtol=1e-6)
    # n_t does not enter: another client (more samples) gets the same penalty
    assert _capture_penalty(monkeypatch, cfg, factory, server, state, large)[0] == pytest.approx(value, rel=1e-12)
    # proportional to 1 / n (the global count in the downlink) ...
    assert _capture_penalty(monkeypatch, cfg, factory, server, state, small, total=2000)[0] == pytest.approx(
        value / 4, rel=1e-6)
    # ... and to beta
    cfg3, factory3, server3 = _make(_config(hidden=(5,), beta=3.0), n_in, n_out, total=500)
    assert _capture_penalty(monkeypatch, cfg3, factory3, server3, state, small)[0] == pytest.approx(
        3 * value, rel=1e-6)
    # a different q(rho) in the server state changes the prior the client uses, as E5 says
    state2 = dict(state)
    for info in server.layers:
        state2[f"{info.name}.b_tilde"] = state[f"{info.name}.b_tilde"] * 4.0
    value2 = _capture_penalty(monkeypatch, cfg, factory, server, state2, small, total=500)[0]
    assert value2 == pytest.approx(_kl_reference(server, state2, 1.0, 500), rel=2e-5)
    assert value2 != pytest.approx(value, rel=1e-2)


def test_reentering_weight_restarts_is_sent_trained_and_aggregated(monkeypatch):
    """§7.5 and the module docstring: a weight off S whose pi~ crosses the threshold enters S at 2^-14,
    is in the next downlink's grid, is trained by the clients and its aggregated value is taken next round."""
    torch.set_num_threads(1)
    n_in, n_out = 6, 3
    cfg, factory, server = _make(_config(hidden=(5,), local_steps=4), n_in, n_out, total=64)
    client = dt.DturboClient(cfg, factory)
    clients = _toy_clients(n_in, n_out)
    state = server.init()
    name, pos = "dense1", (2, 3)
    state[f"{name}.mu"][pos] = 0.0  # off S
    # round 0: the weight is off S, so its upload carries nothing for it; pi from Module B pushes it back in
    ups = [client.fit(server.downlink(state, 0), d, c) for c, d in enumerate(clients)]
    state["dense1.pi_logodds"][pos] = 30.0
    module_a = _record_module_a(monkeypatch)
    st1 = server.aggregate(state, ups, 0).state
    assert module_a[0].pi_tilde_logodds[pos] >= 0 and _support(st1, name)[pos]
    assert st1[f"{name}.mu"][pos] == np.float32(turbo.REENTRY_VALUE) == 2.0**-14
    # round 1: it is in the downlink's cluster-coded grid at 2^-14 ...
    down = server.downlink(st1, 1)
    grid = decode_grid(dict(decode_message(down)[1])[f"{name}.mu"])
    assert grid[pos] == 2.0**-14
    # ... the clients train it (it moves away from 2^-14) and upload it in its row-major slot of S ...
    st1[f"{name}.pi_logodds"][pos] = 30.0  # keep it on S in round 1 whatever Module B says, to see its value
    ups = [client.fit(down, d, c) for c, d in enumerate(clients)]
    slot = int(np.flatnonzero(_support(st1, name).reshape(-1)).tolist().index(np.ravel_multi_index(pos, (5, 6))))
    sent = [float(decode_values(dict(decode_message(u)[1])[f"{name}.mu"])[slot]) for u in ups]
    assert all(abs(v - 2.0**-14) > 1e-3 for v in sent), sent
    # ... and the server takes their aggregate, p_t = n_t / n
    st2 = server.aggregate(st1, ups, 1).state
    assert _support(st2, name)[pos]
    expected = (24 * sent[0] + 40 * sent[1]) / 64
    assert st2[f"{name}.mu"][pos] == pytest.approx(expected, rel=1e-6)
