"""FedPM (Isik et al., ICLR 2023): the range-coded masks (round trip, cost against the cross-entropy, hostile
bytes), the Beta-Bernoulli aggregation against a hand count, frozen weights that never travel, the bit ledger,
rejection of bad uploads, learning on toy data and resume equality."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from run_helpers import TIMING

from dturbo.algorithms.base import ClientData, frame, message_bits, pack_scalars
from dturbo.algorithms.fedpm import (
    FedPmClient,
    FedPmServer,
    beta_update,
    dequantize_probs,
    posterior_probs,
    quantize_probs,
)
from dturbo.algorithms.registry import build_algorithm
from dturbo.codec import CodecError, decode_message, encode_dense, encode_message, payload_bits
from dturbo.coding.masks import (
    decode_mask,
    decode_mask_payload,
    encode_mask,
    encode_mask_payload,
    mask_cost_bits,
)
from dturbo.config import ConfigError
from dturbo.federation import build_federation
from dturbo.settings import parse_config
from dturbo.sim import Simulator


# ------------------------------------------------------------------------------------------ mask coding
def _cases(rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    n = 3000
    p = rng.random(n)
    polar = rng.beta(0.2, 0.2, n)
    edge = rng.choice([0.0, 1.0, 0.5], n)
    return [
        ((rng.random(n) < p).astype(np.uint8), p),
        ((rng.random(n) < polar).astype(np.uint8), polar),
        (np.zeros(n, np.uint8), p),  # all zero
        (np.ones(n, np.uint8), p),  # all one
        ((rng.random(n) < edge).astype(np.uint8), edge),  # p at 0 and 1, bits that follow them
        (np.ones(5, np.uint8), np.zeros(5)),  # bits the model says are impossible: still codable
        (np.array([1], np.uint8), np.array([0.3])),
    ]


def test_mask_round_trip_and_edges():
    rng = np.random.default_rng(0)
    for bits, probs in _cases(rng):
        data = encode_mask(bits, probs)
        assert len(data) % 4 == 0
        back = decode_mask(data, probs, bits.size)
        assert back.dtype == np.uint8 and np.array_equal(back, bits)
        for model in ("global", "empirical", "best"):
            payload = encode_mask_payload(bits, probs, model)
            assert np.array_equal(decode_mask_payload(payload, probs, bits.size), bits)
    assert encode_mask(np.zeros(0, np.uint8), np.zeros(0)) == b""
    assert decode_mask(b"", np.zeros(0), 0).shape == (0,)


def test_coded_size_is_close_to_the_cross_entropy():
    """8 x bytes is within two 32-bit words + 1% of sum(-log2 p(m)), computed here independently."""
    rng = np.random.default_rng(1)
    for bits, probs in _cases(rng)[:5]:
        xent = float(np.sum(np.where(bits == 1, -np.log2(np.maximum(probs, 1e-300)),
                                     -np.log2(np.maximum(1 - probs, 1e-300)))))
        xent = min(xent, 24.0 * bits.size)  # a p = 0 outcome costs the coder's 24-bit floor, not infinity
        assert mask_cost_bits(bits, probs) == pytest.approx(xent) or not math.isfinite(mask_cost_bits(bits, probs))
        coded = 8 * len(encode_mask(bits, probs))
        assert xent - 64 <= coded <= 1.01 * xent + 64, (coded, xent)
    # "best" never costs more than about 1 bit per bit: the empirical model bounds it by H(fraction of ones)
    bits = (rng.random(5000) < 0.5).astype(np.uint8)
    adversarial = np.where(bits == 1, 0.01, 0.99)  # the global model says the opposite of every bit
    assert 8 * len(encode_mask_payload(bits, adversarial, "best")) <= 5000 + 80
    assert 8 * len(encode_mask_payload(bits, adversarial, "global")) > 6 * 5000


def test_garbage_and_truncated_masks_raise():
    rng = np.random.default_rng(2)
    n = 4000
    p = rng.random(n)
    bits = (rng.random(n) < p).astype(np.uint8)
    data = encode_mask(bits, p)
    bad = [
        data[:-4],  # truncated by a word
        data[:-1],  # not whole words
        data[: len(data) // 2],
        data + bytes(4),  # padded
        rng.integers(0, 256, len(data), dtype=np.uint8).tobytes(),  # garbage
        b"",
        bytes(4 * n),  # far more than n bits can take
    ]
    for payload in bad:
        with pytest.raises(CodecError):
            decode_mask(payload, p, n)
    with pytest.raises(CodecError):
        decode_mask(data, p, n, max_elements=n - 1)  # bounded decoded length
    with pytest.raises(CodecError):
        decode_mask("not bytes", p, n)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        decode_mask(data, p[:-1], n)  # the receiver's model must fit the count
    with pytest.raises(ValueError):
        encode_mask(np.array([0, 2, 1]), np.full(3, 0.5))  # not binary
    with pytest.raises(ValueError):
        encode_mask(np.array([0, 1]), np.array([0.5, np.nan]))  # constriction would panic: refused first
    payload = encode_mask_payload(bits, p, "empirical")
    for corrupt in (b"\x07" + payload[1:], payload[:1] + bytes([0x7F]) + payload[2:], payload[:3]):
        with pytest.raises(CodecError):
            decode_mask_payload(corrupt, p, n)


# ------------------------------------------------------------------------------------------- federation
def config(path: Path, **sections: dict) -> dict:
    cfg = {
        "experiment": {"name": "t", "seed": 5, "rounds": 3, "threads": 1, "algorithm": "fedpm"},
        "data": {"name": "npz", "path": str(path)},
        "federation": {"clients": 4, "partition": "iid"},
        "model": {"name": "mlp", "hidden": [256]},
        "train": {"local_epochs": 3, "batch_size": 32, "lr": 0.1},  # Adam, lr 0.1 as the authors' code
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread, as the runs' experiment.threads = 1 (the tests that call fit() directly get it too; on
    a shared 2-core machine more threads only contend)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def toy(make_toy) -> Path:
    return make_toy(1200)


@pytest.fixture(scope="module")
def fed(toy):
    return build_federation(parse_config(config(toy)))


def upload(server: FedPmServer, state: dict, masks: dict[str, np.ndarray], round_idx: int, n_t: int = 10) -> bytes:
    """A client's upload of the given masks, coded with the global probabilities as a real client does."""
    probs = server.probs(state)
    fields = {"meta": pack_scalars([round_idx, 0, n_t])}
    for info in server.layers:
        fields[f"{info.name}.mask"] = encode_mask_payload(masks[info.name], probs[info.name])
    fields["metrics"] = pack_scalars([1.0])
    return frame(server.messages.up.kind, fields)


def test_beta_posterior_equals_a_hand_count(toy, fed):
    cfg = parse_config(config(toy, fedpm={"reset_every": 2, "lambda0": 2.0, "epsilon": 0.0, "down_bits": 16}))
    server, _ = build_algorithm(cfg, fed)
    state = server.init()
    rng = np.random.default_rng(3)
    masks = [{i.name: (rng.random(i.size) < 0.4).astype(np.uint8) for i in server.layers} for _ in range(3)]
    result = server.aggregate(state, [upload(server, state, m, 0) for m in masks], 0)
    assert result.metrics["clients_ok"] == 3 and result.metrics["clients_rejected"] == 0
    for info in server.layers:
        ones = sum(m[info.name].astype(float) for m in masks)  # by hand
        alpha, beta = 2.0 + ones, 2.0 + (3 - ones)
        np.testing.assert_array_equal(result.state[f"{info.name}.alpha"], alpha)
        np.testing.assert_array_equal(result.state[f"{info.name}.beta"], beta)
        mode = (alpha - 1) / (alpha + beta - 2)  # Beta mode: (1 + ones) / 5
        np.testing.assert_allclose(dequantize_probs(result.state[f"{info.name}.level"], 16), mode, atol=1 / 65535)
    # round 1 is not a reset round (reset_every = 2): the counts accumulate; round 2 starts from the prior again
    state1 = result.state
    again = server.aggregate(state1, [upload(server, state1, masks[0], 1)], 1).state
    reset = server.aggregate(state1, [upload(server, state1, masks[0], 2)], 2).state
    for info in server.layers:
        np.testing.assert_array_equal(again[f"{info.name}.alpha"], state1[f"{info.name}.alpha"] + masks[0][info.name])
        np.testing.assert_array_equal(reset[f"{info.name}.alpha"], 2.0 + masks[0][info.name])
    # the library functions on their own, and the authors' squeeze with epsilon
    a, b = beta_update(np.ones(3), np.ones(3), np.array([[1, 0, 1], [1, 0, 0]]))
    assert a.tolist() == [3, 1, 2] and b.tolist() == [1, 3, 2]
    np.testing.assert_allclose(posterior_probs(a, b, "mode", 0.01), [0.99, 0.01, 0.5])
    np.testing.assert_allclose(posterior_probs(a, b, "mean", 0.0), [0.75, 0.25, 0.5])
    assert quantize_probs(np.array([0.0, 0.5, 1.0]), 8).tolist() == [0, 128, 255]


def test_frozen_weights_match_and_never_travel(toy, fed):
    cfg = parse_config(config(toy))
    server, client = build_algorithm(cfg, fed)
    assert isinstance(server, FedPmServer) and isinstance(client, FedPmClient)
    frozen = client.frozen()
    for info in server.layers:
        np.testing.assert_array_equal(frozen[info.name], server.frozen[info.name])
    state = server.init()
    down = server.downlink(state, 0)
    before = {k: v.copy() for k, v in client.frozen().items()}
    up = client.fit(down, fed.clients[0], 0)
    for name, values in client.frozen().items():  # training moved only the scores
        np.testing.assert_array_equal(values, before[name])
    n_params = sum(i.size for i in server.layers)
    assert {n.rsplit(".", 1)[-1] for n, _ in decode_message(down)[1]} == {"meta", "theta"}
    assert {n.rsplit(".", 1)[-1] for n, _ in decode_message(up)[1]} == {"meta", "mask", "metrics"}
    down_bits, up_bits = message_bits(down, server.layouts), message_bits(up, server.layouts)
    assert sum(down_bits.values()) == 8 * len(down) and sum(up_bits.values()) == 8 * len(up)
    assert down_bits["values"] == 8 * n_params  # theta_G on 8-bit levels, nothing else
    assert up_bits["values"] <= 1.0 * n_params + 64 * len(server.layers)  # at most ~1 bit per parameter
    assert 8 * len(up) <= 1.1 * n_params  # the whole upload, framing included
    payload = dict(decode_message(up)[1])[f"{server.layers[0].name}.mask"]
    assert payload_bits(payload, "mask")["headers"] in (8, 16, 24, 32)


def test_bad_uploads_are_rejected_with_a_reason(toy, fed):
    cfg = parse_config(config(toy))
    server, client = build_algorithm(cfg, fed)
    state = server.init()
    good = client.fit(server.downlink(state, 0), fed.clients[0], 0)
    kind, fields = decode_message(good)
    fields = dict(fields)
    name = f"{server.layers[0].name}.mask"
    small = server.layers[0].size - 7

    def with_field(payload: bytes) -> bytes:
        return encode_message(kind, list({**fields, name: payload}.items()))

    probs = server.probs(state)[server.layers[0].name]
    bad = {
        "truncated": good[:-5],
        "wrong kind": encode_message("fedavg/up", list(fields.items())),
        "wrong length": with_field(encode_mask_payload(np.ones(small, np.uint8), probs[:small])),
        "not a mask": with_field(encode_dense(np.full(server.layers[0].size, 0.5), "float16")),
        "truncated mask": with_field(fields[name][:-4]),
        "stale round": client.fit(server.downlink(state, 1), fed.clients[1], 1),
        "missing layer": encode_message(kind, [(k, v) for k, v in fields.items() if k != name]),
    }
    result = server.aggregate(state, [good, *bad.values()], 0)
    assert result.metrics["clients_ok"] == 1 and result.metrics["clients_rejected"] == len(bad)
    assert all(msg.split(": ", 1)[1] for msg in result.rejected)  # each with a reason
    assert any("stale" in msg for msg in result.rejected)


def test_config_section_is_validated(toy):
    with pytest.raises(ConfigError, match="fedpm.lambdo"):
        parse_config(config(toy, fedpm={"lambdo": 1.0}))
    with pytest.raises(ConfigError, match="lambda0 >= 1"):
        parse_config(config(toy, fedpm={"lambda0": 0.5}))
    assert parse_config(config(toy, fedpm={"lambda0": 0.5, "estimate": "mean"})).fedpm.lambda0 == 0.5


def test_learns_and_resume_gives_the_same_run(tmp_path, toy, fed):
    full = Simulator(parse_config(config(toy)), tmp_path / "full", federation=fed).run()
    accuracy = [float(r["accuracy"]) for r in full]
    assert accuracy[-1] >= 0.6  # 4 classes: chance is about 0.25
    for r in full:
        assert 0 < float(r["density"]) < 1
        assert float(r["bits_per_param_up"]) <= 1.1 and int(r["clients_ok"]) == 4
        assert int(r["up_positions_bits"]) == int(r["down_positions_bits"]) == 0
    # the global model is w_init * mask: its zero weights are the density the row reports
    server, _ = build_algorithm(parse_config(config(toy)), fed)
    from safetensors.numpy import load_file

    state = load_file(str(tmp_path / "full" / "checkpoint" / "state.safetensors"))
    model = server.global_model(state)
    assert not model.training
    weights = [p.detach().numpy() for n, p in model.named_parameters() if n.endswith("weight_mu")]
    nonzero = sum(int(np.count_nonzero(w)) for w in weights) / sum(w.size for w in weights)
    assert nonzero == pytest.approx(float(full[-1]["density"]))
    # a run stopped after two rounds and resumed gives the very same rows
    part = tmp_path / "part"
    sim = Simulator(parse_config(config(toy)), part, federation=fed)
    sim.cfg.experiment.rounds = 2
    sim.run()
    rows = Simulator(parse_config(config(toy)), part, resume=True, federation=fed).run()
    strip = [{k: str(v) for k, v in r.items() if k not in TIMING} for r in rows]
    assert strip == [{k: str(v) for k, v in r.items() if k not in TIMING} for r in full]


def test_client_training_is_a_pure_function_of_its_inputs(toy, fed):
    """Same downlink, data and client id: the same bytes (the seeded mask draws); another client: other bytes."""
    cfg = parse_config(config(toy, train={"local_epochs": 1}))
    server, client = build_algorithm(cfg, fed)
    down = server.downlink(server.init(), 0)
    data: ClientData = fed.clients[0]
    assert client.fit(down, data, 0) == client.fit(down, data, 0)
    assert client.fit(down, data, 0) != client.fit(down, data, 1)
