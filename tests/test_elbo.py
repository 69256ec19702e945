"""What a D-Turbo-VBI run reports: the negative ELBO's terms against an independent computation, and the
density schedule in the row of the round it describes."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from run_helpers import PAPER_TRANSMISSION
from scipy import integrate
from scipy.special import expit
from torch.distributions import Bernoulli, Gamma, kl_divergence

from dturbo.algorithms.dturbo.sparsity import density_schedule
from dturbo.algorithms.dturbo.turbo import support, support_evidence
from dturbo.settings import parse_config
from dturbo.sim import Simulator


def _toy_npz(tmp_path: Path) -> Path:
    x = np.random.default_rng(0).normal(size=(400, 20)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    np.savez(tmp_path / "toy.npz", x_train=x, y_train=y, x_test=x[:100], y_test=y[:100])
    return tmp_path / "toy.npz"


def _config(tmp_path: Path, *, beta: float = 1.0, tie_rows: bool = False, **sparsity) -> dict:
    return {
        "experiment": {"rounds": 3, "seed": 0, "threads": 1},
        "data": {"name": "npz", "path": str(_toy_npz(tmp_path))},
        "federation": {"clients": 3, "partition": "iid"},
        "model": {"name": "mlp", "hidden": [12]},
        "train": {"local_steps": 8, "batch_size": 32, "lr": 0.01},
        "dturbo": {"beta": beta, "prior": {"dense": {"tie_rows": tie_rows}}, "transmission": PAPER_TRANSMISSION,
                   "prior_std_dtype": "float16",
                   "sparsity": {"target_density": 0.5, "warmup_rounds": 0, "ramp_rounds": 2, **sparsity}},
    }


def _expected_gaussian_kl(mu: float, sigma: float, a_tilde: float, b_tilde: float) -> float:
    """E over rho ~ Gamma(a~, b~) of KL(N(mu, sigma^2) || N(0, 1/rho)), by quadrature of the textbook KL
    against the Gamma density (rho = x / b~ to put the mass near 1)."""
    log_norm = -math.lgamma(a_tilde)

    def integrand(x: float) -> float:  # density of x = b~ rho, times the KL at rho = x / b~
        s2 = b_tilde / x
        kl = 0.5 * math.log(s2 / sigma**2) + (sigma**2 + mu**2) / (2 * s2) - 0.5
        return math.exp(log_norm + (a_tilde - 1) * math.log(x) - x) * kl

    return integrate.quad(integrand, 0, math.inf, epsabs=1e-13, epsrel=1e-10, limit=200)[0]


@pytest.mark.parametrize("tie_rows", [False, True])
def test_neg_elbo_terms_match_an_independent_computation(tmp_path, tie_rows):
    beta = 0.4  # tempered: beta multiplies the whole KL
    sim = Simulator(parse_config(_config(tmp_path, beta=beta, tie_rows=tie_rows)), tmp_path / "run")
    server, client = sim.server, sim.client
    state = server.init()
    down = server.downlink(state, 0)
    uplinks = [client.fit(down, sim.fed.clients[c], c) for c in range(3)]
    result = server.aggregate(state, uplinks, 0)
    new, m = result.state, result.metrics

    decoded = [server.decode_uplink(state, u, 0) for u in uplinks]
    n_t = np.array([d.n_t for d in decoded], dtype=np.float64)
    p = n_t / n_t.sum()
    kl_w = kl_rho = kl_s = 0.0
    for info in server.layers:
        name, g = info.name, info.prior.gamma_kwargs()
        mask = support(state[f"{name}.mu"])  # the support the clients trained this round
        mu = sum(pt * d.layers[name].mu.astype(np.float64) for pt, d in zip(p, decoded, strict=True))
        sigma = float(sum(pt * float(d.layers[name].sigma[0]) for pt, d in zip(p, decoded, strict=True)))
        a_tilde, b_tilde = new[f"{name}.a_tilde"], new[f"{name}.b_tilde"]
        # q(w): every weight on the support, by quadrature over q(rho)
        for k, j in enumerate(np.flatnonzero(mask.reshape(-1))):
            kl_w += _expected_gaussian_kl(mu[k], sigma, a_tilde.flat[j], b_tilde.flat[j])
        # q(rho) against p(rho | s), averaged over q(s)
        # q(s) of this round's E3: logit(pi~) = logit(pi) + E1, from the state the round started with (pi~ is a
        # temporary of the server step)
        pi_tilde_logodds = state[f"{name}.pi_logodds"] + support_evidence(state[f"{name}.a_tilde"],
                                                                         state[f"{name}.b_tilde"], info.prior)
        pt = torch.from_numpy(expit(pi_tilde_logodds))
        q_rho = Gamma(torch.from_numpy(a_tilde), torch.from_numpy(b_tilde))
        kl_rho += float((pt * kl_divergence(q_rho, Gamma(torch.tensor(g["a"], dtype=torch.float64),
                                                         torch.tensor(g["b"], dtype=torch.float64)))
                         + (1 - pt) * kl_divergence(q_rho, Gamma(torch.tensor(g["a_bar"], dtype=torch.float64),
                                                                 torch.tensor(g["b_bar"], dtype=torch.float64)))).sum())
        # q(s) against Module B's pi of this round: one variable per weight, or per row when rows are tied
        cols = slice(0, 1) if tie_rows else slice(None)
        # (from log-odds: torch clamps probabilities at 2e-16, and a calibrated pi can be far smaller)
        q_s, p_s = (torch.from_numpy(x[:, cols]) for x in (pi_tilde_logodds, state[f"{name}.pi_logodds"]))
        kl_s += float(kl_divergence(Bernoulli(logits=q_s), Bernoulli(logits=p_s)).sum())
    assert m["kl_w"] == pytest.approx(kl_w, rel=1e-6)
    assert m["kl_rho"] == pytest.approx(kl_rho, rel=1e-9)
    assert m["kl_s"] == pytest.approx(kl_s, rel=1e-9, abs=1e-9)
    nll = float(sum(pt * d.nll for pt, d in zip(p, decoded, strict=True)))
    assert m["train_nll"] == pytest.approx(nll, rel=1e-12)
    assert m["neg_elbo"] == pytest.approx(server.total_samples * nll + beta * (kl_w + kl_rho + kl_s), rel=1e-6)
    assert min(m["kl_w"], m["kl_rho"], m["kl_s"]) >= 0  # KLs; the old column went negative


def test_rows_show_the_schedule_of_their_own_round_and_round_one_follows_it(tmp_path):
    """No warm-up: round 1's support already follows the schedule (calibrated at init), and every row's
    scheduled_density is the one its own density was calibrated to."""
    sp = {"target_density": 0.4, "warmup_rounds": 0, "ramp_rounds": 2}
    rows = Simulator(parse_config(_config(tmp_path, **sp)), tmp_path / "run").run()
    size = 20 * 12 + 12 * 2  # one weight moves the density by 1/264
    for row in rows:
        scheduled = density_schedule(int(row["round"]) - 1, target=0.4, warmup=0, ramp=2)
        assert float(row["scheduled_density"]) == scheduled
        # the support each round decides: never above, within a few weights
        assert scheduled - 3 / size <= float(row["support_density"]) <= scheduled
    assert float(rows[0]["support_density"]) < 0.6
    assert float(rows[0]["neg_elbo"]) > 0 and float(rows[-1]["neg_elbo"]) > 0


def test_warm_up_rows_are_dense_and_scheduled_dense(tmp_path):
    sp = {"target_density": 0.4, "warmup_rounds": 1, "ramp_rounds": 2}
    rows = Simulator(parse_config(_config(tmp_path, **sp)), tmp_path / "run").run()
    assert [float(r["scheduled_density"]) for r in rows] == [
        density_schedule(r, target=0.4, warmup=1, ramp=2) for r in range(3)]
    assert float(rows[0]["density"]) == 1.0 == float(rows[0]["scheduled_density"])
    assert float(rows[1]["support_density"]) <= float(rows[1]["scheduled_density"]) < 1.0
