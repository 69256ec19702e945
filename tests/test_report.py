"""The multi-run report (Fig. 2, Table I, Fig. 3) from real run directories; MobileNetV1; shipped configs."""

from __future__ import annotations

import csv
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from dturbo.algorithms.registry import build_algorithm
from dturbo.cli import app
from dturbo.data import load_dataset
from dturbo.federation import build_federation
from dturbo.nn.bayes import bayesian_layers
from dturbo.nn.models import build_model
from dturbo.nn.shapes import grid_shape
from dturbo.report import (
    RunSummary,
    _visible_tick_labels,
    compare,
    comparison_figure,
    comparison_table,
    curves_figure,
    draw_run,
    heatmap_figure,
    labels_overlap,
    masks_figure,
    read_metrics,
    summarize,
)
from dturbo.settings import load_config, parse_config
from dturbo.sim import Simulator

ROOT = Path(__file__).resolve().parents[1]
FMNIST = Path("/usr/share/datasets/fashion-mnist")


def tiny(algorithm: str) -> dict:
    return {
        "experiment": {"name": algorithm, "seed": 2, "rounds": 3, "threads": 1, "algorithm": algorithm},
        "data": {"name": "fashion-mnist", "limit_train": 600, "limit_test": 400},
        "federation": {"clients": 4, "partition": "dirichlet", "alpha": 0.5},
        "model": {"name": "mlp", "hidden": [32]},
        "train": {"local_steps": 10, "batch_size": 32, "lr": 0.003},
        # the ramp's last cut in the last round: the final model on it ("cut") reaches the target
        "dturbo": {"beta": 0.01, "global_model": "cut",
                   "sparsity": {"target_density": 0.4, "warmup_rounds": 1, "ramp_rounds": 2}},
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


@pytest.mark.slow
def test_compare_writes_figures_and_a_table_from_the_runs_files(runs, tmp_path):
    summaries, files = compare(runs, tmp_path / "rep", targets=[0.3, 0.999], inference=True)
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
    assert grid_shape(layers["dw1"]) == (8, 9)  # depthwise: out_channels x (in/groups * 3 * 3), docs/algorithm.md §2
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
    assert result.state["dw1.pi_logodds"].shape == (8, 9)


def test_every_shipped_config_parses():
    files = sorted((ROOT / "configs").rglob("*.toml"))
    assert len(files) >= 10
    algos = set()
    for f in files:
        algos.add(load_config(f).experiment.algorithm)
    assert algos == {"dturbo", "fedavg", "fedpaq", "dssm"}
    for stem in ("cifar10_alexnet", "cifar100_mobilenet"):
        cfg = load_config(ROOT / "configs" / f"{stem}.toml")
        assert (cfg.federation.clients, cfg.federation.alpha, cfg.experiment.rounds) == (10, 0.5, 100)


# ------------------------------------------------------------------ figure layout (issue 11)
def _fake_run(run_dir: Path, rounds: int, lo: float, hi: float, *, messages: bool = False) -> Path:
    """A run directory with a written metrics.csv (cumulative bits from lo to hi, geometric) and, if asked,
    messages/round_NNNN.safetensors with the support message and mask of three layers."""
    from safetensors.numpy import save_file

    run_dir.mkdir(parents=True)
    bits = np.geomspace(lo, hi, rounds)
    with open(run_dir / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["round", "accuracy", "density", "up_bits", "down_bits", "cum_bits"])
        for i in range(rounds):
            w.writerow([i + 1, 0.5 + 0.3 * i / rounds, 1 - 0.7 * i / rounds, bits[i] / 2, bits[i] / 2, bits[i]])
    if messages:
        (run_dir / "messages").mkdir()
        rng = np.random.default_rng(0)
        for r in range(1, rounds + 1):
            tensors = {}
            for name, shape in (("conv1", (6, 49)), ("dense1", (120, 256)), ("dense2", (84, 120))):
                pi = rng.uniform(0, 0.3 + 0.05 * r, size=shape).astype(np.float32)
                tensors[f"{name}.pi"] = pi
                tensors[f"{name}.mask"] = (pi > 0.2).astype(np.uint8)
            save_file(tensors, str(run_dir / "messages" / f"round_{r:04d}.safetensors"))
    return run_dir


def _summary(run_dir: Path, label: str) -> RunSummary:
    m = read_metrics(run_dir)
    return RunSummary(run_dir=run_dir, label=label, algorithm="fedavg", rounds=int(m["round"][-1]),
                      final_accuracy=float(m["accuracy"][-1]), best_accuracy=float(m["accuracy"].max()),
                      density=float(m["density"][-1]), up_bits=float(m["up_bits"].sum()),
                      down_bits=float(m["down_bits"].sum()), metrics=m)


@pytest.fixture
def close_figures():
    yield
    plt.close("all")


def _drawn(fig):
    fig.canvas.draw()
    return fig.canvas.get_renderer()


def _int_label(text: str) -> int:
    return int(text.replace("\N{MINUS SIGN}", "-"))  # raises on "2.5"


def _assert_inside(fig) -> None:
    """Nothing drawn (texts, tick labels, legend, colorbar) reaches past the figure's edges."""
    renderer = _drawn(fig)
    tight = fig.get_tightbbox(renderer)  # inches, only what is drawn
    width, height = fig.get_size_inches()
    eps = 1e-6
    assert tight.x0 >= -eps and tight.y0 >= -eps and tight.x1 <= width + eps and tight.y1 <= height + eps, (
        tight, (width, height))


def _assert_suptitle_clear(fig) -> None:
    renderer = _drawn(fig)
    sup = fig._suptitle.get_window_extent(renderer)
    for ax in fig.axes:
        for title in (ax.title, ax._left_title, ax._right_title):
            if title.get_text():
                assert not sup.overlaps(title.get_window_extent(renderer)), (fig._suptitle.get_text(), title)
        assert not sup.overlaps(ax.get_window_extent(renderer)), "suptitle over an axes"


@pytest.mark.parametrize("rounds", [1, 2, 3, 7, 30, 100])
def test_round_axes_have_integer_ticks_only(tmp_path, close_figures, rounds):
    fig = curves_figure(_fake_run(tmp_path / "run", rounds, 3e7, 4e8))
    _drawn(fig)
    round_axes = [ax for ax in fig.axes if ax.get_xlabel() == "communication round"]
    assert len(round_axes) == 2
    for ax in round_axes:
        labels = [t.get_text() for t in _visible_tick_labels(ax.xaxis)]
        assert labels, "a round axis without any tick label"
        assert all(str(_int_label(t)) == t.replace("\N{MINUS SIGN}", "-") for t in labels), labels


@pytest.mark.parametrize("lo, hi", [(3e7, 3.3e7), (2.2e7, 8e7), (3e7, 4e8), (1e6, 3e9), (1e5, 1e11), (5e8, 9e8)])
def test_log_bits_tick_labels_never_overlap(tmp_path, close_figures, lo, hi):
    run = _fake_run(tmp_path / "run", 12, lo, hi)
    figs = [curves_figure(run), comparison_figure([_summary(run, "A"), _summary(run, "B")])]
    for fig, ax in ((figs[0], figs[0].axes[2]), (figs[1], figs[1].axes[0])):
        renderer = _drawn(fig)
        labels = _visible_tick_labels(ax.xaxis)
        assert labels, (lo, hi)
        if hi / lo >= 3:
            assert len(labels) >= 2, [t.get_text() for t in labels]
        assert not labels_overlap(labels, renderer, pad_px=2.0), [t.get_text() for t in labels]
        assert all(t.get_text().endswith("bit") for t in labels)


def test_labels_overlap_detects_overlap(close_figures):
    """The overlap check itself can fail: the same label twice at one place overlaps."""
    fig, ax = plt.subplots()
    a, b, c = ax.text(0.1, 0.5, "100 Mbit"), ax.text(0.11, 0.5, "200 Mbit"), ax.text(0.8, 0.5, "1 Gbit")
    renderer = _drawn(fig)
    assert labels_overlap([a, b], renderer) and not labels_overlap([a, c], renderer)


def test_figures_keep_every_text_inside_and_the_suptitle_clear(tmp_path, close_figures):
    run = _fake_run(tmp_path / "run", 8, 3e7, 4e8, messages=True)
    figs = {"curves": curves_figure(run), "heatmap": heatmap_figure(run), "masks": masks_figure(run),
            "comparison": comparison_figure([_summary(run, "D-Turbo-VBI (25% target): long label"),
                                             _summary(run, "FedAvg 16-bit")])}
    assert all(f is not None for f in figs.values())
    assert [ax.get_title() for ax in figs["heatmap"].axes[:5]] == [f"round {r}" for r in (1, 3, 5, 6, 8)]
    for name, fig in figs.items():
        _assert_inside(fig)
        if fig._suptitle is not None:
            _assert_suptitle_clear(fig)
        else:
            assert name == "comparison"


def test_the_layout_checks_can_fail(close_figures):
    """Without a layout engine the old heat-map layout clips and overlaps: the checks above see it."""
    fig, axes = plt.subplots(1, 3, figsize=(9, 3))
    for ax in axes:
        ax.set(title="round 1", xlabel="input unit")
    fig.suptitle("Support message of dense2 over rounds", y=0.99)
    with pytest.raises(AssertionError):
        _assert_suptitle_clear(fig)
    fig.supxlabel("a label far below the figure", y=-0.2)
    with pytest.raises(AssertionError):
        _assert_inside(fig)


def test_saved_figures_are_cut_to_what_is_drawn(tmp_path, close_figures):
    run = _fake_run(tmp_path / "run", 4, 3e7, 4e8, messages=True)
    files = draw_run(run, tmp_path / "fig")
    assert sorted(p.name for p in files) == sorted(f"{n}.{e}" for n in ("curves", "message_dense2",
                                                                        "support_masks") for e in ("png", "svg"))
    assert plt.get_fignums() == []  # every figure closed after saving


@pytest.mark.slow
def test_saved_figures_are_byte_reproducible(tmp_path, close_figures):
    """Regenerating a committed figure must not churn it: the same drawing, the same PNG and SVG bytes."""
    run = _fake_run(tmp_path / "run", 4, 3e7, 4e8, messages=True)
    first, again = draw_run(run, tmp_path / "a"), draw_run(run, tmp_path / "b")
    assert [p.name for p in first] == [p.name for p in again]
    for a, b in zip(first, again, strict=True):
        assert a.read_bytes() == b.read_bytes(), a.name


def test_masks_figure_wraps_many_layers_into_rows(tmp_path, close_figures):
    from safetensors.numpy import save_file

    (tmp_path / "run" / "messages").mkdir(parents=True)
    save_file({f"pw{i}.mask": np.eye(8, dtype=np.uint8) for i in range(16)},
              str(tmp_path / "run" / "messages" / "round_0001.safetensors"))
    fig = masks_figure(tmp_path / "run")
    drawn = [ax for ax in fig.axes if ax.axison]
    assert len(drawn) == 16 and len(fig.axes) == 21  # 3 rows of 7, the last 5 empty
    assert fig.get_size_inches()[0] < 20
    _assert_inside(fig)


# ------------------------------------------------------------------ the inference column names what was timed
def test_inference_column_names_the_samples_really_timed(make_toy, tmp_path):
    cfg = parse_config({
        "experiment": {"name": "toy", "rounds": 2, "threads": 1, "algorithm": "fedavg"},
        "data": {"name": "npz", "path": str(make_toy(400))},  # 200 test samples
        "federation": {"clients": 2, "partition": "iid"},
        "model": {"name": "mlp", "hidden": [8]},
        "train": {"local_steps": 2, "batch_size": 32},
    })
    Simulator(cfg, tmp_path / "toy").run()
    s = summarize(tmp_path / "toy", repeats=1)
    assert s.inference_samples == 200 and s.inference_ms is not None and s.inference_ms > 0
    md, table = comparison_table([s], [0.5])
    header = next(csv.reader(table.splitlines()))
    assert header[-1] == "inference 200 samples (ms)" and "inference 3000" not in md
    other = _summary(tmp_path / "toy", "other")
    other.inference_ms, other.inference_samples = 12.34, 3000
    md, table = comparison_table([s, other], [0.5])
    rows = list(csv.reader(table.splitlines()))
    assert rows[0][-1] == "inference ms [samples]"
    assert rows[1][-1].endswith(" [200]") and rows[2][-1] == "12.3 [3000]"
    other.inference_ms = other.inference_samples = None
    assert comparison_table([other], [0.5])[1].splitlines()[0].endswith(",inference (ms)")


def test_a_run_that_missed_its_target_density_is_labelled_with_what_it_reached(runs, tmp_path):
    import shutil

    s = summarize(runs[1], inference=False)
    assert "40% target" in s.label and "reached" not in s.label  # it reached it
    missed = tmp_path / "missed"
    shutil.copytree(runs[1], missed)
    path = missed / "metrics.csv"
    rows = list(csv.DictReader(path.open()))
    rows[-1]["density"] = "0.426"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    assert summarize(missed, inference=False).label.endswith("), 43% reached")
