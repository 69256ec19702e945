"""End to end: a short real federated run trains, sparsifies, counts real bytes, and resumes exactly."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch
from run_helpers import PAPER_TRANSMISSION
from safetensors.numpy import load_file

from dturbo.algorithms.dturbo.sparsity import density_schedule
from dturbo.algorithms.dturbo.turbo import support
from dturbo.checkpoint import CheckpointError, load_checkpoint
from dturbo.data import load_dataset
from dturbo.federation import build_federation
from dturbo.settings import parse_config
from dturbo.sim import BASE_COLUMNS, Simulator

FMNIST = Path("/usr/share/datasets/fashion-mnist")
needs_fmnist = pytest.mark.skipif(
    not (FMNIST / "train-images-idx3-ubyte.gz").exists(),
    reason="real Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)",
)

# Deterministic per-round metrics (everything but wall-clock time).
TIMING = {"seconds", "server_seconds"}


def small_config(**sparsity) -> dict:
    return {
        "experiment": {"name": "test", "seed": 1, "rounds": 5, "threads": 1},
        "data": {"name": "fashion-mnist", "limit_train": 3000, "limit_test": 1000},
        "federation": {"clients": 4, "partition": "dirichlet", "alpha": 0.5},
        "model": {"name": "lenet5"},
        "train": {"local_steps": 12, "batch_size": 64, "lr": 0.003},
        # KL / n is 20x stronger on 3000 samples than on 60000: temper it alike (beta 0.3 * 3000 / 60000)
        "dturbo": {"beta": 0.015, "sparsity": {"mode": "target", "target_density": 0.3, "warmup_rounds": 1,
                                               "ramp_rounds": 3, **sparsity}},
    }


@pytest.fixture(scope="module")
def fed():
    if not (FMNIST / "train-images-idx3-ubyte.gz").exists():
        pytest.skip("real Fashion-MNIST not installed")
    cfg = parse_config(small_config())
    ds = load_dataset("fashion-mnist", limit_train=3000, limit_test=1000, seed=1)
    return build_federation(cfg, ds)


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def strip_timing(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


@pytest.mark.slow
@needs_fmnist
def test_short_real_run_trains_sparsifies_and_writes_run_dir(tmp_path, fed):
    cfg = parse_config(small_config())
    rows = Simulator(cfg, tmp_path / "run", federation=fed).run()
    run = tmp_path / "run"
    assert [int(r["round"]) for r in rows] == [1, 2, 3, 4, 5]
    for col in BASE_COLUMNS + ["train_nll", "kl_w", "neg_elbo"]:
        assert col in rows[0]
    assert float(rows[-1]["accuracy"]) > 0.6  # 5 short rounds of LeNet-5 on 3000 real images
    densities = [float(r["density"]) for r in rows]
    assert densities[0] == 1.0 and densities[-1] < 0.45  # warm-up dense, then the ramp sparsifies
    # bits are bytes really exchanged: cum_bits is the running sum of up + down
    cum = np.cumsum([int(r["up_bits"]) + int(r["down_bits"]) for r in rows])
    assert np.allclose(cum, [float(r["cum_bits"]) for r in rows])
    # sparse uploads are smaller than dense ones
    assert int(rows[-1]["up_bits"]) < 0.6 * int(rows[0]["up_bits"])
    for name in ("config.toml", "metrics.csv", "model.safetensors", "checkpoint/state.safetensors"):
        assert (run / name).exists(), name
    msg = load_file(str(run / "messages" / "round_0005.safetensors"))
    assert msg["dense2.pi"].shape == (84, 120) and msg["dense2.mask"].shape == (84, 120)


# "channel" with whole conv channels: a round computes only the channels on the support (nn.bayes.ChannelSampling)
SAMPLINGS = {"local": ({}, {}),
             "channel": ({"sampling": "channel", "prior": {"conv": {"tie_rows": True}}},
                         {"layer_targets": {"conv": 0.5}})}


@pytest.mark.slow
@needs_fmnist
@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_resume_gives_identical_metrics(tmp_path, fed, sampling):
    extra, sparsity = SAMPLINGS[sampling]
    tree = small_config(**sparsity)
    tree["dturbo"] |= extra
    cfg = parse_config(tree)
    full = Simulator(cfg, tmp_path / "full", federation=fed).run()
    if sampling == "channel":  # half the conv channels left the support, and the model still learns (local: 58.8%)
        assert 0 < float(full[-1]["density_conv2"]) < 1 and float(full[-1]["accuracy"]) > 0.5
    # An interrupted run: stop after 2 rounds, then resume to 5.
    short = parse_config({**tree, "experiment": {"name": "test", "seed": 1, "rounds": 2, "threads": 1}})
    Simulator(short, tmp_path / "cut", federation=fed).run()
    resumed = Simulator(cfg, tmp_path / "cut", federation=fed, resume=True).run()
    assert strip_timing(read_rows(tmp_path / "cut")) == strip_timing(read_rows(tmp_path / "full"))
    assert len(resumed) == len(full) == 5
    a = load_file(str(tmp_path / "full" / "checkpoint" / "state.safetensors"))
    b = load_file(str(tmp_path / "cut" / "checkpoint" / "state.safetensors"))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@needs_fmnist
def test_resume_refuses_other_config_and_keeps_checkpoint(tmp_path, fed):
    cfg = parse_config(small_config())
    short = parse_config({**small_config(), "experiment": {"name": "test", "seed": 1, "rounds": 1, "threads": 1}})
    Simulator(short, tmp_path / "run", federation=fed).run()
    before = (tmp_path / "run" / "checkpoint" / "state.safetensors").read_bytes()
    other = parse_config({**small_config(), "train": {"local_steps": 5, "batch_size": 64, "lr": 0.003}})
    with pytest.raises(CheckpointError, match=r"another configuration.*differs in train\.local_steps \(\d+ -> 5\)"):
        Simulator(other, tmp_path / "run", federation=fed, resume=True).run()
    (tmp_path / "run" / "checkpoint" / "state.safetensors").write_bytes(before[: len(before) // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        Simulator(cfg, tmp_path / "run", federation=fed, resume=True).run()
    with pytest.raises(FileExistsError):
        Simulator(cfg, tmp_path / "run", federation=fed).run()


def test_density_schedule_is_gradual_and_reaches_target():
    d = [density_schedule(t, target=0.2, warmup=2, ramp=5) for t in range(10)]
    assert d[:2] == [1.0, 1.0]
    assert all(a > b for a, b in zip(d[1:7], d[2:7], strict=False))
    assert d[6:] == pytest.approx([0.2] * 4)


def _toy_npz(tmp_path: Path) -> Path:
    """400 samples of 20 features, 2 classes (the sign of the first feature); the first 100 are the test set."""
    x = np.random.default_rng(0).normal(size=(400, 20)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    np.savez(tmp_path / "toy.npz", x_train=x, y_train=y, x_test=x[:100], y_test=y[:100])
    return tmp_path / "toy.npz"


def test_global_model_is_masked_mean(tmp_path):
    torch.manual_seed(0)
    cfg = parse_config({
        "experiment": {"rounds": 3, "seed": 0, "threads": 1},
        "data": {"name": "npz", "path": str(_toy_npz(tmp_path))},
        "federation": {"clients": 2, "partition": "iid"},
        "model": {"name": "mlp", "hidden": [16]},
        "train": {"local_steps": 20, "batch_size": 32, "lr": 0.01},
        "dturbo": {"global_model": "cut",
                   "sparsity": {"target_density": 0.5, "warmup_rounds": 0, "ramp_rounds": 2, "scope": "layer"}},
    })
    sim = Simulator(cfg, tmp_path / "run")
    rows = sim.run()
    assert float(rows[-1]["accuracy"]) > 0.8
    state, _ = load_checkpoint(tmp_path / "run" / "checkpoint")
    model = sim.server.global_model(state)
    for name in ("dense1", "dense2"):
        layer = getattr(model, name)
        w = layer.weight_mu.detach().numpy()
        mask = support(state[f"{name}.mu"])
        assert np.all(w[~mask] == 0)
        assert mask.mean() == float(rows[-1][f"density_{name}"])
        # scope 'layer': each layer's support follows the schedule (CSV row r is 0-based round r - 1, whose
        # support the previous round's Module B -- or init, with no warm-up -- calibrated). calibrate_field never
        # exceeds the scheduled density and stops within 5e-4 below it, or at an interval of h of width 1e-3 whose
        # upper end overshoots: the gap is then the discrete jump of the weights whose threshold lies in it, one
        # weight of the layer in this run (1/320 for dense1, 1/32 for dense2, at row 2).
        size = mask.size
        for row in rows:
            sched = density_schedule(int(row["round"]) - 1, target=0.5, warmup=0, ramp=2)
            dens = float(row[f"density_{name}"])
            assert sched - 1.0 / size - 5e-4 <= dens <= sched, (name, row["round"], dens, sched)


@pytest.mark.slow
@needs_fmnist
def test_tied_rows_prune_whole_conv_channels_and_export_removes_them(tmp_path, fed):
    """prior.conv.tie_rows: every conv row (output channel) is one support variable, kept or pruned whole, at
    every round; the export then removes those channels (their constant outputs folded exactly)."""
    from dturbo.export import export_run, load
    from dturbo.nn.models import build_model

    base = small_config(layer_targets={"conv1": 0.5, "conv2": 0.25})
    cfg = parse_config({**base, "dturbo": {**base["dturbo"], "prior": {"conv": {"tie_rows": True}}}})
    rows = Simulator(cfg, tmp_path / "run", federation=fed).run()
    for r in range(1, 6):
        msg = load_file(str(tmp_path / "run" / "messages" / f"round_{r:04d}.safetensors"))
        for name in ("conv1", "conv2"):
            mask = msg[f"{name}.mask"].astype(bool)
            assert np.all(mask.all(1) | ~mask.any(1)), (r, name)  # whole rows only
    assert float(rows[-1]["density_conv1"]) == 0.5 and float(rows[-1]["density_conv2"]) == 0.25
    assert not np.all(msg["dense1.mask"].astype(bool).all(1) | ~msg["dense1.mask"].astype(bool).any(1))
    exported = export_run(tmp_path / "run", tmp_path / "model")
    after = {r["name"]: r["shape_after"] for r in exported.layers}
    assert after["conv1"][0] == 3 and after["conv2"][:2] == [4, 3]  # 6 -> 3 and 16 -> 4 channels
    model = build_model("lenet5", (1, 28, 28), 10)
    state = load_file(str(tmp_path / "run" / "model.safetensors"))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    x = fed.x_test[:200]  # real test images
    with torch.no_grad():
        err = float((load(tmp_path / "model", compile=False)(x) - model.eval()(x)).abs().max())
    assert err <= 1e-4


def _toy_config(tmp_path: Path, **sparsity) -> dict:
    return {
        "experiment": {"rounds": 4, "seed": 0},
        "data": {"name": "npz", "path": str(_toy_npz(tmp_path))},
        "federation": {"clients": 2, "partition": "iid"},
        "model": {"name": "mlp", "hidden": [16, 8]},
        "train": {"local_steps": 10, "batch_size": 32, "lr": 0.01},
        "dturbo": {"sparsity": {"target_density": 0.5, "warmup_rounds": 0, "ramp_rounds": 2, **sparsity}},
    }


def test_layer_targets_fix_named_layers_and_the_rest_keeps_the_global_budget(tmp_path):
    cfg = parse_config(_toy_config(tmp_path, layer_targets={"dense2": 0.1}))
    sim = Simulator(cfg, tmp_path / "run")
    rows = sim.run()
    state, _ = load_checkpoint(tmp_path / "run" / "checkpoint")
    sizes = {n: state[f"{n}.mu"].size for n in ("dense1", "dense2", "dense3")}
    assert sizes == {"dense1": 320, "dense2": 128, "dense3": 16}
    dens = {n: float(support(state[f"{n}.mu"]).mean()) for n in sizes}
    assert 0.08 <= dens["dense2"] <= 0.1  # calibrated alone, from below
    total = sum(dens[n] * sizes[n] for n in sizes) / sum(sizes.values())
    assert 0.48 <= total <= 0.5 and float(rows[-1]["support_density"]) == pytest.approx(total)
    # the other layers shared one field and took the rest of the budget: denser than the global target
    assert (dens["dense1"] * 320 + dens["dense3"] * 16) / 336 > 0.6


def test_layer_targets_errors_name_the_problem(tmp_path):
    from dturbo.config import ConfigError

    with pytest.raises(ConfigError, match="names 'conv9', which the model does not have; its layers: dense1, dense2"):
        Simulator(parse_config(_toy_config(tmp_path, layer_targets={"conv9": 0.1})), tmp_path / "a")
    with pytest.raises(ConfigError, match=r"\(1 of 3\) hold .* leaves the other layers a density of 2.6778, outside"):
        Simulator(parse_config(_toy_config(tmp_path, target_density=0.9, layer_targets={"dense1": 0.1})),
                  tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_bad_uplinks_are_rejected_and_the_round_uses_the_rest(tmp_path):
    """A truncated, a NaN-carrying and a wrong-length upload are rejected with reasons; the aggregate is
    sum_t p_t x_t over the two valid uploads with p_t = n_t / (sum of their n_t), renormalised among them."""
    from dturbo.algorithms.base import ClientData, MessageError
    from dturbo.codec import decode_dense, decode_message, decode_values, encode_message, encode_values

    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    np.savez(tmp_path / "toy.npz", x_train=x, y_train=y, x_test=x[:40], y_test=y[:40])
    cfg = parse_config({
        "data": {"name": "npz", "path": str(tmp_path / "toy.npz")},
        "federation": {"clients": 2, "partition": "iid"},
        "model": {"name": "mlp", "hidden": [4]},
        "train": {"local_steps": 3},
        "dturbo": {"transmission": PAPER_TRANSMISSION},
    })
    sim = Simulator(cfg, tmp_path / "run")
    state = sim.server.init()
    down = sim.server.downlink(state, 0)
    good = sim.client.fit(down, sim.fed.clients[0], 0)
    kind, fields = decode_message(good)

    def replaced(name, payload):
        return encode_message(kind, [(n, payload if n == name else p) for n, p in fields])

    # the encoder refuses NaN, so a hostile client writes the bytes itself: float32 code, count 24, values
    nan = replaced("dense1.mu", bytes([2, 24]) + np.full(24, np.nan, "<f4").tobytes())
    short = replaced("dense1.mu", encode_values(np.ones(5)))
    other = sim.client.fit(down, ClientData(torch.from_numpy(x[:30]), torch.from_numpy(y[:30])), 1)  # n_t = 30
    result = sim.server.aggregate(state, [good, good[:-7], nan, short, other], 0)
    assert result.metrics["clients_ok"] == 2 and result.metrics["clients_rejected"] == 3
    # the aggregate, from the two valid uploads' bytes: p = (100, 30) / 130 (the rejected ones count nowhere)
    ups = [dict(decode_message(u)[1]) for u in (good, other)]
    n_t = np.array([decode_values(u["meta"])[2] for u in ups])
    assert n_t.tolist() == [100.0, 30.0]
    p = n_t / n_t.sum()
    new = result.state
    for name in ("dense1", "dense2"):
        for key in ("bias", "sigma"):
            parts = [decode_values(u[f"{name}.{key}"]) if key == "sigma" else decode_dense(u[f"{name}.{key}"])
                     for u in ups]
            expected = p[0] * parts[0].astype(np.float64) + p[1] * parts[1].astype(np.float64)
            np.testing.assert_allclose(new[f"{name}.{key}"].reshape(-1), expected.reshape(-1), rtol=1e-6, atol=1e-9)
        trained = support(state[f"{name}.mu"])
        mu = np.zeros(trained.shape)
        mu[trained] = sum(pt * decode_values(u[f"{name}.mu"]).astype(np.float64)
                                        for pt, u in zip(p, ups, strict=True))
        kept = support(new[f"{name}.mu"])
        assert kept.sum() > 0.9 * kept.size  # round 0: the support is (almost) all kept
        np.testing.assert_allclose(new[f"{name}.mu"][kept], mu[kept], rtol=1e-6, atol=0)
        assert not np.allclose(mu[kept], decode_values(ups[0][f"{name}.mu"])[kept[trained]])
    reasons = " | ".join(result.rejected)
    assert "truncated" in reasons and "NaN" in reasons and "support has 24" in reasons
    with pytest.raises(MessageError, match="no valid client update"):
        sim.server.aggregate(state, [good[:10]], 0)


@pytest.mark.parametrize("sigma_mode", ["layer", "weight", "client"])
def test_sigma_modes_run_and_keep_their_shape(tmp_path, sigma_mode):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 10)).astype(np.float32)
    y = (x[:, 0] - x[:, 1] > 0).astype(np.int64)
    np.savez(tmp_path / "toy.npz", x_train=x, y_train=y, x_test=x[:60], y_test=y[:60])
    cfg = parse_config({
        "experiment": {"rounds": 3},
        "data": {"name": "npz", "path": str(tmp_path / "toy.npz")},
        "federation": {"clients": 3, "partition": "iid"},
        "model": {"name": "mlp", "hidden": [12, 6]},
        "train": {"local_steps": 30, "lr": 0.01},
        "dturbo": {"sigma_mode": sigma_mode, "beta": 0.01,
                   "sparsity": {"target_density": 0.6, "warmup_rounds": 0, "ramp_rounds": 2}},
    })
    rows = Simulator(cfg, tmp_path / "run").run()
    assert float(rows[-1]["accuracy"]) > 0.7
    state, _ = load_checkpoint(tmp_path / "run" / "checkpoint")
    sigmas = [state[f"dense{i}.sigma"] for i in (1, 2, 3)]
    if sigma_mode == "weight":
        assert sigmas[0].size == 12 * 10
    else:
        assert all(s.size == 1 for s in sigmas)
    if sigma_mode == "client":  # one sigma for the whole client, tied across layers
        assert sigmas[0][0] == sigmas[1][0] == sigmas[2][0]
    else:
        assert len({float(s.reshape(-1)[0]) for s in sigmas}) == 3


def test_the_registry_offers_exactly_the_configurable_algorithms() -> None:
    """algorithms/registry.py is where the runner looks a configured name up; the config accepts exactly its names
    and holds one section per method, each the spec's. dturbo.sim.ALGORITHMS is the same table."""
    import dturbo
    from dturbo import sim
    from dturbo.algorithms.registry import ALGORITHMS
    from dturbo.config import ConfigError
    from dturbo.protocol import ClientAlgorithm, ServerAlgorithm
    from dturbo.settings import parse_config

    assert sim.ALGORITHMS is ALGORITHMS
    assert list(ALGORITHMS) == ["dturbo", "fedavg", "fedpaq", "dssm", "fedpm", "stc", "feddst"]
    for name, spec in ALGORITHMS.items():
        assert spec.name == name and dturbo.Config.model_fields[name].annotation is spec.section
        assert issubclass(spec.server, ServerAlgorithm) and issubclass(spec.client, ClientAlgorithm)  # type: ignore
        assert parse_config({"experiment": {"algorithm": name}}).experiment.algorithm == name
    with pytest.raises(ConfigError, match="Input should be 'dturbo', 'fedavg', .* or 'feddst'"):
        parse_config({"experiment": {"algorithm": "fedsgd"}})
