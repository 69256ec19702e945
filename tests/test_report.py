"""The multi-run report (Fig. 2, Table I, Fig. 3) from real run directories; MobileNetV1; shipped configs."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from dturbo.cli import app
from dturbo.config import load_config, parse_config
from dturbo.data import load_dataset
from dturbo.nn.bayes import bayesian_layers
from dturbo.nn.models import build_model
from dturbo.prior import grid_shape
from dturbo.report import compare, summarize
from dturbo.sim import Simulator, build_algorithm, build_federation

ROOT = Path(__file__).resolve().parents[1]
FMNIST = Path("/usr/share/datasets/fashion-mnist")


def tiny(algorithm: str) -> dict:
    return {
        "experiment": {"name": algorithm, "seed": 2, "rounds": 3, "threads": 1, "algorithm": algorithm},
        "data": {"name": "fashion-mnist", "limit_train": 600, "limit_test": 400},
        "federation": {"clients": 4, "partition": "dirichlet", "alpha": 0.5},
        "model": {"name": "mlp", "hidden": [32]},
        "train": {"local_steps": 10, "batch_size": 32, "lr": 0.003},
        "dturbo": {"beta": 0.01, "sparsity": {"target_density": 0.4, "warmup_rounds": 1, "ramp_rounds": 2}},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not (FMNIST / "train-images-idx3-ubyte.gz").exists():
        pytest.skip("real Fashion-MNIST not installed")
    root = tmp_path_factory.mktemp("runs")
    ds = load_dataset("fashion-mnist", limit_train=600, limit_test=400, seed=2)
    out = []
    for algo in ("fedavg", "dturbo"):
        cfg = parse_config(tiny(algo))
        Simulator(cfg, root / algo, federation=build_federation(cfg, ds)).run()
        out.append(root / algo)
    return out


def test_compare_writes_figures_and_a_table_from_the_runs_files(runs, tmp_path):
    summaries, files = compare(runs, tmp_path / "rep", targets=[0.3, 0.999])
    for name in ("accuracy_vs_bits.png", "accuracy_vs_bits.svg", "comparison.md", "comparison.csv",
                 "dturbo/message_dense2.png", "dturbo/support_masks.svg", "fedavg/curves.png",
                 "fedavg/support_masks.png"):
        assert (tmp_path / "rep" / name).exists(), name
    with open(tmp_path / "rep" / "comparison.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [r["run"] for r in table] == ["fedavg", "dturbo"]
    for row, s in zip(table, summaries, strict=True):
        with open(s.run_dir / "metrics.csv", newline="") as f:
            metrics = list(csv.DictReader(f))
        assert float(row["final accuracy (%)"]) == pytest.approx(100 * float(metrics[-1]["accuracy"]), abs=0.005)
        assert float(row["bits up (Mbit)"]) == pytest.approx(sum(int(m["up_bits"]) for m in metrics) / 1e6, abs=0.05)
        # bits to reach = cumulative bits at the first round at or above the target
        first = next((m for m in metrics if float(m["accuracy"]) >= 0.3), None)
        expect = "not reached" if first is None else f"{float(first['cum_bits']) / 1e6:.1f}"
        assert row["bits to 30.0% (Mbit)"] == expect
        assert row["bits to 99.9% (Mbit)"] == "not reached"
        assert float(row["inference 3000 samples (ms)"]) > 0
    assert table[0]["nonzero weights (%)"] == "100.0"  # FedAvg stays dense
    assert float(table[1]["nonzero weights (%)"]) < 100


def test_bits_to_reach_matches_brute_force(runs):
    s = summarize(runs[1], inference=False)
    for target in np.linspace(0.05, 0.95, 19):
        hits = [c for a, c in zip(s.metrics["accuracy"], s.metrics["cum_bits"], strict=True) if a >= target]
        assert s.bits_to_reach(float(target)) == (hits[0] if hits else None)


def test_report_cli(runs, tmp_path):
    res = CliRunner().invoke(app, ["report", *map(str, runs), "--out", str(tmp_path / "r"), "--no-inference"])
    assert res.exit_code == 0, res.output
    assert "FedAvg 16-bit" in res.output and (tmp_path / "r" / "comparison.md").exists()
    res = CliRunner().invoke(app, ["report", str(tmp_path), "--out", str(tmp_path / "r2")])
    assert res.exit_code == 2 and "no metrics.csv" in " ".join(res.output.split())
    res = CliRunner().invoke(app, ["report", *map(str, runs), "--out", str(tmp_path / "r3"), "--target", "7"])
    assert res.exit_code == 2 and "--target 7" in " ".join(res.output.split())


@pytest.mark.parametrize("shape, classes", [((3, 32, 32), 100), ((1, 28, 28), 10)])
def test_mobilenet_v1_shapes_and_depthwise_grids(shape, classes):
    model = build_model("mobilenet-v1", shape, classes, width=0.25)
    assert model(torch.zeros(2, *shape)).shape == (2, classes)
    layers = dict(bayesian_layers(model))
    assert len(layers) == 1 + 2 * 13 + 1
    assert grid_shape(layers["dw1"]) == (8, 9)  # depthwise: out_channels x (in/groups * 3 * 3), SPEC 2
    assert grid_shape(layers["pw13"]) == (256, 256)
    full = build_model("mobilenet-v1", shape, classes)
    assert sum(p.numel() for n, p in full.named_parameters() if n.endswith("weight_mu")) > 3_000_000


def test_dturbo_round_on_mobilenet():
    cfg = parse_config({"model": {"name": "mobilenet-v1", "width": 0.25}, "experiment": {"threads": 1},
                        "data": {"name": "npz"}, "train": {"local_steps": 1, "batch_size": 4}})

    class Fed:  # a minimal federation: 8 random CIFAR-shaped images
        dataset = type("D", (), {"input_shape": (3, 32, 32), "num_classes": 100})()
        total_samples = 8

    g = torch.Generator().manual_seed(0)
    from dturbo.algorithms.base import ClientData

    data = ClientData(torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 100, (8,), generator=g))
    server, client = build_algorithm(cfg, Fed())  # type: ignore[arg-type]
    state = server.init()
    result = server.aggregate(state, [client.fit(server.downlink(state, 0), data, 0)], 0)
    assert result.metrics["clients_ok"] == 1
    assert result.state["dw1.pi_lo"].shape == (8, 9)


def test_every_shipped_config_parses():
    files = sorted((ROOT / "configs").rglob("*.toml"))
    assert len(files) >= 17
    algos = set()
    for f in files:
        algos.add(load_config(f).experiment.algorithm)
    assert algos == {"dturbo", "fedavg", "fedpaq", "dssm"}
    for stem in ("cifar10_alexnet", "cifar100_mobilenet"):
        cfg = load_config(ROOT / "configs" / f"{stem}.toml")
        assert (cfg.federation.clients, cfg.federation.alpha, cfg.experiment.rounds) == (10, 0.5, 100)
