"""D-Turbo-VBI's cheaper messages (``[dturbo.transmission]``): quantised values, the support coded apart, and a
sigma_prior rebuilt by the clients."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from run_helpers import PAPER_TRANSMISSION
from scipy.special import expit

from dturbo.algorithms.base import message_bits
from dturbo.algorithms.dturbo import rebuilt_prior_std
from dturbo.algorithms.dturbo.turbo import support, support_evidence
from dturbo.codec import CodecError, decode_support, encode_grid, encode_support, payload_bits
from dturbo.config import ConfigError
from dturbo.quantize import decode_stochastic, encode_stochastic, level_values, quantize
from dturbo.settings import parse_config
from dturbo.sim import Simulator


def test_stochastic_rounding_is_unbiased_and_within_one_level():
    rng = np.random.default_rng(0)
    v = np.concatenate([rng.normal(size=50) * 0.05, [0.0, 1e-7, -0.2, 0.2]])
    for bits in (1, 2, 4, 8):
        draws = 4000
        out = np.stack([level_values(quantize(v, bits, rng)[0], 2**bits, np.float32(np.abs(v).max()))
                        for _ in range(draws)])
        step = 2 * np.abs(v).max() / (2**bits - 1)
        assert np.all(np.abs(out - v) <= step * (1 + 1e-6))  # one of the two neighbouring levels
        assert np.all(out != 0)  # no level is 0: the support survives
        # unbiased: every mean within 5 standard errors of the true value (the variance of stochastic
        # rounding between levels l and l + step is at most step^2 / 4)
        assert np.all(np.abs(out.mean(0) - v) <= 5 * (step / 2) / np.sqrt(draws))


def test_quantised_payload_round_trip_size_and_bad_input():
    rng = np.random.default_rng(1)
    v = rng.normal(size=1000)
    payload = encode_stochastic(v, 4, np.random.default_rng(2))
    out = decode_stochastic(payload, 4, 1000)
    sym, scale = quantize(v, 4, np.random.default_rng(2))
    np.testing.assert_array_equal(out, level_values(sym, 16, scale))
    assert payload_bits(payload, "quantized")["values"] == 4 * 1000 + 32  # 4 bits a value + the float32 scale
    with pytest.raises(CodecError):
        decode_stochastic(payload, 8, 1000)  # other level count
    with pytest.raises(CodecError):
        decode_stochastic(payload, 4, 999)  # other count
    with pytest.raises(CodecError):
        decode_stochastic(payload[:-3], 4, 1000)  # truncated
    with pytest.raises(ValueError):
        encode_stochastic(np.array([1.0, np.nan]), 4, rng)


def test_support_coding_round_trips_and_equals_the_grid_codings_positions():
    rng = np.random.default_rng(3)
    masks = [rng.random((40, 84)) < 0.2, np.zeros((7, 9), bool), np.ones((5, 6), bool)]
    clustered = np.zeros((30, 50), bool)
    clustered[2:9, 5:20] = clustered[15:28, 30:33] = True
    clustered[rng.integers(0, 30, 20), rng.integers(0, 50, 20)] = True
    masks.append(clustered)
    for mask in masks:
        data = encode_support(mask)
        np.testing.assert_array_equal(decode_support(data), mask)
        # with 16-bit values in mind it makes the same rectangles and positions as the grid coding
        grid = payload_bits(encode_grid(np.where(mask, 1.0, 0.0)), "grid")
        assert payload_bits(data, "support")["positions"] == grid["positions"]
        assert payload_bits(data, "support")["values"] == 0
    data = encode_support(clustered)
    for bad in (data[:-1], data + b"\x00", b"\x07" + data[1:], data[:3]):
        with pytest.raises(CodecError):
            decode_support(bad)
    with pytest.raises(CodecError):
        decode_support(data, max_elements=100)
    assert encode_grid(np.where(clustered, 1.0, 0.0))  # the grid coder is unchanged by the split


def test_support_with_holes_round_trips():
    """Blocks with holes: the grid coding may send a rectangle with zeros inside (its zero values say where S is
    not), a support coded alone may not, since its rectangles are read back as all in S. A frontier run failed on
    this (conv4: 2670 positions decoded for 2669 weights; every upload rejected)."""
    from dturbo.coding.grid import _support_stream

    rng = np.random.default_rng(0)
    with_holes = 0
    for _ in range(40):
        mask = rng.random((40, 60)) < 0.03
        for r, c in zip(rng.integers(0, 36, 6), rng.integers(0, 56, 6), strict=True):
            mask[r : r + 4, c : c + 4] = True
        mask &= rng.random((40, 60)) >= 0.08
        rects = _support_stream(mask, 3, 8)[0]  # what the grid coding (values travel) chooses
        with_holes += any(not mask[r0 : r0 + h, c0 : c0 + w].all() for r0, c0, h, w in rects.tolist())
        for bits in (4, 8, 16):
            np.testing.assert_array_equal(decode_support(encode_support(mask, value_bits=bits)), mask)
    assert with_holes >= 5  # the case is really exercised


def _toy(tmp_path: Path) -> Path:
    x = np.random.default_rng(0).normal(size=(600, 20)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    np.savez(tmp_path / "toy.npz", x_train=x, y_train=y, x_test=x[:150], y_test=y[:150])
    return tmp_path / "toy.npz"


def _config(tmp_path: Path, transmission: dict, rounds: int = 3) -> dict:
    return {
        "experiment": {"rounds": rounds, "seed": 0, "threads": 1},
        "data": {"name": "npz", "path": str(_toy(tmp_path))},
        "federation": {"clients": 3, "partition": "iid"},
        "model": {"name": "mlp", "hidden": [32]},
        "train": {"local_steps": 20, "batch_size": 32, "lr": 0.01},
        "dturbo": {"beta": 0.1, "transmission": {**PAPER_TRANSMISSION, **transmission}, "prior_std_dtype": "float16",
                   "sparsity": {"target_density": 0.3, "warmup_rounds": 0, "ramp_rounds": 2}},
    }


def test_quantised_run_sends_the_bits_it_says_and_learns(tmp_path):
    tr = {"up_bits": 4, "down_bits": 8, "prior_std": "rebuilt"}
    sim = Simulator(parse_config(_config(tmp_path, tr)), tmp_path / "run")
    state = sim.server.init()
    down = sim.server.downlink(state, 0)
    up = sim.client.fit(down, sim.fed.clients[0], 0)
    kept = sum(int(support(state[f"{i.name}.mu"]).sum()) for i in sim.server.layers)
    layers = len(sim.server.layers)
    # values: 8 bits a support weight down + a float32 scale and a float32 sigma per layer + float16 biases
    biases = sum(state[f"{i.name}.bias"].size for i in sim.server.layers)
    assert message_bits(down, sim.server.layouts)["values"] == 8 * kept + 64 * layers + 16 * biases
    assert message_bits(up, sim.server.layouts)["values"] == 4 * kept + 64 * layers + 16 * biases
    assert all(not k.endswith(".prior_std") for k in _field_names(down))  # rebuilt: nothing sent
    rows = Simulator(parse_config(_config(tmp_path, tr)), tmp_path / "run2").run()
    assert float(rows[-1]["accuracy"]) > 0.9 and float(rows[-1]["density"]) <= 0.3
    assert int(rows[-1]["up_positions_bits"]) == 0


def _field_names(message: bytes) -> list[str]:
    from dturbo.codec import decode_message
    return [name for name, _ in decode_message(message)[1]]


def test_a_quantised_upload_is_an_update_added_to_the_servers_mean(tmp_path):
    """up_bits < 16: the client sends mu_t - mu received; the server adds the weighted updates to its own mu_G."""
    sim = Simulator(parse_config(_config(tmp_path, {"up_bits": 12, "down_bits": 12})), tmp_path / "run")
    server, client = sim.server, sim.client
    state = server.init()
    down = server.downlink(state, 0)
    ups = [client.fit(down, sim.fed.clients[c], c) for c in range(3)]
    decoded = [server.decode_uplink(state, u, 0) for u in ups]
    p = np.array([d.n_t for d in decoded], float)
    p /= p.sum()
    new = server.aggregate(state, ups, 0).state
    layer = server.layers[0].name
    mask = support(state[f"{layer}.mu"])
    expect = state[f"{layer}.mu"][mask] + sum(pt * d.layers[layer].mu for pt, d in zip(p, decoded, strict=True))
    kept = support(new[f"{layer}.mu"])[mask]
    np.testing.assert_allclose(new[f"{layer}.mu"][mask][kept], expect[kept].astype(np.float32), rtol=1e-6)


def test_rebuilt_prior_std_equals_the_servers_within_the_stated_tolerance(tmp_path):
    """|sigma_rebuilt / sigma_server - 1| <= (1 - pi~) (b - b_bar) / (2 b~) + 2^-10 on S (docs/communication.md):
    the server's E4 used its pi~ (>= 0.5 on S), the client takes pi~ = 1 and the float16 mu it received."""
    sim = Simulator(parse_config(_config(tmp_path, {"prior_std": "rebuilt"})), tmp_path / "run")
    server, client = sim.server, sim.client
    state = server.init()
    ups = [client.fit(server.downlink(state, 0), sim.fed.clients[c], c) for c in range(3)]
    before, state = state, server.aggregate(state, ups, 0).state
    from dturbo.codec import decode_grid, decode_message, decode_values
    fields = dict(decode_message(server.downlink(state, 1))[1])
    worst = 0.0
    for info in server.layers:
        n, g = info.name, info.prior.gamma_kwargs()
        mu = decode_grid(fields[f"{n}.mu"]).astype(np.float64)
        mask = mu != 0
        sigma = np.full(mask.shape, float(decode_values(fields[f"{n}.sigma"])[0]))
        rebuilt = rebuilt_prior_std(info, mu, sigma, "exact")[mask]
        exact = server.prior_std(state, info)[mask]
        # the server's pi~ of that E4: logit(pi) + E1 of the state the round started with (E3; not kept in the state)
        pt = expit(before[f"{n}.pi_logodds"] + support_evidence(before[f"{n}.a_tilde"], before[f"{n}.b_tilde"],
                                                                info.prior))[mask]
        bound = (1 - pt) * (g["b"] - g["b_bar"]) / (2 * state[f"{n}.b_tilde"][mask]) + 2**-10
        rel = np.abs(rebuilt / exact - 1)
        assert np.all(rel <= bound), float((rel - bound).max())
        worst = max(worst, float(rel.max()))
    assert worst > 0  # they do differ: the test is not comparing a thing with itself


def test_transmission_config_refuses_13_to_15_bits():
    with pytest.raises(ConfigError, match="up_bits"):
        parse_config({"dturbo": {"transmission": {"up_bits": 14}}})


def test_validation_split_is_held_out_of_training_and_reported(tmp_path):
    """data.validation carves a seeded share of the training set before the clients' split: no client trains on
    it, and every evaluated row reports val_accuracy beside the test accuracy."""
    cfg = _config(tmp_path, {}, rounds=2)
    cfg["data"]["validation"] = 0.2
    sim = Simulator(parse_config(cfg), tmp_path / "run")
    fed = sim.fed
    assert len(fed.y_val) == 120 and fed.total_samples == 480
    train_rows = {tuple(r) for c in fed.clients for r in c.x.numpy().round(6).tolist()}
    assert not train_rows & {tuple(r) for r in fed.x_val.numpy().round(6).tolist()}
    rows = sim.run()
    assert all(0 <= float(r["val_accuracy"]) <= 1 and "val_loss" in r for r in rows)
    plain = Simulator(parse_config(_config(tmp_path, {}, rounds=2)), tmp_path / "plain").run()
    assert "val_accuracy" not in plain[0]
