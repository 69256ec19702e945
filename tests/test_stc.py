"""STC (sparse ternary compression, Sattler et al. 2019): the ternary codec, top-k, error feedback on both sides,
the client's model copy and residuals (retry, resume), upload validation, a short run that learns."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest
import tomli_w
import torch
from safetensors.numpy import load_file

from dturbo.algorithms.base import ClientError, fields_dict, frame, message_bits, pack_scalars
from dturbo.algorithms.registry import build_algorithm
from dturbo.algorithms.stc import (
    DOWN_KIND,
    UP_KIND,
    StcClient,
    stc_compress,
    stc_k,
    ternary_dense,
    top_k_indices,
)
from dturbo.codec import (
    _bits_for,
    _BitWriter,
    _varint,
    decode_ternary,
    encode_message,
    encode_ternary,
    payload_bits,
)
from dturbo.config import ConfigError
from dturbo.federation import build_federation
from dturbo.ledger import LEDGER_COLUMNS
from dturbo.settings import parse_config
from dturbo.sim import Simulator

TIMING = {"seconds", "server_seconds"}


@pytest.fixture(scope="module")
def toy(make_toy) -> Path:
    return make_toy(800)


def config(toy: Path, **sections: dict) -> dict:
    cfg: dict = {
        "experiment": {"name": "stc", "seed": 1, "rounds": 4, "threads": 1, "algorithm": "stc"},
        "data": {"name": "npz", "path": str(toy)},
        "federation": {"clients": 4, "alpha": 1.0},
        "model": {"name": "mlp", "hidden": [16]},
        "train": {"local_steps": 20, "lr": 0.01, "batch_size": 32},
        "stc": {"p_up": 0.1, "p_down": 0.1},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


def rows_of(out: Path) -> list[dict[str, str]]:
    with open(out / "metrics.csv", newline="") as f:
        return [{k: v for k, v in r.items() if k not in TIMING} for r in csv.DictReader(f)]


# ---------------------------------------------------------------- codec
@pytest.mark.parametrize("n, k", [(1, 1), (5, 0), (17, 17), (1000, 3), (1000, 400), (100_000, 250)])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_ternary_roundtrip_is_exact(n, k, dtype):
    rng = np.random.default_rng(n + k)
    idx = np.sort(rng.choice(n, size=k, replace=False))
    neg = rng.random(k) < 0.5
    mu = 0.0123
    data = encode_ternary(idx, neg, mu, n, dtype=dtype)
    got_idx, got_neg, got_mu, got_n = decode_ternary(data, max_elements=n)
    assert got_n == n and np.array_equal(got_idx, idx) and np.array_equal(got_neg, neg)
    assert got_mu == float(np.dtype(dtype).type(mu))
    bits = payload_bits(data, "ternary")
    assert sum(bits.values()) == 8 * len(data)
    assert bits["values"] == 8 * np.dtype(dtype).itemsize + k  # mu and one sign bit per position


def test_position_bits_within_the_golomb_bound():
    """Positions cost at most the Rice code with parameter floor(log2(n/k)), computed here independently
    (6-bit parameter, k (b + 1) remainder and stop bits, the quotients in unary) plus the stream's padding, and
    so at most k (log2(n/k) + 3) + 13 bits; and no less than log2 C(n, k), the entropy of the positions."""
    rng = np.random.default_rng(7)
    for n, k in [(100_000, 250), (50_000, 1000), (4096, 40)]:
        idx = np.sort(rng.choice(n, size=k, replace=False))
        bits = payload_bits(encode_ternary(idx, np.zeros(k, bool), 1.0, n), "ternary")["positions"]
        gaps = np.diff(idx, prepend=-1) - 1
        b = int(math.floor(math.log2(n / k)))
        rice = 6 + k * (b + 1) + int((gaps >> b).sum())
        assert bits <= rice + 7
        assert bits <= k * (math.log2(n / k) + 3) + 13
        entropy = (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)
        assert entropy <= bits <= 1.1 * entropy + 16


def test_ternary_decoder_refuses_bad_bytes():
    n = 64
    good = encode_ternary([3, 9, 40], [False, True, False], 0.5, n)
    with pytest.raises(ValueError, match="truncated"):
        decode_ternary(good[:-1])
    with pytest.raises(ValueError, match="trailing|unused"):
        decode_ternary(good + b"\0")
    with pytest.raises(ValueError, match="allowed"):
        decode_ternary(good, max_elements=n - 1)
    for positions in ([9, 3, 40], [3, 3, 40]):  # unsorted, duplicate: index-list scheme written by hand
        assert unsorted_payload(positions, n).startswith(bytes([2]))
        with pytest.raises(ValueError, match="not strictly increasing"):
            decode_ternary(unsorted_payload(positions, n))
    with pytest.raises(ValueError, match="sorted"):
        encode_ternary([9, 3], [False, False], 0.5, n)
    with pytest.raises(ValueError):
        encode_ternary([1], [False], float("nan"), n)


def unsorted_payload(positions: list[int], n: int, mu: float = 0.5) -> bytes:
    """A ternary payload with the index-list position scheme and arbitrary (e.g. unsorted) positions."""
    bw = _BitWriter()
    bw.fields(np.array(positions).reshape(-1, 1), [_bits_for(n)])
    bw.bits(np.zeros(len(positions), np.uint8))
    return bytes([2]) + _varint(n) + _varint(len(positions)) + np.float32(mu).tobytes() + bw.getvalue()


# --------------------------------------------------------------- compressor
def test_top_k_selects_the_largest_magnitudes():
    rng = np.random.default_rng(0)
    v = np.round(rng.normal(size=2000), 2)  # rounding makes ties at the k-th magnitude
    v[rng.choice(2000, 300, replace=False)] = 0.0
    for k in (1, 10, 333, 1700, 2000):
        want = np.sort(np.argsort(-np.abs(v), kind="stable")[:k])  # ties: lower index first
        want = want[v[want] != 0]  # zeros are never sent
        assert np.array_equal(top_k_indices(v, k), want), k
    assert top_k_indices(np.zeros(5), 3).size == 0
    assert [stc_k(n, 0.01) for n in (0, 1, 99, 100, 101)] == [0, 1, 1, 1, 2]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_error_feedback_conserves_mass(dtype):
    """sent + new residual == update + old residual (float64, up to one rounding of the kept entries; the others
    exactly); the sent entries are +-mu with mu the mean kept magnitude as it goes on the wire."""
    rng = np.random.default_rng(1)
    delta, old = rng.normal(size=5000) * 1e-2, rng.normal(size=5000) * 1e-3
    acc = delta + old
    idx, neg, mu, residual = stc_compress(acc, 0.02, dtype)
    sent = ternary_dense(idx, neg, mu, acc.size)
    assert idx.size == stc_k(5000, 0.02) == 100
    assert mu == float(np.dtype(dtype).type(np.abs(acc[idx]).mean()))
    assert np.array_equal(np.sign(sent[idx]), np.sign(acc[idx]))
    rest = np.setdiff1d(np.arange(acc.size), idx)
    assert np.array_equal(residual[rest], acc[rest]) and not sent[rest].any()
    np.testing.assert_allclose(sent + residual, acc, rtol=0, atol=4 * np.finfo(np.float64).eps)


@pytest.fixture(scope="module")
def algo(toy):
    cfg = parse_config(config(toy))
    torch.set_num_threads(cfg.experiment.threads)  # as the Simulator does: 2 busy cores, tiny model
    fed = build_federation(cfg)
    server, client = build_algorithm(cfg, fed)
    return cfg, fed, server, client


def flat_model(client: StcClient) -> np.ndarray:
    from dturbo.algorithms.point import _theta
    from dturbo.nn.bayes import bayesian_layers

    return np.concatenate([_theta(layer) for _, layer in bayesian_layers(client.model)])


def test_client_and_server_error_feedback_in_a_round(algo):
    """Client: decoded upload + kept residual == local weights - downloaded weights + previous residual. Server:
    broadcast update + its new residual == weighted mean of the uploads + its old residual; W moves by exactly
    the broadcast update, which keeps about p_down of the entries."""
    cfg, fed, server, _ = algo
    client = StcClient(cfg, server.model_factory)
    state = server.init()
    ups = []
    for rnd in range(2):
        down = server.downlink(state, rnd)
        ups = []
        for cid in range(cfg.federation.clients):
            prev = client._residuals[cid].after if rnd else np.zeros(client.size)
            up = client.fit(down, fed.clients[cid], cid)
            got = server.decode_uplink(state, up, rnd)
            update, kept = got.update, got.kept
            start = client._model.theta.astype(np.float64)
            acc = flat_model(client) - start + prev
            np.testing.assert_allclose(update + client._residuals[cid].after, acc, rtol=0, atol=1e-15)
            assert kept <= sum(server.k_up.values())
            ups.append(up)
        result = server.aggregate(state, ups, rnd)
        new = result.state
        n_t = np.array([len(c) for c in fed.clients], float)
        mean = (n_t / n_t.sum()) @ np.stack([server.decode_uplink(state, u).update for u in ups])
        for t in server.tensors:
            np.testing.assert_allclose(new[f"{t.name}.sent"] + new[f"{t.name}.residual"],
                                       mean[t.sl] + state[f"{t.name}.residual"], rtol=0, atol=1e-15)
            assert np.count_nonzero(new[f"{t.name}.sent"]) <= stc_k(t.size, cfg.stc.p_down)
        for info in server.layers:
            moved = new[f"{info.name}.w"].reshape(-1) - state[f"{info.name}.w"].reshape(-1)
            np.testing.assert_array_equal(new[f"{info.name}.w"].reshape(-1),
                                          state[f"{info.name}.w"].reshape(-1) + new[f"{info.name}.w.sent"])
            assert 0 < np.count_nonzero(moved) <= stc_k(moved.size, cfg.stc.p_down)
        assert result.metrics["down_density"] <= 0.11 and result.metrics["clients_ok"] == 4
        state = new


def test_client_rebuilds_the_model_or_refuses(algo):
    """A client rebuilds the server's model from the update broadcast; one without a copy of the previous model,
    or whose copy disagrees with the digest, fails with a reason instead of training from wrong weights. A round
    run again (a retry) gives the same upload: the residual is not advanced twice."""
    cfg, fed, server, _ = algo
    client = StcClient(cfg, server.model_factory)
    state = server.init()
    ups = [client.fit(server.downlink(state, 0), fed.clients[c], c) for c in range(4)]
    state = server.aggregate(state, ups, 0).state
    down = server.downlink(state, 1)
    first = client.fit(down, fed.clients[2], 2)
    assert client.fit(down, fed.clients[2], 2) == first  # retry of round 1: same residual, same bytes
    np.testing.assert_array_equal(client._model.theta,
                                  np.concatenate([np.concatenate([state[f"{i.name}.w"].reshape(-1),
                                                                  state[f"{i.name}.bias"]]) for i in server.layers]))
    fresh = StcClient(cfg, server.model_factory)
    with pytest.raises(ClientError, match="holds no copy"):
        fresh.fit(down, fed.clients[0], 0)
    fields = fields_dict(down, DOWN_KIND)
    fields["digest"] = bytes(8)
    other = StcClient(cfg, server.model_factory)
    other.fit(server.downlink(server.init(), 0), fed.clients[0], 0)
    with pytest.raises(ClientError, match="does not match"):
        other.fit(frame(DOWN_KIND, fields), fed.clients[0], 0)


def test_partial_participation_is_refused(toy):
    cfg = parse_config(config(toy, federation={"clients_per_round": 2}))
    with pytest.raises(ConfigError, match="clients_per_round"):
        build_algorithm(cfg, build_federation(cfg))


def test_bad_uploads_are_rejected_with_a_reason(algo):
    cfg, fed, server, _ = algo
    client = StcClient(cfg, server.model_factory)
    state = server.init()
    good = client.fit(server.downlink(state, 0), fed.clients[0], 0)
    fields = fields_dict(good, UP_KIND)
    name = f"{server.tensors[0].name}.delta"
    size = server.tensors[0].size
    assert size == 192 and 2 ** _bits_for(size) - 1 >= size  # 12 inputs x 16 hidden; room for a bad position
    idx, neg, mu, _ = decode_ternary(fields[name])

    def with_field(payload: bytes) -> bytes:
        return frame(UP_KIND, {**fields, name: payload})

    nan_mu = bytearray(fields[name])
    mu_at = 1 + len(_varint(size)) + len(_varint(idx.size))  # after the flags and the two varints
    nan_mu[mu_at : mu_at + 4] = np.float32("nan").tobytes()
    too_many = stc_k(size, cfg.stc.p_up) + 1
    bad = {
        "length 191": with_field(encode_ternary(idx[idx < size - 1], neg[idx < size - 1], mu, size - 1)),
        "more than the allowed": with_field(encode_ternary(idx, neg, mu, size + 1)),
        "more than k": with_field(encode_ternary(np.arange(too_many), np.zeros(too_many, bool), mu, size)),
        "invalid magnitude": with_field(bytes(nan_mu)),
        "not strictly increasing": with_field(unsorted_payload([5, 1], size)),
        "out of range": with_field(unsorted_payload([1, 2 ** _bits_for(size) - 1], size)),
        "truncated": good[:-2],
        "missing field": frame(UP_KIND, {k: v for k, v in fields.items() if k != name}),
        "unexpected fields": frame(UP_KIND, {**fields, "extra": b""}),
        "stale": frame(UP_KIND, {**fields, "meta": pack_scalars([5, 0, len(fed.clients[0])])}),
        "expected a 'stc/up'": encode_message("fedavg/up", list(fields.items())),
    }
    result = server.aggregate(state, [good, *bad.values()], 0)
    assert result.metrics["clients_ok"] == 1 and result.metrics["clients_rejected"] == len(bad)
    for why, msg in zip(bad, result.rejected, strict=True):
        assert why in msg, (why, msg)
    for v in result.state.values():
        assert np.all(np.isfinite(v))


def test_ledger_splits_the_messages(algo):
    cfg, fed, server, _ = algo
    client = StcClient(cfg, server.model_factory)
    state = server.init()
    down0 = server.downlink(state, 0)
    bits0 = message_bits(down0, server.layouts)
    assert bits0["positions"] == 0 and bits0["values"] == 32 * server.size  # round 0: the model, dense float32
    up = client.fit(down0, fed.clients[0], 0)
    bits = message_bits(up, server.layouts)
    assert sum(bits.values()) == 8 * len(up) and bits["positions"] > 0
    kept = sum(stc_k(t.size, cfg.stc.p_up) for t in server.tensors)
    assert bits["values"] == kept + 32 * len(server.tensors)  # a sign bit each, one float32 mu per tensor
    state = server.aggregate(state, [up], 0).state
    down1 = server.downlink(state, 1)
    assert message_bits(down1, server.layouts)["positions"] > 0 and len(down1) < len(down0) / 4


# ------------------------------------------------------------------ runs
def test_short_run_learns_and_resume_is_identical(tmp_path, toy):
    cfg = config(toy)
    full = Simulator(parse_config(cfg), tmp_path / "full").run()
    assert float(full[-1]["accuracy"]) > 0.6  # 4 classes: chance is about 0.25
    assert float(full[-1]["accuracy"]) > float(full[0]["accuracy"])
    for r in full:
        assert sum(int(r[c]) for c in LEDGER_COLUMNS if c.startswith("up_")) == int(r["up_bits"])
        assert float(r["up_density"]) <= 0.11 and float(r["down_density"]) <= 0.11
    assert int(full[1]["down_bits"]) < int(full[0]["down_bits"]) / 4  # updates after the dense first model
    short = config(toy, experiment={"rounds": 2})
    Simulator(parse_config(short), tmp_path / "cut").run()
    Simulator(parse_config(cfg), tmp_path / "cut", resume=True).run()
    assert rows_of(tmp_path / "cut") == rows_of(tmp_path / "full")
    a = load_file(str(tmp_path / "full" / "checkpoint" / "state.safetensors"))
    b = load_file(str(tmp_path / "cut" / "checkpoint" / "state.safetensors"))
    assert a.keys() == b.keys() and any(k.startswith("clients/residual/") for k in a)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_inprocess_flower_run_equals_simulator(tmp_path, toy):
    pytest.importorskip("flwr", reason="flwr is not installed")
    from dturbo.flower.inprocess import run_inprocess

    cfg = config(toy, experiment={"rounds": 2})
    path = tmp_path / "stc.toml"
    path.write_text(tomli_w.dumps(cfg))
    Simulator(parse_config(cfg), tmp_path / "sim").run()
    run_inprocess(path, tmp_path / "flower")
    assert rows_of(tmp_path / "sim") == rows_of(tmp_path / "flower")
