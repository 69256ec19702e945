"""Hostile clients: one upload never breaks, bloats or silently poisons a run. Well-formed uploads outside the round's
bounds are refused with their reason (values, sigma, norms, n_t, the sender's id, the training loss), the robust rules
are exact, the ledger sizes uploads from their framing in bounded memory, and runs with attackers finish, resume
identically and are reproducible."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from run_helpers import cut_and_resume, rows_of

from dturbo.algorithms.base import ClientData, decode_message, encode_message, pack_scalars, unpack_scalars
from dturbo.algorithms.bounds import GROWTH, VALUE_CAP
from dturbo.algorithms.registry import build_algorithm
from dturbo.algorithms.robust import (
    Bulyan,
    CenteredClip,
    Krum,
    Median,
    RobustAggregation,
    TrimmedMean,
    aligned,
    apart,
    cosines,
    krum_scores,
    ordinary,
)
from dturbo.attacks import ATTACKS, RoundView, hostile_clients
from dturbo.codec import decode_dense, decode_quantized, encode_grid, encode_quantized, encode_ternary, encode_values
from dturbo.config import RobustConfig
from dturbo.federation import build_federation
from dturbo.ledger import Traffic
from dturbo.settings import parse_config
from dturbo.sim import Simulator
from dturbo.transport import ClientLost, InProcessClients

METHODS = ("dturbo", "fedavg", "fedpaq", "dssm", "stc", "fedpm", "feddst")
INSIDE = ("sign_flip", "scaled_sign_flip", "alie", "ipm", "plain_state", "calibration")


@pytest.fixture(scope="module")
def toy(make_toy) -> Path:
    return make_toy(800)


def config(toy: Path, rounds: int = 3, **sections) -> dict:
    cfg = {
        "experiment": {"seed": 4, "rounds": rounds, "threads": 1},
        "data": {"name": "npz", "path": str(toy)},
        "federation": {"clients": 6, "partition": "iid"},
        "model": {"name": "mlp", "hidden": [16]},
        "train": {"local_steps": 4, "lr": 0.01},
        "dturbo": {"beta": 0.01, "sparsity": {"target_density": 0.5, "warmup_rounds": 1, "ramp_rounds": 1}},
        "dssm": {"min_clients": 2},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


def setup(toy: Path, algorithm: str, **sections):
    cfg = parse_config(config(toy, experiment={"algorithm": algorithm}, **sections))
    fed = build_federation(cfg)
    server, client = build_algorithm(cfg, fed)
    state = server.init()
    ups = [client.fit(down, fed.clients[c], c) for c, down in server.downlinks(state, 0, [0, 1, 2]).items()]
    return cfg, fed, server, client, state, ups


def with_field(upload: bytes, name: str, payload: bytes) -> bytes:
    kind, fields = decode_message(upload)
    assert name in dict(fields), (name, [n for n, _ in fields])
    return encode_message(kind, [(n, payload if n == name else p) for n, p in fields])


def meta(upload: bytes, **changes: float) -> bytes:
    r, c, n = unpack_scalars(dict(decode_message(upload)[1])["meta"], 3)
    new = {"round": r, "client": c, "n_t": n} | changes
    return with_field(upload, "meta", pack_scalars([new["round"], new["client"], new["n_t"]]))


# ------------------------------------------------------------------------------------------- the bounds
def test_overflowing_values_are_refused_and_the_next_downlink_is_sent(toy):
    """sigma 3e38 (D-Turbo-VBI, one sigma per layer), a QSGD norm of 3e38 (FedPAQ), mu 3e38 (STC): finite, yet
    beyond the round's bounds; refused with the reason, and the state stays sendable."""
    cases = {
        "dturbo": ("dense1.sigma", encode_values(np.array([3e38]), "float32")),
        "fedpaq": ("dense1.theta", None),
        "stc": ("dense1.w.delta", encode_ternary(np.array([0, 5]), np.array([False, True]), 3e38, 16 * 12,
                                                 "float32")),
    }
    for algorithm, (name, payload) in cases.items():
        _, _, server, _, state, ups = setup(toy, algorithm)
        if payload is None:  # the honest symbols with the norm 3e38
            sym, levels, _ = decode_quantized(dict(decode_message(ups[1])[1])[name])
            payload = encode_quantized(sym, levels, [3e38])
        bad = with_field(ups[1], name, payload)
        result = server.aggregate(state, [ups[0], bad, ups[2]], 0, [0, 1, 2])
        assert result.metrics["clients_ok"] == 2 and len(result.rejected) == 1, algorithm
        assert result.rejected[0].uplink == 1 and "beyond the bound" in result.rejected[0].reason, result.rejected
        server.downlinks(result.state, 1, [0, 1, 2])  # encodes: nothing of the refused upload got in


@pytest.mark.parametrize("algorithm", METHODS)
def test_float16_extremes_a_false_n_t_a_copy_a_spoof_and_a_bad_loss_are_refused(toy, algorithm):
    cfg, fed, server, _, state, ups = setup(toy, algorithm)
    n = fed.total_samples
    hostile = {
        "n_t": (meta(ups[1], n_t=n), "holds"),
        "copy": (ups[0], "claims to be client 0's"),
        "spoof": (meta(ups[1], client=2), "claims to be client 2's"),
        "loss": (with_field(ups[1], "metrics", bytes([3, 1]) + np.array([np.nan], "<f8").tobytes()
                            if algorithm != "dturbo" else bytes([3, 2]) + np.array([-1e300, 0.0], "<f8").tobytes()),
                 "loss" if algorithm != "fedpm" else "non-finite"),
    }
    if algorithm != "fedpm":  # FedPM's upload is a mask: no value to exaggerate
        hostile["values"] = (ATTACKS["values"]().rewrite(ups[1], RoundView(server, cfg, 0, 1, b"", {})), "bound")
    for what, (bad, reason) in hostile.items():
        result = server.aggregate(state, [ups[0], bad, ups[2]], 0, [0, 1, 2])
        assert [r.uplink for r in result.rejected] == [1], (what, result.rejected)
        assert reason in result.rejected[0].reason, (what, result.rejected)
    honest = server.aggregate(state, ups, 0, [0, 1, 2])
    assert honest.metrics["clients_rejected"] == 0 and honest.metrics["clients_ok"] == 3


def test_the_bounds_follow_the_global_model():
    from dturbo.algorithms.bounds import Limit, magnitude, sigma_limit

    assert magnitude(np.array([0.3, -0.2])) == GROWTH  # at least 1 x GROWTH
    assert magnitude(np.array([-5.0])) == 5 * GROWTH
    assert magnitude(np.array([1e9])) == VALUE_CAP
    assert sigma_limit(np.array([0.01, 0.02])) == pytest.approx(0.02 * GROWTH)
    update = Limit(10.0, reference=np.array([9.0, 0.0]))
    assert update.refusal("u", np.array([1.0, -10.0])) is None
    assert "makes weights of magnitude 10.5" in update.refusal("u", np.array([1.5, 0.0]))
    assert "> 0" in Limit(1.0, positive=True).refusal("s", np.array([0.5, 0.0]))


# --------------------------------------------------------------------------------------- robust rules
def test_robust_rules_against_independent_computations():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 30))
    p = rng.random(7)
    p /= p.sum()
    assert np.array_equal(Median().combine(x, p), np.median(x, axis=0))
    for j in range(30):  # trimmed mean: drop the 2 lowest and 2 highest of 7 in every coordinate
        col = sorted(x[:, j])
        assert TrimmedMean(0.3).combine(x, p)[j] == pytest.approx(np.mean(col[2:5]))
    f = 2
    brute = [sum(sorted(float(np.sum((x[i] - x[k]) ** 2)) for k in range(7) if k != i)[: 7 - f - 2]) for i in range(7)]
    np.testing.assert_allclose(krum_scores(x, f), brute, rtol=1e-10)
    kept = np.sort(np.argsort(brute)[: 7 - f])
    np.testing.assert_allclose(Krum(f).combine(x, p), (p[kept] / p[kept].sum()) @ x[kept], rtol=1e-12)
    # Bulyan with f = 1 on 7 rows: 5 chosen one at a time by Krum, then per coordinate the mean of the 3 nearest
    # their median
    left, chosen = list(range(7)), []
    for _ in range(5):
        scores = [sum(sorted(float(np.sum((x[i] - x[k]) ** 2)) for k in left if k != i)[: max(1, len(left) - 3)])
                  for i in left]
        chosen.append(left.pop(int(np.argmin(scores))))
    sel = x[sorted(chosen)]
    med = np.median(sel, axis=0)
    expected = [np.mean(sorted(sel[:, j], key=lambda v, m=med[j]: abs(v - m))[:3]) for j in range(30)]
    np.testing.assert_allclose(Bulyan(1).combine(x, p), expected, rtol=1e-12)
    # clipping: an update longer than the norm is scaled onto it, a shorter one kept
    agg = RobustAggregation(RobustConfig(rule="mean", clip_norm=1.0))
    ref = np.zeros(2)
    out = agg.combine([np.array([3.0, 4.0]), np.array([0.3, 0.4])], np.array([0.5, 0.5]), ref)
    np.testing.assert_allclose(out, 0.5 * np.array([0.6, 0.8]) + 0.5 * np.array([0.3, 0.4]))


def test_centered_clipping_against_an_independent_computation_and_its_bound():
    """Centered clipping written out step by step; with a radius no row reaches it is the mean after one step; a
    step moves the centre by at most the radius, so 3 of 10 rows a million away leave it by the honest rows, where
    the mean goes 1e5 away."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(10, 40))
    p = np.full(10, 0.1)
    v = np.median(x, axis=0)
    for _ in range(2):
        d = x - v
        norms = np.linalg.norm(d, axis=1)
        tau = 0.7 * np.median(norms)
        v = v + np.mean([di * min(1.0, tau / n) for di, n in zip(d, norms, strict=True)], axis=0)
    np.testing.assert_allclose(CenteredClip(0.7, 2).combine(x, p), v, rtol=1e-12)
    np.testing.assert_allclose(CenteredClip(1e9, 1).combine(x, p), x.mean(axis=0), rtol=1e-12)
    honest = x[:7] * 0.1 + 1.0
    hostile = np.vstack([honest, np.full((3, 40), -1e6)])
    out = CenteredClip(1.0, 1).combine(hostile, p)
    start = np.median(hostile, axis=0)
    tau = np.median(np.linalg.norm(hostile - start, axis=1))
    assert np.linalg.norm(out - start) <= tau + 1e-9  # one step moves it by at most tau
    assert np.abs(out - 1.0).max() < 1.0 and np.abs(hostile.mean(axis=0) - 1.0).min() > 1e5
    same = np.ones((5, 3))
    np.testing.assert_array_equal(CenteredClip(1.0).combine(same, np.full(5, 0.2)), same[0])
    cfg = RobustConfig(rule="centered_clip", radius=0.7, iterations=2)
    np.testing.assert_allclose(RobustAggregation(cfg).combine(list(x), p), v, rtol=1e-12)


def test_a_robust_rule_aggregates_the_decoded_uploads(toy):
    """FedAvg with the median: the new weights are the coordinate-wise median of the uploads' decoded bytes."""
    _, _, server, _, state, ups = setup(toy, "fedavg", robust={"rule": "median"})
    new = server.aggregate(state, ups, 0, [0, 1, 2]).state
    thetas = [dict(decode_message(u)[1]) for u in ups]
    for info in server.layers:
        decoded = np.stack([decode_dense(t[f"{info.name}.theta"]).reshape(-1).astype(np.float64) for t in thetas])
        median = np.median(decoded, axis=0)
        np.testing.assert_array_equal(new[f"{info.name}.w"].reshape(-1), median[: -info.n_bias].astype(np.float32))
        np.testing.assert_array_equal(new[f"{info.name}.bias"], median[-info.n_bias:].astype(np.float32))


@pytest.mark.parametrize("algorithm", METHODS)
@pytest.mark.parametrize("rule", ["median", "krum", "centered_clip"])
def test_every_method_runs_with_a_robust_rule_against_a_sign_flip(tmp_path, toy, algorithm, rule):
    cfg = parse_config(config(toy, 2, experiment={"algorithm": algorithm}, robust={"rule": rule, "byzantine": 1},
                              faults={"attackers": 1, "attack": "sign_flip"}))
    rows = Simulator(cfg, tmp_path / "run").run()
    assert len(rows) == 2 and all(np.isfinite(float(r["accuracy"])) for r in rows)


# ------------------------------------------------------------------------------------------ attackers
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_run_with_attackers_finishes_and_counts_every_refusal(tmp_path, toy, attack):
    cfg = parse_config(config(toy, 3, experiment={"algorithm": "dturbo"},
                              faults={"attackers": 2, "attack": attack}))
    rows = Simulator(cfg, tmp_path / "run").run()
    assert len(rows) == 3
    hostile = hostile_clients(cfg)
    refused = [ln for ln in ((tmp_path / "run" / "events.log").read_text().splitlines()
                             if (tmp_path / "run" / "events.log").exists() else []) if "upload rejected" in ln]
    if attack in INSIDE:  # inside the bounds: accepted (the robust rules are for it)
        assert not refused
    else:
        assert sum(int(r["clients_rejected"]) for r in rows) == len(refused) == 2 * 3
        assert {int(ln.split("client ")[1].split(":")[0]) for ln in refused} == set(hostile)


def test_a_screened_upload_is_logged_with_its_reason_like_every_refusal(tmp_path, toy):
    """refuse_median's refusals are rejections: in events.log with the client and the reason, counted in the rows."""
    cfg = parse_config(config(toy, 3, experiment={"algorithm": "dturbo"},
                              faults={"attackers": 2, "attack": "scaled_sign_flip"},
                              robust={"rule": "trimmed_mean", "byzantine": 2, "refuse_median": 10.0}))
    rows = Simulator(cfg, tmp_path / "run").run()
    refused = [ln for ln in (tmp_path / "run" / "events.log").read_text().splitlines() if "upload rejected" in ln]
    assert sum(int(r["clients_rejected"]) for r in rows) == len(refused) == 2 * 3
    assert {int(ln.split("client ")[1].split(":")[0]) for ln in refused} == set(hostile_clients(cfg))
    assert all("robust.refuse_median = 10" in ln for ln in refused), refused


@pytest.mark.parametrize("attack", ["sign_flip", "scaled_sign_flip", "alie", "ipm"])
def test_attackers_are_reproducible_and_resume_identically(tmp_path, toy, attack):
    cfg = config(toy, 4, experiment={"algorithm": "fedavg"}, faults={"attackers": 2, "attack": attack},
                 robust={"rule": "trimmed_mean", "trim": 0.2, "clip_median": 1.0})
    cut_and_resume(cfg, tmp_path / "whole", tmp_path / "part", 2)
    assert rows_of(tmp_path / "whole") == rows_of(tmp_path / "part")
    assert hostile_clients(parse_config(cfg)) == hostile_clients(parse_config(cfg)) != []


def test_a_spoofed_id_with_positions_delta_never_crashes_the_run(tmp_path, toy):
    """Client 0's upload claims to be client 1 while client 1 drops: refused, and client 1 is sent its support whole
    next round (a client that cannot read its downlink would fail the round, never the run)."""
    cfg = parse_config(config(toy, 3, experiment={"algorithm": "dturbo"},
                              dturbo={"transmission": {"positions": "delta"}}))

    class Spoofing(InProcessClients):
        def __call__(self, downlinks, round_idx):
            replies = super().__call__(downlinks, round_idx)
            if round_idx == 0:
                replies[0], replies[1] = meta(replies[0], client=1), ClientLost("gone")
            return replies

    sim = Simulator(cfg, tmp_path / "run")
    sim.transport = Spoofing(sim.client, sim.fed.clients)
    rows = sim.run()
    assert len(rows) == 3 and int(rows[0]["clients_rejected"]) == 1
    assert int(rows[1]["clients_failed"]) == 0  # client 1 decoded round 2's downlink


def test_a_client_that_cannot_read_its_downlink_fails_the_round(toy):
    cfg = parse_config(config(toy, experiment={"algorithm": "fedavg"}))
    fed = build_federation(cfg)
    _, client = build_algorithm(cfg, fed)
    replies = InProcessClients(client, fed.clients)({0: b"DT\x01garbage"}, 0)
    assert "cannot read its downlink" in str(replies[0])


# -------------------------------------------------------------------------------------------- the ledger
def test_the_ledger_sizes_a_hostile_grid_in_bounded_memory():
    """A grid field whose rectangle records claim its whole payload (2 MB): sized reading its headers, in memory far
    below the 64x an unpacking of every record's bits would take."""
    head = bytes([1]) + bytes([0x80, 0x80, 0x40]) * 2 + bytes([0x80, 0xB5, 0x18]) + bytes([0])  # 2**20 x 2**20
    msg = encode_message("dturbo/down", [("conv1.mu", head + bytes(2 << 20))])
    traffic = Traffic({"dturbo/down": {"mu": "grid"}})
    tracemalloc.start()
    traffic.add([], [msg])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 24 << 20, peak
    assert traffic.up_bits == 8 * len(msg) == sum(traffic.parts[f"up_{p}_bits"] for p in ("headers", "positions",
                                                                                              "values"))


def test_an_upload_over_the_bound_is_booked_at_the_bound():
    grid = encode_grid(np.eye(4))
    honest = encode_message("k/up", [("a.mu", grid)])
    traffic = Traffic({"k/up": {"mu": "grid"}}, max_uplink_bytes=1000)
    traffic.add([], [honest, honest + bytes(10_000)])
    assert traffic.up_bits == 8 * len(honest) + 8 * 1000
    assert traffic.parts["up_headers_bits"] >= 8 * 1000


def test_the_faults_rewrite_with_the_payloads_own_encoders(toy):
    """The value attacks give uploads that frame and decode: the server refuses them on their values, not their
    bytes (which is what makes them well-formed attacks)."""
    for algorithm in ("fedpaq", "stc", "dturbo"):
        cfg, _, server, _, state, ups = setup(toy, algorithm)
        ctx = RoundView(server, cfg, 0, 1, server.downlinks(state, 0, [1])[1], {})
        for attack in ("values", "overflow", "sign_flip"):
            bad = ATTACKS[attack]().rewrite(ups[1], ctx)
            server.decode_uplink(state, bad, 0)  # decodes
    cfg, _, server, _, state, ups = setup(toy, "fedpm")
    ctx = RoundView(server, cfg, 0, 1, server.downlinks(state, 0, [1])[1], {})
    flipped = server.decode_uplink(state, ATTACKS["values"]().rewrite(ups[1], ctx), 0)
    honest = server.decode_uplink(state, ups[1], 0)
    for name, mask in honest.masks.items():
        assert np.array_equal(flipped.masks[name], 1 - mask)


def test_data_of_the_partition_sizes_the_server_knows(toy):
    cfg = parse_config(config(toy, experiment={"algorithm": "fedavg"}))
    fed = build_federation(cfg)
    server, client = build_algorithm(cfg, fed)
    assert server.partitions == [len(c) for c in fed.clients]
    state = server.init()
    small = ClientData(fed.clients[0].x[:10], fed.clients[0].y[:10])
    up = client.fit(server.downlink(state, 0), small, 0)
    result = server.aggregate(state, [up, client.fit(server.downlink(state, 0), fed.clients[1], 1)], 0, [0, 1])
    assert "n_t = 10, client 0 holds" in result.rejected[0].reason
    assert torch.equal(small.y, fed.clients[0].y[:10])


def test_a_robust_rule_refuses_a_flipped_fedpm_mask(toy):
    """No bound of one upload tells a flipped mask from an honest one; next to the round's others it costs far more
    bits under the global probabilities, and a robust rule refuses it (the plain mean keeps it, as before)."""
    for robust, refused in (({"rule": "mean"}, []), ({"rule": "trimmed_mean", "trim": 0.1}, [1])):
        cfg, _, server, _, state, _ = setup(toy, "fedpm", robust=robust)
        fed = build_federation(cfg)
        _, client = build_algorithm(cfg, fed)
        downs = server.downlinks(state, 0, list(range(6)))
        ups = [client.fit(downs[c], fed.clients[c], c) for c in range(6)]
        ctx = RoundView(server, cfg, 0, 1, downs[1], {})
        ups[1] = ATTACKS["values"]().rewrite(ups[1], ctx)
        result = server.aggregate(state, ups, 0, list(range(6)))
        assert [r.uplink for r in result.rejected] == refused, result.rejected
        if refused:
            assert "bits per parameter under the global probabilities" in result.rejected[0].reason


def test_krum_counts_the_uploads_already_refused_among_the_hostile():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(9, 5))
    p = np.full(9, 1 / 9)
    np.testing.assert_allclose(Krum(3).combine(x, p, refused=3), x.mean(axis=0))  # the 3 assumed are gone
    np.testing.assert_allclose(Krum(3).combine(x, p, refused=1), Krum(2).combine(x, p))


def test_krum_and_bulyan_with_too_few_uploads_still_drop_the_hostile_ones_they_assume():
    """Below K = 2f + 3 (Krum) or 4f + 3 (Bulyan) uploads, the rule drops f values at each end of every coordinate:
    one hostile upload among a round of 3 cannot pull the result (before, Krum took the plain mean there)."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(3, 6))
    x[1] = 1e4  # hostile
    p = np.full(3, 1 / 3)
    np.testing.assert_array_equal(Krum(1).combine(x, p), np.median(x, axis=0))
    np.testing.assert_array_equal(Bulyan(1).combine(x, p), np.median(x, axis=0))
    y = rng.normal(size=(6, 4))
    cut = np.sort(y, axis=0)[1:5].mean(axis=0)  # Bulyan f = 1 needs 7: 1 dropped at each end of 6
    np.testing.assert_allclose(Bulyan(1).combine(y, np.full(6, 1 / 6)), cut)
    np.testing.assert_allclose(Krum(2).combine(y, np.full(6, 1 / 6)), np.sort(y, axis=0)[2:4].mean(axis=0))


# ------------------------------------------------------------------------------------------ inside the bounds
@pytest.mark.parametrize("layout", ["values", "dense", "sparse", "quantized", "coded", "ternary"])
def test_a_value_payload_reads_and_writes_back_in_its_own_layout(layout):
    from dturbo.attacks import read_values, write_values
    from dturbo.codec import encode_dense, encode_sparse
    from dturbo.coding.values import encode_symbols

    rng = np.random.default_rng(0)
    v = rng.normal(size=40)
    v[::3] = 0.0
    payload = {"values": lambda: encode_values(v, "float32"), "dense": lambda: encode_dense(v.reshape(5, 8), "float32"),
               "sparse": lambda: encode_sparse(v, "float32"),
               "quantized": lambda: encode_quantized(rng.integers(0, 16, 40), 16, [2.0]),
               "coded": lambda: encode_symbols(rng.integers(0, 16, 40), 16, [2.0]),
               "ternary": lambda: encode_ternary(np.flatnonzero(v), v[v != 0] < 0, 0.5, 40, "float32")}[layout]()
    own = read_values(payload, layout)
    assert own.shape == (40,)
    if layout in ("quantized", "coded"):  # the levels of 16: +-2 at the ends, symmetric about 0
        assert np.abs(own).max() <= 2.0 and np.allclose(np.sort(np.unique(np.abs(own)))[:2], [2 / 15, 6 / 15])
    np.testing.assert_allclose(read_values(write_values(own, payload, layout), layout), own, rtol=1e-6, atol=1e-6)
    flipped = read_values(write_values(-3 * own, payload, layout), layout)
    np.testing.assert_allclose(flipped, -3 * own, rtol=1e-3, atol=1e-6)  # a ternary's mu is the kept mean


def test_alie_ipm_and_the_scaled_sign_flip_follow_their_formulas():
    from dturbo.attacks import ALIE, IPM, ScaledSignFlip

    rng = np.random.default_rng(1)
    honest, own, ref = rng.normal(size=(7, 30)), rng.normal(size=30), 0.1 * rng.normal(size=30)
    ctx = RoundView(None, None, 0, 0, b"", {}, attackers=3)
    # n = 10 uploads, f = 3: s = 3, z = Phi^-1(0.7) = 0.5244 (a normal table)
    np.testing.assert_allclose(ALIE().target(own, ref, lambda: honest, ctx), honest.mean(0) - 0.52440 * honest.std(0),
                               atol=1e-4)
    one = RoundView(None, None, 0, 0, b"", {}, attackers=1)  # f = 1 of 10: z = 0, the honest mean
    np.testing.assert_allclose(ALIE().target(own, ref, lambda: honest[:9], one), honest[:9].mean(0))
    np.testing.assert_allclose(IPM().target(own, ref, lambda: honest, ctx) - ref, -0.1 * (honest.mean(0) - ref))
    flip = ScaledSignFlip().target(own, ref, lambda: honest, ctx)
    assert np.abs(flip).max() <= 0.9 * GROWTH * 1.0 + 1e-9  # inside the bound of a layer of magnitude < 1
    assert np.abs(flip).max() > 0.8 * GROWTH
    step = flip - ref
    np.testing.assert_allclose(step / np.linalg.norm(step), -(own - ref) / np.linalg.norm(own - ref))


@pytest.mark.parametrize("algorithm", METHODS)
@pytest.mark.parametrize("attack", ["scaled_sign_flip", "alie", "ipm"])
def test_the_attacks_inside_the_bounds_pass_every_methods_gate(toy, algorithm, attack):
    """What they write decodes and is accepted by the round's bounds (the robust rule is what stops them), and it
    is not the honest upload."""
    cfg, _, server, _, state, ups = setup(toy, algorithm)
    downs = server.downlinks(state, 0, [0, 1, 2])
    ctx = RoundView(server, cfg, 0, 1, downs[1], {0: ups[0], 2: ups[2]}, attackers=1)
    bad = ATTACKS[attack]().rewrite(ups[1], ctx)
    got = server.receive(state, [ups[0], bad, ups[2]], 0, senders=[0, 1, 2])
    assert not got.rejected, got.rejected
    if not (attack == "alie" and algorithm != "fedpm"):  # ALIE with one attacker of three: the honest mean
        assert bad != ups[1]


def test_a_median_clip_bounds_every_update_by_the_rounds_median_norm():
    rows = [np.array([1.0, 0.0]), np.array([0.0, 2.0]), np.array([3.0, 0.0]), np.array([0.0, -400.0])]
    agg = RobustAggregation(RobustConfig(rule="mean", clip_median=1.0))
    assert not agg.plain
    got = agg.combine(rows, np.full(4, 0.25))
    # the median norm is 2.5: [1, 0], [0, 2] stay, [3, 0] -> [2.5, 0], [0, -400] -> [0, -2.5]
    np.testing.assert_allclose(got, [(1 + 2.5) / 4, (2 - 2.5) / 4])
    ref = np.array([10.0, 10.0])  # about the global values the rows move from
    np.testing.assert_allclose(agg.combine([r + ref for r in rows], np.full(4, 0.25), reference=ref), got + ref)


def test_uploads_that_point_away_from_the_rounds_median_update_are_left_out_before_the_rule():
    """7 honest updates around one direction, 3 reversed (a scaled sign flip, IPM): min_cosine = 0 leaves the 3 out
    and the trimmed mean then trims as many fewer; the result equals the rule on the honest rows alone, computed
    apart. A round with no direction (all updates zero) keeps every row."""
    rng = np.random.default_rng(3)
    ref = rng.normal(size=20)
    honest = [ref + np.ones(20) + rng.normal(0, 0.5, 20) for _ in range(7)]
    hostile = [ref - 5 * (h - ref) for h in honest[:3]]
    rule = {"rule": "trimmed_mean", "trim": 0.1, "byzantine": 3}
    agg = RobustAggregation(RobustConfig(**rule, min_cosine=0.0))
    screened = agg.screen(hostile + honest, ref)
    assert sorted(screened) == [0, 1, 2] and all("robust.min_cosine = 0" in why for why in screened.values())
    got = agg.combine(honest, np.full(7, 1 / 7), ref, refused=3)
    np.testing.assert_allclose(got, np.mean(honest, axis=0))  # 3 attackers gone: nothing left to trim
    without = RobustAggregation(RobustConfig(**rule)).combine(hostile + honest, np.full(10, 0.1), ref)
    assert np.linalg.norm(without - got) > 0.1
    steps = np.stack(hostile + honest) - ref
    cosine = steps @ np.median(steps, axis=0) / (np.linalg.norm(steps, axis=1) * np.linalg.norm(np.median(steps, 0)))
    np.testing.assert_array_equal(aligned(steps, 0.0), cosine >= 0)
    assert aligned(np.zeros((4, 3)), 0.0).all()


def test_sparse_updates_are_screened_against_the_mean_of_the_other_updates():
    """Ternary updates on a fifth of the coordinates each (STC's): their coordinate-wise median is 0 nearly
    everywhere, so the screen against it misses reversed ones, while against the mean of the others (cosine_to =
    "mean") the 3 reversed ones go and the 7 honest stay. Each row's own share is left out of its centre: with it, a
    reversed update 4 times as long (clipped to the median length) leans the mean its way far enough to pass. The
    cosines equal those computed apart."""
    rng = np.random.default_rng(5)
    n = 1000
    direction = np.sign(rng.normal(size=n))
    honest = []  # each client's own update; the last 3 clients reverse theirs
    for _ in range(10):
        keep = rng.choice(n, n // 5, replace=False)
        u = np.zeros(n)
        u[keep] = direction[keep]
        honest.append(u)
    by_median = RobustAggregation(RobustConfig(rule="centered_clip", min_cosine=0.0, clip_median=1.0))
    by_mean = RobustAggregation(RobustConfig(rule="centered_clip", min_cosine=0.0, clip_median=1.0,
                                             cosine_to="mean"))
    for scale in (1.0, 4.0):
        rows = [-scale * h for h in honest[7:]] + honest[:7]
        assert (np.median(np.stack(rows), axis=0) != 0).mean() < 0.01 and len(by_median.screen(rows)) < 3
        screened = by_mean.screen(rows)
        assert sorted(screened) == [0, 1, 2]
        assert all("the mean of the others' updates" in why for why in screened.values())
        steps = np.stack(rows)
        clipped = steps / np.maximum(np.linalg.norm(steps, axis=1) / np.median(np.linalg.norm(steps, axis=1)),
                                     1.0)[:, None]
        with_own = clipped @ clipped.mean(axis=0)
        if scale == 4.0:  # against the whole mean, the row's own share in it, a reversed update passes
            assert (with_own[:3] > 0).any()
    cosine = [steps[i] @ np.delete(steps, i, 0).mean(axis=0)
              / (np.linalg.norm(steps[i]) * np.linalg.norm(np.delete(steps, i, 0).mean(axis=0))) for i in range(10)]
    np.testing.assert_allclose(cosines(steps, "mean"), cosine)
    np.testing.assert_array_equal(aligned(steps, 0.0, "mean"), np.array(cosine) >= 0)
    assert cosines(steps[:1], "mean")[0] == 1.0  # a round of one upload: no others, no direction


def test_uploads_far_longer_than_the_rounds_median_update_are_left_out_before_clipping():
    """3 updates stretched a thousandfold (a sign flip scaled to the value bound) among 7 honest ones of similar
    lengths: refuse_median = 10 leaves the 3 out, so median clipping and the trimmed mean see the honest rows alone
    (the result equals that rule on them, computed apart); no honest row is as much as 10 times the median."""
    rng = np.random.default_rng(5)
    ref = rng.normal(size=20)
    honest = [ref + np.ones(20) + rng.normal(0, 0.5, 20) for _ in range(7)]
    hostile = [ref - 1000 * (h - ref) for h in honest[:3]]
    rule = {"rule": "trimmed_mean", "trim": 0.1, "byzantine": 3, "clip_median": 1.0}
    agg = RobustAggregation(RobustConfig(**rule, refuse_median=10.0))
    assert not agg.plain
    screened = agg.screen(hostile + honest, ref)
    assert sorted(screened) == [0, 1, 2] and all("robust.refuse_median = 10" in why for why in screened.values())
    got = agg.combine(honest, np.full(7, 1 / 7), ref, refused=3)
    alone = RobustAggregation(RobustConfig(rule="mean", clip_median=1.0)).combine(honest, np.full(7, 1 / 7), ref)
    np.testing.assert_allclose(got, alone)  # 3 refused count against byzantine: nothing left to trim
    without = RobustAggregation(RobustConfig(**rule)).combine(hostile + honest, np.full(10, 0.1), ref)
    assert np.linalg.norm(without - got) > 0.1
    steps = np.stack(hostile + honest) - ref
    lengths = np.linalg.norm(steps, axis=1)
    kept, relative = ordinary(steps, 10.0)
    np.testing.assert_array_equal(kept, lengths <= 10 * np.median(lengths))
    np.testing.assert_allclose(relative, lengths / np.median(lengths))
    assert ordinary(np.zeros((4, 3)), 10.0)[0].all()


def test_refuse_short_refuses_updates_built_from_the_honest_mean_with_the_reason():
    """refuse_short: ALIE's and IPM's uploads are built from the honest mean, shorter than most honest updates when
    those disagree; those below the floor are refused with the bound named, the band's rows equal a brute-force
    count, the median row passes any floor, and a round of zero updates keeps every row."""
    rng = np.random.default_rng(3)
    ref = rng.normal(size=40)
    honest = [ref + rng.normal(size=40) for _ in range(7)]
    mean = np.mean(honest, axis=0) - ref
    # ALIE at z = 0 (one attacker of ten) sends the honest mean; IPM -0.1 times it
    rows = [ref + mean, ref + mean, ref - 0.1 * mean] + honest
    agg = RobustAggregation(RobustConfig(rule="centered_clip", clip_median=1.0, refuse_median=10.0, refuse_short=0.6))
    screened = agg.screen(rows, ref)
    assert sorted(screened) == [0, 1, 2]
    assert all("robust.refuse_short = 0.6" in why for why in screened.values())
    steps = np.stack(rows) - ref
    norms = np.linalg.norm(steps, axis=1)
    median = np.median(norms)
    for short in (0.2, 0.6, 0.9):
        want = [k for k in range(len(rows)) if short * median <= norms[k] <= 10 * median]
        assert list(np.flatnonzero(ordinary(steps, 10.0, short)[0])) == want
    assert ordinary(steps, None, 0.999)[0][np.argsort(norms)[len(rows) // 2]]
    assert ordinary(np.zeros((4, 3)), None, 0.5)[0].all()
    assert RobustAggregation(RobustConfig(refuse_short=0.5)).screens


def test_refuse_close_refuses_colluding_copies_of_one_vector_with_the_reason():
    """refuse_close: colluding attackers (ALIE, IPM) send one vector, so their updates coincide while honest
    clients' differ; every row within the ratio times the median distance between rows of another is refused, both
    of a pair, with the bound named; the kept rows equal a brute-force check of every pair; a round of equal rows or
    of one row keeps them all."""
    rng = np.random.default_rng(4)
    ref = rng.normal(size=40)
    honest = [ref + rng.normal(size=40) for _ in range(7)]
    alie = np.mean(honest, axis=0) - 0.5 * np.std(honest, axis=0)
    rows = honest[:3] + [alie, alie.copy(), alie + 1e-9] + honest[3:]
    agg = RobustAggregation(RobustConfig(rule="krum", byzantine=3, refuse_median=10.0, refuse_close=0.1))
    screened = agg.screen(rows, ref)
    assert sorted(screened) == [3, 4, 5]
    assert all("robust.refuse_close = 0.1" in why for why in screened.values())
    steps = np.stack(rows) - ref
    for ratio in (0.1, 0.5, 0.9):
        pairs = [(i, j, np.linalg.norm(steps[i] - steps[j])) for i in range(len(rows)) for j in range(len(rows))
                 if i != j]
        median = np.median([d for _, _, d in pairs])
        want = [i for i in range(len(rows)) if all(d >= ratio * median for a, _, d in pairs if a == i)]
        kept, nearest = apart(steps, ratio)
        assert list(np.flatnonzero(kept)) == want
        np.testing.assert_allclose(nearest, [min(d for a, _, d in pairs if a == i) / median
                                             for i in range(len(rows))], rtol=1e-6, atol=1e-6)
    assert apart(np.ones((4, 3)), 0.5)[0].all() and apart(np.ones((1, 3)), 0.5)[0].all()
    assert RobustAggregation(RobustConfig(refuse_close=0.1)).screens
    assert RobustAggregation(RobustConfig(refuse_close=0.1)).screen(honest, ref) == {}


@pytest.mark.parametrize("algorithm", METHODS)
def test_screened_uploads_are_rejections_with_their_reason_and_leave_the_round_whole(toy, algorithm):
    """Two of six clients send the scaled sign flip (stretched to the value bound): refuse_median = 10 refuses both
    in :meth:`ServerBase.receive`, each with the reason and counted in clients_rejected, and the round's new state is
    the one the four honest uploads make alone (the plain state, the weights p_t and the rule's count included)."""
    robust = {"rule": "trimmed_mean", "trim": 0.1, "byzantine": 2, "refuse_median": 10.0}
    cfg, fed, server, client, state, _ = setup(toy, algorithm, robust=robust)
    downs = server.downlinks(state, 0, list(range(6)))
    ups = [client.fit(downs[c], fed.clients[c], c) for c in range(6)]
    honest_ups = dict(enumerate(ups))
    bad = [ATTACKS["scaled_sign_flip"]().rewrite(ups[c], RoundView(server, cfg, 0, c, downs[c], honest_ups,
                                                                     attackers=2)) for c in (0, 1)]
    result = server.aggregate(state, bad + ups[2:], 0, list(range(6)))
    assert [r.uplink for r in result.rejected] == [0, 1], result.rejected
    if algorithm != "fedpm":  # FedPM's mask screen may name the flipped mask first
        assert all("robust.refuse_median = 10" in r.reason for r in result.rejected), result.rejected
    assert result.metrics["clients_rejected"] == 2 and result.metrics["clients_ok"] == 4
    honest = parse_config(config(toy, experiment={"algorithm": algorithm},
                                 robust={"rule": "trimmed_mean", "trim": 0.1, "byzantine": 0}))
    alone, _ = build_algorithm(honest, build_federation(honest))
    expected = alone.aggregate(state, ups[2:], 0, list(range(2, 6))).state
    assert set(expected) == set(result.state)
    for key, value in expected.items():
        np.testing.assert_allclose(np.asarray(result.state[key], dtype=np.float64),
                                   np.asarray(value, dtype=np.float64), rtol=1e-6, atol=1e-9, err_msg=key)


def test_a_hostile_calibration_reply_reaches_the_server_at_the_bound_and_the_rule_holds(tmp_path, toy):
    """BatchNorm calibration goes through the faults: a hostile client answers with statistics at 0.9 of the
    bound, which pass the gate, and a trimmed mean that trims the attackers keeps the global statistics those of
    the honest clients."""
    import dturbo

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.bn, self.fc2 = torch.nn.Linear(12, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.fc2(torch.relu(self.bn(self.fc1(x.flatten(1)))))

    runs = {}
    hostile = {"faults": {"attackers": 2, "attack": "calibration"}}
    for name, extra in {"clean": {}, "hostile": hostile, "mean": hostile | {"robust": {"rule": "mean"}}}.items():
        cfg = config(toy, 2, experiment={"algorithm": "fedavg"},
                     **({"robust": {"rule": "trimmed_mean", "byzantine": 2}} | extra))
        res = dturbo.Experiment(cfg, model=Net, out=tmp_path / name, progress=False, figures=False).run()
        runs[name] = res
    events = (tmp_path / "hostile" / "events.log")
    assert not events.exists() or "BatchNorm statistics rejected" not in events.read_text()
    var = {k: dict(r.model.named_buffers())["bn.running_var"] for k, r in runs.items()}
    # they reach the pool: under the plain mean its variance would leave the bound, so the averaged statistics stay
    assert "beyond the bound" in (tmp_path / "mean" / "events.log").read_text()
    assert float(var["hostile"].max()) < 100, var  # the trimmed mean leaves the attackers' 9000 out


def test_the_attacks_results_file_keeps_its_schema():
    """benchmarks/results/attacks.json: ``runs`` is a list of rows with exactly these keys, every runner, model and
    attacker count of the benchmark in it, every row at least 12 rounds."""
    import json

    res = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/attacks.json").read_text())
    keys = {"runner", "model", "method", "attack", "attackers", "robust", "rule", "stopped", "resume_ok", "accuracy",
            "clean_accuracy", "peak_rss_mb", "clean_peak_rss_mb"}
    assert isinstance(res["runs"], list) and res["runs"]
    assert all(set(row) == keys for row in res["runs"])
    assert {r["runner"] for r in res["runs"]} == {"sim", "strategy"}
    assert {r["model"] for r in res["runs"]} == {"mlp", "bn"}
    assert {r["attackers"] for r in res["runs"]} == {1, 3}
    assert res["rounds"] >= 12


def test_dssm_warns_when_its_smallest_rounds_may_hold_a_hostile_majority():
    from dturbo.algorithms.dssm import HostileMajorityWarning, run_warnings

    def warnings_for(**over: object) -> list[Warning]:
        return run_warnings(parse_config({"experiment": {"algorithm": "dssm"}, **over}), None)

    robust = {"rule": "krum", "byzantine": 3}
    got = warnings_for(robust=robust, dssm={"min_clients": 3})
    assert len(got) == 1 and isinstance(got[0], HostileMajorityWarning) and "dssm.min_clients = 7" in str(got[0])
    assert warnings_for(robust=robust, dssm={"min_clients": 7}) == []
    assert warnings_for(dssm={"min_clients": 3}) == []  # the plain mean assumes no attacker
