"""FedDST (federated dynamic sparse training): the layer budgets, the readjustment (count kept, smallest out,
largest gradients in), the schedule, the global mask's density and its changes over a run, the supports each client
holds (partial participation, a client that lost them), upload validation, the ledger, and resume."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest

from dturbo.algorithms.base import ClientError, fields_dict, frame, message_bits
from dturbo.algorithms.feddst import (
    FedDstClient,
    FedDstServer,
    layer_counts,
    readjust_ratio,
    readjusted,
    top_k,
)
from dturbo.algorithms.registry import build_algorithm
from dturbo.codec import encode_support_delta, encode_values
from dturbo.federation import build_federation
from dturbo.settings import parse_config
from dturbo.sim import Simulator

TIMING = {"seconds", "server_seconds"}


@pytest.fixture(scope="module")
def toy(make_toy) -> Path:
    return make_toy(800)


def config(toy: Path, **sections: dict) -> dict:
    cfg: dict = {
        "experiment": {"name": "feddst", "seed": 1, "rounds": 6, "threads": 1, "algorithm": "feddst"},
        "data": {"name": "npz", "path": str(toy)},
        "federation": {"clients": 4, "alpha": 1.0},
        "model": {"name": "mlp", "hidden": [16]},
        "train": {"local_steps": 20, "lr": 0.01, "batch_size": 32},
        "feddst": {"density": 0.3, "readjust_ratio": 0.3, "readjust_every": 2, "readjust_until": 6,
                   "readjust_at": 0.5},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


def rows_of(out: Path) -> list[dict[str, str]]:
    with open(out / "metrics.csv", newline="") as f:
        return [{k: v for k, v in r.items() if k not in TIMING} for r in csv.DictReader(f)]


# -------------------------------------------------------------------------------------------- budgets
def test_erk_budget_sums_to_the_density_and_caps_small_layers():
    shapes = [(6, 1, 7, 7), (16, 6, 5, 5), (120, 256), (10, 84)]
    sizes = [math.prod(s) for s in shapes]
    for density in (0.05, 0.2, 0.5):
        counts = layer_counts(shapes, density, "erk")
        assert abs(sum(counts) - density * sum(sizes)) <= len(shapes)  # rounding, one weight a layer at most
        assert all(1 <= k <= n for k, n in zip(counts, sizes, strict=True))
        # ERK: a layer's density is proportional to sum(shape) / prod(shape) below the cap
        d = [k / n for k, n in zip(counts, sizes, strict=True)]
        raw = [sum(s) / math.prod(s) for s in shapes]
        free = [i for i in range(len(shapes)) if d[i] < 1.0]
        ratios = [d[i] / raw[i] for i in free]
        assert max(ratios) / min(ratios) == pytest.approx(1.0, rel=0.05)
    # at 0.5 the small conv layer reaches the cap and is dense; the rest share what is left
    assert layer_counts(shapes, 0.5, "erk")[0] == sizes[0]
    assert layer_counts(shapes, 0.2, "uniform") == [round(0.2 * n) for n in sizes]


def test_top_k_takes_the_largest_with_ties_to_the_lower_index():
    score = np.array([3.0, 1.0, 3.0, 2.0, 3.0])
    assert top_k(score, 2).tolist() == [True, False, True, False, False]
    among = np.array([False, True, True, True, False])
    assert top_k(score, 2, among=among).tolist() == [False, False, True, True, False]
    assert top_k(score, 9, among=among).sum() == 3


def test_readjustment_keeps_the_count_drops_the_smallest_and_grows_the_largest_gradients():
    rng = np.random.default_rng(0)
    mask = rng.random((20, 30)) < 0.3
    w = np.where(mask, rng.normal(size=mask.shape), 0.0)
    g = rng.normal(size=mask.shape)
    alpha = 0.2
    k = int(mask.sum())
    n = math.floor(alpha * k)
    new = readjusted(mask, w, g, alpha)
    assert new.sum() == k  # readjustment keeps the count
    dropped = mask & ~new
    grown = new & ~mask
    assert dropped.sum() <= n and grown.sum() == dropped.sum()
    # the k - n largest of the old mask all stay (independently: the sorted magnitudes)
    threshold = np.sort(np.abs(w[mask]))[::-1][k - n - 1]
    assert np.all(new[mask & (np.abs(w) > threshold)])
    # every grown position has a gradient at least as large as every inactive one left out
    out = ~new & ~mask
    assert np.abs(g[grown]).min() >= np.abs(g[out]).max()
    assert np.array_equal(readjusted(mask, w, g, 0.0), mask)


def test_schedule_readjusts_every_r_rounds_with_a_cosine_ratio(toy):
    cfg = parse_config(config(toy, experiment={"rounds": 20},
                              feddst={"readjust_ratio": 0.4, "readjust_every": 3, "readjust_until": 10}))
    alphas = [readjust_ratio(cfg, r) for r in range(20)]
    assert [r for r, a in enumerate(alphas) if a > 0] == [1, 4, 7]  # rounds 1 + 3j below 10
    assert alphas[4] == pytest.approx(0.2 * (1 + math.cos(math.pi * 4 / 10)))


# ------------------------------------------------------------------------------------------------ a run
def test_run_keeps_the_density_and_changes_the_mask_only_when_readjusting(tmp_path, toy):
    cfg = parse_config(config(toy))
    rows = Simulator(cfg, tmp_path / "run").run()
    server, _ = build_algorithm(cfg, build_federation(cfg))
    expected = sum(server.counts) / sum(int(np.prod(i.grid)) for i in server.layers)
    assert abs(expected - 0.3) < 0.01
    for r in rows:
        assert float(r["density"]) == pytest.approx(expected)  # the global mask keeps the set density
        if float(r["readjust_ratio"]) == 0.0:
            assert float(r["mask_flips"]) == 0.0  # a round without readjustment changes no mask
    assert max(float(r["mask_flips"]) for r in rows) > 0  # and readjustments do change it
    assert float(rows[-1]["accuracy"]) > 0.5  # learns (4 classes)


def test_a_convolutional_model_readjusts_on_its_grids(tmp_path):
    """LeNet-5 (4-D conv weights): masks and weights travel on each layer's grid, readjustments keep the density."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 1, 28, 28)).astype(np.float32)
    y = np.arange(120) % 4
    np.savez(tmp_path / "img.npz", x_train=x, y_train=y, x_test=x[:20], y_test=y[:20])
    cfg = parse_config(config(tmp_path / "img.npz", experiment={"rounds": 3}, model={"name": "lenet5"},
                              train={"local_steps": 2, "lr": 0.01, "batch_size": 16},
                              feddst={"density": 0.3, "readjust_ratio": 0.3, "readjust_every": 1, "readjust_until": 3,
                                      "readjust_at": 0.5}))
    rows = Simulator(cfg, tmp_path / "run").run()
    assert len(rows) == 3 and max(float(r["mask_flips"]) for r in rows) > 0
    assert all(int(float(r["clients_ok"])) == 4 for r in rows)


def test_resume_is_identical(tmp_path, toy):
    cfg = parse_config(config(toy, federation={"clients": 4, "alpha": 1.0, "clients_per_round": 3}))
    full = tmp_path / "full"
    Simulator(cfg, full).run()
    cut = tmp_path / "cut"
    stop = parse_config(config(toy, federation={"clients": 4, "alpha": 1.0, "clients_per_round": 3}))

    class Stop(Exception):
        pass

    def on_round(row):
        if int(row["round"]) == 3:
            raise Stop

    with pytest.raises(Stop):
        Simulator(stop, cut, on_round=on_round).run()
    Simulator(cfg, cut, resume=True).run()
    assert rows_of(cut) == rows_of(full)


def test_positions_travel_only_to_clients_that_do_not_hold_the_mask(toy):
    cfg = parse_config(config(toy))
    fed = build_federation(cfg)
    server, client = build_algorithm(cfg, fed)
    state = server.init()
    data = fed.clients
    for rnd in range(3):
        downs = server.downlinks(state, rnd, list(range(4)))
        with_positions = [any(k.endswith(".support") for k in fields_dict(d, "feddst/down")) for d in downs.values()]
        # round 0: nobody holds a mask; round 1: everyone holds round 0's (unchanged); round 2 follows the
        # readjustment of round 1 (the mask changed): everyone gets the flips
        assert all(with_positions) == (rnd in (0, 2)) and (any(with_positions) == (rnd in (0, 2)))
        ups = [client.fit(downs[c], data[c], c) for c in range(4)]
        state = server.aggregate(state, ups, rnd).state
        for d in downs.values():
            bits = message_bits(d, server.layouts)
            assert sum(bits.values()) == 8 * len(d)


def test_a_client_that_lost_its_mask_refuses_to_train(toy):
    cfg = parse_config(config(toy))
    fed = build_federation(cfg)
    server, client = build_algorithm(cfg, fed)
    state = server.init()
    data = fed.clients[0]
    down = server.downlinks(state, 0, [0])[0]
    state = server.aggregate(state, [client.fit(down, data, 0)], 0).state
    fresh = FedDstClient(cfg, server.model_factory)
    with pytest.raises(ClientError, match="does not hold"):
        fresh.fit(server.downlinks(state, 1, [0])[0], data, 0)


def test_bad_uploads_are_refused_with_a_reason(toy):
    cfg = parse_config(config(toy))
    fed = build_federation(cfg)
    server, client = build_algorithm(cfg, fed)
    assert isinstance(server, FedDstServer)
    state = server.init()
    data = fed.clients[0]
    good = client.fit(server.downlinks(state, 0, [0])[0], data, 0)
    fields = fields_dict(good, "feddst/up")
    name = server.layers[0].name
    g = state[f"{name}.mask"].astype(bool)
    moved = g.copy()
    on, off = np.flatnonzero(g.reshape(-1))[0], np.flatnonzero(~g.reshape(-1))[0]
    moved.reshape(-1)[[on, off]] = [False, True]
    cases = {
        "round without readjustment": {f"{name}.support": encode_support_delta(moved, g)},
        "its mask holds": {f"{name}.w": encode_values(np.ones(3))},
    }
    for reason, change in cases.items():
        bad = frame("feddst/up", {**fields, **change})
        got = server.aggregate(state, [good, bad], 0)
        assert len(got.rejected) == 1 and reason in got.rejected[0].reason
    # in a readjustment round: a mask of another count, and more weights moved than alpha allows
    alpha = readjust_ratio(cfg, 1)
    k = int(g.sum())
    fewer = g.copy()
    fewer.reshape(-1)[on] = False
    too_many = g.copy()
    ons, offs = np.flatnonzero(g.reshape(-1)), np.flatnonzero(~g.reshape(-1))
    n = math.floor(alpha * k) + 1
    too_many.reshape(-1)[ons[:n]] = False
    too_many.reshape(-1)[offs[:n]] = True
    down1 = server.downlinks(state, 1, [0])[0]
    good1 = client.fit(down1, data, 0)
    f1 = fields_dict(good1, "feddst/up")
    for mask, reason in ((fewer, "holds"), (too_many, "regrown")):
        bad = frame("feddst/up", {**f1, f"{name}.support": encode_support_delta(mask, g)})
        got = server.aggregate(state, [good1, bad], 1)
        assert len(got.rejected) == 1 and reason in got.rejected[0].reason
