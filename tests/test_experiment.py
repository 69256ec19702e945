"""dturbo.Experiment: ``dturbo run`` from Python, with data from the config or from arrays in memory."""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from run_helpers import TIMING, rows_of
from typer.testing import CliRunner

import dturbo
from dturbo.checkpoint import CheckpointError
from dturbo.cli import app
from dturbo.data import DataError, load_dataset
from dturbo.nn.bayes import bayesian_layers
from dturbo.sim import evaluate


def toy_arrays(n: int = 300) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """4 classes of 6x6 uint8 images (N,H,W), labels from the pixels; the first 100 also the test set."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(n, 6, 6), dtype=np.uint8)
    y = (x[:, :3].mean((1, 2)) > 127).astype(np.int64) + 2 * (x[:, 3:].mean((1, 2)) > 127)
    return x, y, x[:100], y[:100]


@pytest.fixture(scope="module")
def toy_npz(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "toy.npz"
    x, y, xt, yt = toy_arrays()
    np.savez(path, x_train=x, y_train=y, x_test=xt, y_test=yt)
    return path


def files(run: Path) -> list[str]:
    return sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())


@pytest.mark.slow
def test_same_run_directory_as_the_cli(tmp_path, tiny_config, toy_npz):
    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(dturbo.load_config(tiny_config(data={"name": "npz", "path": str(toy_npz)})).to_toml())
    result = CliRunner().invoke(app, ["run", str(cfg_path), "--out", str(tmp_path / "cli")])
    assert result.exit_code == 0, result.output
    res = dturbo.Experiment(cfg_path, out=tmp_path / "lib", progress=False).run()
    assert files(tmp_path / "lib") == files(tmp_path / "cli") and "figures/curves.png" in files(tmp_path / "lib")
    assert rows_of(tmp_path / "lib") == rows_of(tmp_path / "cli")
    assert (tmp_path / "lib" / "config.toml").read_text() == (tmp_path / "cli" / "config.toml").read_text()
    # the result's metrics are metrics.csv's rows, typed
    assert [r["round"] for r in res.metrics] == [1, 2] and isinstance(res.metrics[0]["up_bits"], int)
    assert res.accuracy == float(rows_of(tmp_path / "cli")[-1]["accuracy"]) and res.out == tmp_path / "lib"


def test_arrays_run_as_the_npz_file_does(tmp_path, tiny_config, toy_npz):
    npz = dturbo.Experiment(tiny_config(data={"name": "npz", "path": str(toy_npz)}), out=tmp_path / "npz",
                            progress=False, figures=False).run()
    x, y, xt, yt = toy_arrays()
    # the config's data name and path are replaced; torch tensors in NHWC layout read as the numpy NHW arrays
    arrays = dturbo.Experiment(tiny_config(data={"name": "npz", "path": "/elsewhere.npz"}),
                               data=(torch.from_numpy(x[..., None]), torch.from_numpy(y), xt[..., None], yt),
                               out=tmp_path / "arrays", progress=False, figures=False).run()
    assert rows_of(tmp_path / "arrays") == rows_of(tmp_path / "npz")
    assert arrays.metrics[-1]["accuracy"] == npz.metrics[-1]["accuracy"]
    written = tomllib.loads((tmp_path / "arrays" / "config.toml").read_text())
    assert written["data"]["name"] == "arrays" and "path" not in written["data"]
    assert arrays.config.data.name == "arrays"


def test_result_model_is_the_saved_global_model(tmp_path, tiny_config, toy_npz):
    res = dturbo.Experiment(tiny_config(), data=toy_arrays(), out=tmp_path / "run", progress=False,
                            figures=False).run()
    model = res.model
    assert not model.training
    ds = load_dataset("npz", toy_npz)  # the same data, normalised the same way
    acc, loss = evaluate(model, torch.from_numpy(ds.x_test), torch.from_numpy(ds.y_test))
    assert acc == res.accuracy and loss == pytest.approx(res.metrics[-1]["loss"])
    kept = sum(int(layer.masked_weight().count_nonzero()) for _, layer in bayesian_layers(model))
    total = sum(layer.weight_mu.numel() for _, layer in bayesian_layers(model))
    assert kept / total == pytest.approx(res.support_density, abs=1e-6) and res.support_density < 1
    # density: every value of the model, as a user counts them (the biases too: they are not pruned)
    values = [t for _, layer in bayesian_layers(model) for t in (layer.masked_weight(), layer.bias)]
    assert res.density == pytest.approx(sum(int(t.count_nonzero()) for t in values) / sum(t.numel() for t in values))
    assert res.support_density < res.density < 1
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "run" / "model.safetensors"))
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=0)


def test_resume_continues_as_an_uninterrupted_run(tmp_path, tiny_config):
    data = toy_arrays()
    whole = dturbo.Experiment(tiny_config(rounds=3), data=data, out=tmp_path / "whole", progress=False,
                              figures=False).run()
    dturbo.Experiment(tiny_config(rounds=1), data=data, out=tmp_path / "split", progress=False, figures=False).run()
    with pytest.raises(FileExistsError, match="already holds a run"):
        dturbo.Experiment(tiny_config(rounds=3), data=data, out=tmp_path / "split", progress=False).run()
    seen: list[dict] = []
    resumed = dturbo.Experiment(tiny_config(rounds=3), data=data, out=tmp_path / "split", resume=True,
                                progress=seen.append, figures=False).run()
    assert [r["round"] for r in seen] == [2, 3]  # only the rounds run now reach the callback
    assert rows_of(tmp_path / "split") == rows_of(tmp_path / "whole")
    strip = [[{k: v for k, v in r.items() if k not in TIMING} for r in res.metrics] for res in (resumed, whole)]
    assert strip[0] == strip[1]
    with pytest.raises(CheckpointError, match="no checkpoint"):
        dturbo.Experiment(tiny_config(), data=data, out=tmp_path / "fresh", resume=True, progress=False).run()


def test_progress_prints_a_line_per_round(tmp_path, tiny_config, capsys):
    dturbo.Experiment(tiny_config(), data=toy_arrays(), out=tmp_path / "run", figures=False).run()
    first, *lines = capsys.readouterr().err.splitlines()
    assert first.startswith("dturbo ") and " from a timed training step)" in first
    assert [ln.split()[:2] for ln in lines] == [["round", "1/2"], ["round", "2/2"]]
    assert "acc " in lines[0] and "density " in lines[0] and "bits " in lines[0]


def _bad(problem: str) -> tuple[object, dict]:
    x, y, xt, yt = toy_arrays()
    kwargs: dict = {}
    if problem == "lengths":
        data: object = (x, y[:-1], xt, yt)
    elif problem == "sample shapes":
        data = (x, y, xt[:, :5], yt)
    elif problem == "negative label":
        data = (x, y - 1, xt, yt)
    elif problem == "label >= num_classes":
        data, kwargs = (x, y, xt, yt), {"num_classes": 3}
    elif problem == "text":
        data = (x.astype(str), y, xt, yt)
    elif problem == "objects":
        data = (np.full((len(y), 3), None, dtype=object), y, xt, yt)
    elif problem == "ragged":
        data = ([[1.0, 2.0], [3.0]], y[:2], xt, yt)
    elif problem == "1-d x":
        data = (x[:, 0, 0], y, xt, yt)
    elif problem == "float labels":
        data = (x, y.astype(np.float32), xt, yt)
    elif problem == "labels 2-d":
        data = (x, y[:, None], xt, yt)
    elif problem == "nan":
        data = (x, y, np.full(xt.shape, np.nan), yt)
    elif problem == "three arrays":
        data = (x, y, xt)
    elif problem == "a path":
        data = "data.npz"
    else:  # a mapping without y_test
        data = {"x_train": x, "y_train": y, "x_test": xt}
    return data, kwargs


@pytest.mark.parametrize("problem,match", [
    ("lengths", r"x_train has shape \(300, 6, 6\) \(300 rows\) but y_train has 299 rows"),
    ("sample shapes", r"x_train samples \(6, 6\) and x_test samples \(5, 6\) differ"),
    ("negative label", "y_train has negative labels"),
    ("label >= num_classes", r"label 3, outside \[0, num_classes = 3\)"),
    ("text", "x_train must be numeric"), ("objects", "x_train must be numeric"),
    ("ragged", "x_train is not a numeric array"), ("1-d x", r"x_train has shape \(300,\), not rows of samples"),
    ("float labels", "y_train must hold integer class labels"),
    ("labels 2-d", r"y_train must be one label per row, shape \(N,\)"), ("nan", "x_test contains NaN"),
    ("three arrays", r"data must be \(x_train, y_train, x_test, y_test\).*a sequence of 3"),
    ("a path", "data must be .*got str.*data.path"), ("mapping", "data: missing y_test"),
])
def test_bad_data_is_refused_at_construction_naming_the_problem(tmp_path, tiny_config, problem, match):
    data, kwargs = _bad(problem)
    with pytest.raises(DataError, match=match):
        dturbo.Experiment(tiny_config(), data=data, out=tmp_path / "run", **kwargs)
    assert not (tmp_path / "run").exists()


def test_mapping_data_and_its_num_classes(tmp_path, tiny_config):
    x, y, xt, yt = toy_arrays()
    exp = dturbo.Experiment(tiny_config(), data={"x_train": x, "y_train": y, "x_test": xt, "y_test": yt,
                                                 "num_classes": np.int64(6)}, out=tmp_path / "run")
    assert exp.dataset is not None and exp.dataset.num_classes == 6 and exp.dataset.input_shape == (1, 6, 6)


def test_arrays_config_without_data_and_bad_config_are_named(tmp_path, tiny_config):
    with pytest.raises(DataError, match="data.name = 'arrays' names data held in memory"):
        dturbo.Experiment(tiny_config(), out=tmp_path / "run", progress=False).run()
    with pytest.raises(dturbo.ConfigError, match=r"'train\.lrr': unknown key"):
        dturbo.Experiment(tiny_config(train={"lrr": 1.0}), data=toy_arrays(), out=tmp_path / "run")
    with pytest.raises(ValueError, match="num_classes goes with data"):
        dturbo.Experiment(tiny_config(), out=tmp_path / "run", num_classes=4)


def test_export_of_an_arrays_run(tmp_path, tiny_config):
    """An mlp run from arrays exports (shape from the weights, normalisation from model.safetensors); a CNN's
    export says it cannot tell the input shape (docs/models.md, "Limits")."""
    from dturbo.export import ExportError, export_run

    x, y, xt, yt = toy_arrays()
    flat = (x.reshape(len(x), -1), y, xt.reshape(len(xt), -1), yt)  # N,D: the mlp's input shape is its weights'
    dturbo.Experiment(tiny_config(rounds=1), data=flat, out=tmp_path / "mlp", progress=False, figures=False).run()
    exported = export_run(tmp_path / "mlp", tmp_path / "model")
    assert exported.input_norm is not None and exported.input_norm["scale"] == 255
    big = np.repeat(np.repeat(x, 2, axis=1), 2, axis=2)  # 12x12: lenet5's smallest input
    big_test = np.repeat(np.repeat(xt, 2, axis=1), 2, axis=2)
    dturbo.Experiment(tiny_config(rounds=1, model={"name": "lenet5"}), data=(big, y, big_test, yt),
                      out=tmp_path / "cnn", progress=False, figures=False).run()
    with pytest.raises(ExportError, match="'arrays'"):
        export_run(tmp_path / "cnn", tmp_path / "model_cnn")


def test_progress_is_one_line_a_round_with_the_time_left_in_python_and_in_a_pipe(tmp_path, tiny_config, toy_npz,
                                                                               capsys):
    """Experiment's progress and ``dturbo run`` piped to a file both print one line per round, each ending with the
    time left; a piped line is never cut at 80 columns (the first names a run directory longer than that)."""
    cfg = tiny_config(rounds=3, data={"name": "npz", "path": str(toy_npz)})
    out = tmp_path / ("a-run-directory-whose-name-is-long-enough-to-pass-eighty-columns" * 2)
    dturbo.Experiment(cfg, out=out, figures=False).run()
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("round ")]
    assert [x.split()[1] for x in lines] == ["1/3", "2/3", "3/3"]
    assert all(x.endswith(" left)") for x in lines), lines
    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(dturbo.load_config(cfg).to_toml())
    res = CliRunner().invoke(app, ["run", str(cfg_path), "--out", str(out) + "-cli", "--no-figures"])
    assert res.exit_code == 0, res.output
    lines = [x for x in res.output.splitlines() if x.startswith("round ")]
    assert len(lines) == 3 and all(x.endswith(" left)") for x in lines), lines
    first = res.output.splitlines()[0]
    assert f"-> {out}-cli  (about " in first and first.endswith(" from a timed training step)"), first


def test_the_round_estimate_times_a_step_and_leaves_the_run_unchanged(tmp_path, tiny_config, toy_npz, capsys):
    """The first line's estimate draws nothing from the RNG the run trains with: a run after it equals one
    without it, metric for metric."""
    from dturbo.sim import Simulator

    cfg = dturbo.load_config(tiny_config(rounds=2, data={"name": "npz", "path": str(toy_npz)}))
    sim = Simulator(cfg, tmp_path / "a")
    state = torch.get_rng_state()
    assert sim.estimate_round_seconds() > 0
    assert torch.equal(state, torch.get_rng_state())
    with_estimate = sim.run()
    without = Simulator(cfg, tmp_path / "b").run()
    assert [r["accuracy"] for r in with_estimate] == [r["accuracy"] for r in without]
    assert [r["cum_bits"] for r in with_estimate] == [r["cum_bits"] for r in without]
