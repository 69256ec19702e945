"""benchmarks/per_class.py: per-class test accuracy of a recorded run's final model, on a real (tiny) run."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from run_helpers import load_benchmark

from dturbo.config import load_config, parse_config
from dturbo.rundir import RunDir
from dturbo.sim import Simulator


@pytest.fixture(scope="module")
def pc() -> ModuleType:
    return load_benchmark("per_class")


@pytest.fixture(scope="module")
def run_dir(make_toy, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "toy_s0"
    cfg = {"experiment": {"seed": 0, "rounds": 2, "threads": 1},
           "data": {"name": "npz", "path": str(make_toy(400))},
           "federation": {"clients": 3, "partition": "iid"},
           "model": {"name": "mlp", "hidden": [16]},
           "train": {"local_steps": 3, "batch_size": 32, "lr": 0.01},
           "dturbo": {"sparsity": {"target_density": 0.5, "warmup_rounds": 0, "ramp_rounds": 1}}}
    Simulator(parse_config(cfg), out).run()
    return out


def test_classes_add_up_to_the_runs_recorded_accuracy(pc, run_dir):
    got = pc.per_class(run_dir)
    labels = np.load(load_config(run_dir / "config.toml").data.path)["y_test"]  # the toy's own file
    counts = np.bincount(labels, minlength=len(got["per_class"]))
    assert len(got["per_class"]) == 4 and all(0.0 <= a <= 1.0 for a in got["per_class"])
    assert np.dot(counts, got["per_class"]) / counts.sum() == pytest.approx(got["accuracy"], abs=1e-9)
    assert got["accuracy"] == pytest.approx(float(RunDir(run_dir).read_rows()[-1]["accuracy"]), abs=1e-4)


def test_a_model_that_is_not_the_runs_is_refused(pc, run_dir, tmp_path):
    """The check against metrics.csv catches a model, a split or a metrics file that do not belong together."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("config.toml", "model.safetensors", "metrics.csv"):
        (bad / name).write_bytes((run_dir / name).read_bytes())
    rows = RunDir(run_dir).read_rows()
    rows[-1]["accuracy"] = str(float(rows[-1]["accuracy"]) - 0.05)
    RunDir(bad).write_rows(rows)
    with pytest.raises(SystemExit, match="not the run's last recorded accuracy"):
        pc.per_class(bad)
