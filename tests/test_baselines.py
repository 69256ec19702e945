"""Baselines (FedAvg, FedPAQ, DSSM): sanity reductions to FedAvg, quantiser and masking properties, the bit
ledger from real bytes, rejection of bad uploads, resume equality."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
from run_helpers import PAPER_TRANSMISSION, TIMING
from safetensors.numpy import load_file

from dturbo.algorithms.base import message_bits
from dturbo.algorithms.dssm import dssm_count, top_k
from dturbo.algorithms.dturbo.messages import decode_prior_std, encode_prior_std
from dturbo.algorithms.registry import build_algorithm
from dturbo.codec import decode_quantized, encode_dense, encode_message, encode_quantized, payload_bits
from dturbo.data import load_dataset
from dturbo.federation import build_federation
from dturbo.ledger import LEDGER_COLUMNS
from dturbo.quantize import qsgd_decode, qsgd_encode
from dturbo.settings import parse_config
from dturbo.sim import Simulator

FMNIST = Path("/usr/share/datasets/fashion-mnist")


def base_config(algorithm: str, **sections) -> dict:
    cfg = {
        "experiment": {"name": "t", "seed": 3, "rounds": 2, "threads": 1, "algorithm": algorithm},
        "data": {"name": "fashion-mnist", "limit_train": 600, "limit_test": 500},
        # iid and 600 / 10: equal client sizes, so "mean of updates" and "weighted by n_t" coincide
        "federation": {"clients": 10, "partition": "iid"},
        "model": {"name": "mlp", "hidden": [32]},
        "train": {"local_epochs": 1, "batch_size": 20, "lr": 0.003},
    }
    for key, value in sections.items():
        cfg[key] = value
    return cfg


@pytest.fixture(scope="module")
def fed():
    if not (FMNIST / "train-images-idx3-ubyte.gz").exists():
        pytest.skip("real Fashion-MNIST not installed")
    ds = load_dataset("fashion-mnist", limit_train=600, limit_test=500, seed=3)
    return build_federation(parse_config(base_config("fedavg")), ds)


def run(tmp_path: Path, fed, name: str, cfg: dict) -> tuple[list[dict], dict]:
    out = tmp_path / name
    rows = Simulator(parse_config(cfg), out, federation=fed).run()
    return rows, load_file(str(out / "checkpoint" / "state.safetensors"))


def assert_same_run(a, b, atol=2e-6):
    (rows_a, state_a), (rows_b, state_b) = a, b
    for ra, rb in zip(rows_a, rows_b, strict=True):
        assert abs(float(ra["accuracy"]) - float(rb["accuracy"])) <= 0.004
        assert float(ra["loss"]) == pytest.approx(float(rb["loss"]), abs=1e-3)
    keys = [k for k in state_a if k.endswith((".w", ".bias"))]
    assert keys
    for k in keys:
        np.testing.assert_allclose(state_a[k], state_b[k], atol=atol, err_msg=k)


def test_fedpaq_without_quantisation_is_fedavg(tmp_path, fed):
    """FedPAQ with no quantisation, r = n and tau = one epoch gives FedAvg's numbers (same seed)."""
    ref = run(tmp_path, fed, "fedavg", base_config("fedavg", fedavg={"dtype": "float32"}))
    paq = run(tmp_path, fed, "fedpaq", base_config("fedpaq", fedpaq={"levels": 0, "dtype": "float32"}))
    assert_same_run(ref, paq)
    # ... while real quantisation (s = 1) does change them
    q1 = run(tmp_path, fed, "fedpaq1", base_config("fedpaq", fedpaq={"levels": 1, "dtype": "float32"}))
    assert not np.allclose(q1[1]["dense1.w"], ref[1]["dense1.w"], atol=1e-4)


def test_dssm_without_masking_or_decay_is_fedavg(tmp_path, fed):
    """DSSM with gamma = 1 and no sampling decay gives FedAvg's numbers (same seed)."""
    ref = run(tmp_path, fed, "fedavg", base_config("fedavg", fedavg={"dtype": "float32"}))
    dssm = run(tmp_path, fed, "dssm", base_config("dssm", dssm={"gamma": 1.0, "decay": 0.0, "dtype": "float32"}))
    assert_same_run(ref, dssm)


def test_dssm_samples_fewer_clients_and_uploads_sparse(tmp_path, fed):
    cfg = base_config("dssm", dssm={"gamma": 0.1, "decay": 0.5, "min_clients": 3})
    cfg["experiment"]["rounds"] = 3
    rows, _ = run(tmp_path, fed, "dssm", cfg)
    assert [int(r["participants"]) for r in rows] == [10, 6, 4]
    for r in rows:
        # top-10% uploads: positions are paid, values are about a tenth of a dense float16 upload
        assert int(r["up_positions_bits"]) > 0
        dense_values = 16 * int(r["participants"]) * sum(s for s in (784 * 32 + 32, 32 * 10 + 10))
        assert int(r["up_values_bits"]) <= 0.11 * dense_values
        assert int(r["down_positions_bits"]) == 0  # dense download


def test_ledger_counts_real_bytes(tmp_path, fed):
    cfg = base_config("fedavg", fedavg={"dtype": "float32"})
    rows, _ = run(tmp_path, fed, "fedavg", cfg)
    n_params = 784 * 32 + 32 + 32 * 10 + 10
    for r in rows:
        parts = {c: int(r[c]) for c in LEDGER_COLUMNS}
        assert sum(v for c, v in parts.items() if c.startswith("up_")) == int(r["up_bits"])
        assert sum(v for c, v in parts.items() if c.startswith("down_")) == int(r["down_bits"])
        assert parts["down_values_bits"] == 10 * 32 * n_params  # float32 dense to 10 clients
        assert parts["up_values_bits"] == 10 * 32 * n_params
        assert parts["up_positions_bits"] == parts["down_positions_bits"] == 0
        assert 0 < parts["down_headers_bits"] < 0.002 * parts["down_values_bits"]
    # and a row's numbers are the csv's
    with open(tmp_path / "fedavg" / "metrics.csv", newline="") as f:
        assert list(csv.DictReader(f))[-1]["up_values_bits"] == str(rows[-1]["up_values_bits"])


@pytest.mark.parametrize("algorithm", ["fedavg", "fedpaq", "dssm"])
def test_bad_uploads_are_rejected_and_the_rest_aggregated(fed, algorithm):
    cfg = parse_config(base_config(algorithm, fedpaq={"levels": 1}))
    server, client = build_algorithm(cfg, fed)
    state = server.init()
    down = server.downlink(state, 0)
    good = client.fit(down, fed.clients[0], 0)
    kind = f"{algorithm}/up"
    bad = [
        good[:-3],  # truncated
        b"junk",
        encode_message("dturbo/up", []),  # another algorithm's message
        encode_message(kind, [("meta", encode_dense(np.array([0.0, 0, 0]), "float64"))]),  # n_t = 0, no layers
    ]
    result = server.aggregate(state, [good, *bad], 0)
    assert result.metrics["clients_ok"] == 1 and result.metrics["clients_rejected"] == len(bad)
    assert len(result.rejected) == len(bad)
    for v in result.state.values():
        assert np.all(np.isfinite(v))


def test_qsgd_is_unbiased_and_costs_its_bits():
    rng = np.random.default_rng(0)
    v = rng.normal(size=50)
    for s in (1, 4, 255):
        sym, norm = qsgd_encode(v, s, rng)
        assert sym.min() >= 0 and sym.max() <= 2 * s
        mean = np.mean([qsgd_decode(*qsgd_encode(v, s, rng)[:1], s, norm) for _ in range(4000)], axis=0)
        assert np.abs(mean - v).max() < 4 * norm / s / np.sqrt(4000) + 1e-9
    sym, norm = qsgd_encode(v, 1, rng)
    payload = encode_quantized(sym, 3, [norm])
    assert payload_bits(payload, "quantized")["values"] == 32 + 8 * ((2 * 50 + 7) // 8)  # norm + 2 bits each
    back, levels, params = decode_quantized(payload)
    assert levels == 3 and np.array_equal(back, sym) and params[0] == np.float32(norm)
    assert np.array_equal(qsgd_encode(np.zeros(5), 3, rng)[0], np.full(5, 3))


def test_top_k_and_dynamic_sampling():
    v = np.array([0.1, -5.0, 3.0, 0.0, -0.2, 4.0])
    assert np.array_equal(top_k(v, 0.5), [0, -5.0, 3.0, 0, 0, 4.0])
    assert np.array_equal(top_k(v, 0.01), [0, -5.0, 0, 0, 0, 0])  # at least one
    assert np.array_equal(top_k(v, 1.0), v)
    counts = [dssm_count(t, 10, 1.0, 0.2, 2) for t in range(20)]
    assert counts[0] == 10 and counts[-1] == 2 and all(a >= b for a, b in zip(counts, counts[1:], strict=False))


def test_log8_prior_std_roundtrip():
    rng = np.random.default_rng(1)
    ps = np.exp(rng.uniform(-6, -2, size=1000))
    payload = encode_prior_std(ps, "log8")
    assert len(payload) < 1000 + 16  # one byte each
    back = decode_prior_std(payload, "log8", 1000)
    assert np.max(np.abs(np.log(back / ps))) <= 4.0 / 510 + 1e-6
    with pytest.raises(ValueError, match="allowed 999"):
        decode_prior_std(payload, "log8", 999)


def test_dturbo_ledger_splits_positions_and_values(fed):
    """The paper's downlink (cluster-coded float16 mu_G): its positions and values apart, summing to its bytes."""
    cfg = parse_config(base_config("dturbo", dturbo={"transmission": PAPER_TRANSMISSION}))
    server, _ = build_algorithm(cfg, fed)
    state = server.init()
    for info in server.layers:  # a sparse support: positions now cost bits
        mask = np.float16(state[f"{info.name}.mu"]) != 0  # S: the nonzeros of mu_G
        mask[:, ::3] = False
        state[f"{info.name}.mu"] *= mask
    down = server.downlink(state, 0)
    bits = message_bits(down, server.layouts)
    assert sum(bits.values()) == 8 * len(down)
    assert bits["positions"] > 0 and bits["values"] > 10 * bits["positions"]


@pytest.mark.parametrize("algorithm", ["fedpaq", "dssm"])
def test_baseline_resume_equals_uninterrupted(tmp_path, fed, algorithm):
    cfg = base_config(algorithm, fedpaq={"levels": 3})
    cfg["experiment"]["rounds"] = 3
    full = Simulator(parse_config(cfg), tmp_path / "full", federation=fed).run()
    cfg["experiment"]["rounds"] = 3
    part = tmp_path / "part"
    short = dict(cfg, experiment=dict(cfg["experiment"], rounds=3))
    sim = Simulator(parse_config(short), part, federation=fed)
    sim.cfg.experiment.rounds = 2  # stop after two rounds, as a killed run would
    sim.run()
    sim2 = Simulator(parse_config(short), part, resume=True, federation=fed)
    rows = sim2.run()
    strip = [{k: v for k, v in r.items() if k not in TIMING} for r in rows]
    ref = [{k: str(v) for k, v in r.items() if k not in TIMING} for r in full]
    assert [{k: str(v) for k, v in r.items()} for r in strip] == ref


def test_dssm_weights_mode_averages_sparse_weights(tmp_path, fed):
    """mode = "weights" (the authors' demo): the global model is the mean of the clients' top-k weights, so it
    is sparse: at most the union of the uploaded positions is nonzero."""
    cfg = base_config("dssm", dssm={"gamma": 0.05, "mode": "weights", "decay": 0.0})
    cfg["experiment"]["rounds"] = 1
    rows, state = run(tmp_path, fed, "w", cfg)
    density = float(rows[-1]["density"])
    assert 0.05 <= density <= 10 * 0.05 + 1e-9  # between one client's top-k and the union of ten
    nonzero = sum(int(np.count_nonzero(state[k])) for k in state if k.endswith(".w"))
    total = sum(state[k].size for k in state if k.endswith(".w"))
    assert nonzero / total == pytest.approx(density)


def test_round_lr_is_torchs_cosine_annealing_and_constant_by_default():
    import torch

    from dturbo.algorithms.local import round_lr

    rounds, lr, f = 7, 0.004, 0.1
    constant = parse_config(base_config("fedavg", experiment={"name": "t", "rounds": rounds}))
    assert [round_lr(constant, t) for t in range(rounds)] == [0.003] * rounds
    cfg = parse_config(base_config("fedavg", experiment={"name": "t", "rounds": rounds},
                                   train={"lr": lr, "lr_schedule": "cosine", "lr_final": f}))
    # an independent computation: torch's CosineAnnealingLR from lr to f * lr over rounds - 1 steps
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=rounds - 1, eta_min=f * lr)
    expected = []
    for _ in range(rounds):
        expected.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    got = [round_lr(cfg, t) for t in range(rounds)]
    assert np.allclose(got, expected, rtol=1e-12)
    assert got[0] == lr and got[-1] == pytest.approx(f * lr) and all(np.diff(got) < 0)
    # a later start: lr until round s, then the same annealing over the rounds left
    s = 3
    late = parse_config(base_config("fedavg", experiment={"name": "t", "rounds": rounds + s},
                                    train={"lr": lr, "lr_schedule": "cosine", "lr_final": f, "lr_decay_start": s}))
    assert np.allclose([round_lr(late, t) for t in range(rounds + s)], [lr] * s + expected, rtol=1e-12)
    # a warm-up: the first w rounds' rates rise linearly to the schedule's (lr/3, 2 lr/3), the schedule otherwise
    warm = parse_config(base_config("fedavg", experiment={"name": "t", "rounds": rounds + s},
                                    train={"lr": lr, "lr_schedule": "cosine", "lr_final": f, "lr_decay_start": s,
                                           "lr_warmup_rounds": 2}))
    assert np.allclose([round_lr(warm, t) for t in range(rounds + s)],
                       [lr / 3, 2 * lr / 3] + [lr] * (s - 2) + expected, rtol=1e-12)
    constant = parse_config(base_config("fedavg", train={"lr": lr, "lr_warmup_rounds": 1}))
    assert [round_lr(constant, t) for t in range(3)] == [lr / 2, lr, lr]


def test_a_cosine_round_trains_at_its_own_rate(fed):
    """The schedule reaches the optimizer: the last round of a cosine run uploads exactly what a constant run at
    lr * lr_final uploads from the same downlink."""
    f = 0.25
    cosine = parse_config(base_config("fedavg", train={"local_epochs": 1, "batch_size": 20, "lr": 0.004,
                                                       "lr_schedule": "cosine", "lr_final": f}))
    constant = parse_config(base_config("fedavg", train={"local_epochs": 1, "batch_size": 20, "lr": 0.004 * f}))
    last = cosine.experiment.rounds - 1
    ups = []
    for cfg in (cosine, constant):
        server, client = build_algorithm(cfg, fed)
        state = server.init()
        ups.append(client.fit(server.downlink(state, last), fed.clients[0], 0))
    assert ups[0] == ups[1]
    # and the first round trains at lr itself: as the constant run at lr, unlike the one at lr * f
    first = {}
    for name, cfg in (("cosine", cosine), ("at lr", parse_config(base_config("fedavg", train={
            "local_epochs": 1, "batch_size": 20, "lr": 0.004}))), ("at lr * f", constant)):
        server, client = build_algorithm(cfg, fed)
        first[name] = client.fit(server.downlink(server.init(), 0), fed.clients[0], 0)
    assert first["cosine"] == first["at lr"] != first["at lr * f"]
