"""``[dturbo.transmission] up_quantizer = "sign"`` (docs/communication.md, "Signs up"): the update up as its signs
times each layer's mean magnitude, 1 bit a value, and each client adds what its last upload rounded off, on the
support it sends, to its next update. The rounding never exceeds the values; the residual is exactly the update less
what the server decodes; a retried round sends the same bytes; the residuals travel through a checkpoint (runs cut
and resumed, and on Flower: tests/test_down_update.py, with signs both ways)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from run_helpers import rows_of
from test_positions_delta import config as delta_config

from dturbo.algorithms.dturbo import DturboClient
from dturbo.algorithms.dturbo.config import TransmissionConfig
from dturbo.algorithms.registry import build_algorithm
from dturbo.federation import build_federation
from dturbo.nn.bayes import bayesian_layers
from dturbo.quantize import decode_stochastic, encode_sign
from dturbo.settings import parse_config


@pytest.fixture(scope="module")
def toy(make_toy) -> Path:
    return make_toy(600)


def config(toy: Path, rounds: int = 6, quantizer: str = "sign", **sections) -> dict:
    """Positions as differences, the update up as signs (1 bit), or at 2 bits on QSGD's norm levels (ternary)."""
    cfg = delta_config(toy, "delta", rounds, **sections)
    cfg["dturbo"]["transmission"] |= {"up_bits": 1 if quantizer == "sign" else 2, "up_quantizer": quantizer}
    return cfg


def test_signs_need_one_bit():
    TransmissionConfig(up_bits=1, up_quantizer="sign")
    for bits in (2, 16):
        with pytest.raises(ValidationError, match="up_quantizer = 'sign' needs up_bits = 1"):
            TransmissionConfig(up_bits=bits, up_quantizer="sign")


def test_the_sign_code_rounds_off_less_than_the_values_and_decodes_as_sent():
    """|v - m sign(v)|^2 = |v|^2 - d m^2 (m the mean magnitude): against brute force on random and heavy-tailed
    vectors, both writings; one bit a value plus the scale and header."""
    rng = np.random.default_rng(0)
    for v in (rng.normal(size=1000), rng.standard_t(2.5, size=999), np.zeros(5), np.array([-0.0, 2.0])):
        for coded in (False, True):
            payload = encode_sign(v, coded)
            got = decode_stochastic(payload, 1, v.size, coded)
            m = np.float32(np.abs(v).mean())
            np.testing.assert_array_equal(got, np.where(v >= 0, m, -m).astype(np.float64))
            # the identity with the exact mean; m travels as a float32
            assert np.sum((v - got) ** 2) == pytest.approx(np.sum(v * v) - v.size * float(m) ** 2, rel=1e-6, abs=1e-9)
            assert np.sum((v - got) ** 2) <= np.sum(v * v) + 1e-9
    assert len(encode_sign(rng.normal(size=8000))) < 8000 / 8 + 64
    with pytest.raises(ValueError, match="NaN or Inf"):
        encode_sign(np.array([1.0, np.nan]))


@pytest.fixture
def halves(toy):
    cfg = parse_config(config(toy, 4, federation={"clients": 3}))
    fed = build_federation(cfg)
    server, client = build_algorithm(cfg, fed)
    return cfg, fed, server, client


def test_the_residual_is_what_the_server_did_not_receive(halves):
    """Round after round and client by client: the residual is 0 off the support sent, and on it the update (the
    trained weights less those received) plus the residual entering, less the value the server decodes from the
    bytes. While a weight stays on the support the decoded uploads therefore add up to its updates less one residual:
    no rounding error accumulates."""
    cfg, fed, server, client = halves
    state = server.init()
    for rnd in range(4):
        down = server.downlinks(state, rnd, [0, 1, 2])
        ups = []
        for c in range(3):
            before = client._residuals.entering(c, rnd).copy()
            up = client.fit(down[c], fed.clients[c], c)
            ups.append(up)
            received = client.messages.decode_downlink(down[c], client.supports.held[c], client._weights.get(c))
            sent = server.messages.decode_uplink(up, [int(d.support.sum()) for d in received.layers], rnd, 10**6)
            after = client._residuals[c].after
            for i, (info, (_, layer), d) in enumerate(zip(client.layers, bayesian_layers(client.model),
                                                          received.layers, strict=True)):
                s, res = d.support, client._on_grid(after, i)
                assert not res[~s].any()
                start = d.mu.astype(np.float32).astype(np.float64)
                update = layer.weight_mu.detach().double().numpy().reshape(info.grid) - start
                np.testing.assert_allclose(sent.layers[info.name].mu + res[s],
                                           update[s] + client._on_grid(before, i)[s], rtol=0, atol=1e-6)
        state = server.aggregate(state, ups, rnd).state
    assert all(np.abs(client._residuals[c].after).max() > 0 for c in range(3))  # signs round a lot off


def test_a_retried_round_sends_the_same_bytes_and_the_residual_survives_a_checkpoint(halves):
    cfg, fed, server, client = halves
    state = server.init()
    down = server.downlinks(state, 0, [0, 1])
    state = server.aggregate(state, [client.fit(down[c], fed.clients[c], c) for c in (0, 1)], 0).state
    second = server.downlinks(state, 1, [0, 1])
    first_try = client.fit(second[0], fed.clients[0], 0)
    assert client.fit(second[0], fed.clients[0], 0) == first_try  # from the residual that entered round 1
    saved = client.export_state()
    assert {"residual/0", "residual/1", "residual_round/0"} <= set(saved)
    again = DturboClient(cfg, client.model_factory)
    again.import_state(saved)
    np.testing.assert_array_equal(again._residuals[0].after, client._residuals[0].after)
    third = server.downlinks(server.aggregate(state, [first_try, client.fit(second[1], fed.clients[1], 1)], 1).state,
                             2, [0])[0]
    assert again.fit(third, fed.clients[0], 0) == client.fit(third, fed.clients[0], 0)
    for bad, why in (({**saved, "residual/0": saved["residual/0"][:-1]}, "the residual of client 0 is float32"),
                     ({**saved, "residual/0": saved["residual/0"].astype(np.float64)}, "float64"),
                     ({k: v for k, v in saved.items() if k != "residual_round/1"}, "client 1 has no round")):
        with pytest.raises(ValueError, match=why):
            DturboClient(cfg, client.model_factory).import_state(bad)


def test_without_signs_the_client_keeps_no_residual(toy):
    cfg = parse_config(config(toy, 2, quantizer="norm", federation={"clients": 3}))
    fed = build_federation(cfg)
    server, client = build_algorithm(cfg, fed)
    state = server.init()
    down = server.downlinks(state, 0, [0])
    client.fit(down[0], fed.clients[0], 0)
    assert not any(k.startswith("residual") for k in client.export_state())


def test_a_sign_run_learns_on_a_bit_a_value(tmp_path, toy):
    """Signs up with error feedback learn as well as QSGD's unbiased ternary levels (within 5 points) at about a bit
    a value, and the bits up are what the 1-bit values and their headers make."""
    from dturbo.sim import Simulator

    Simulator(parse_config(config(toy, 6, quantizer="norm")), tmp_path / "norm").run()
    Simulator(parse_config(config(toy, 6)), tmp_path / "sign").run()
    norm, sign = rows_of(tmp_path / "norm"), rows_of(tmp_path / "sign")
    assert float(sign[-1]["accuracy"]) >= float(norm[-1]["accuracy"]) - 0.05
    assert float(sign[-1]["accuracy"]) > 0.5
