"""Bad inputs a new user meets give clear errors or warnings, not tracebacks or silent nonsense (issue 11):
images too small for a CNN, a config that is not TOML, lax config types, labels with gaps, a corrupted
checkpoint, a sparsity ramp longer than the run, misleading file messages, and an export's input scale."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save
from safetensors.torch import load_file as load_torch_file
from safetensors.torch import save_file as save_torch_file
from typer.testing import CliRunner

from dturbo import export as ex
from dturbo.algorithms import ALGORITHMS
from dturbo.algorithms.dturbo.checks import LocalStepsWarning, local_steps_warning, schedule_warning
from dturbo.algorithms.dturbo.sparsity import density_schedule
from dturbo.checkpoint import STATE_FILE, CheckpointError, CheckpointWarning, load_checkpoint, save_checkpoint
from dturbo.cli import app
from dturbo.config import ConfigError
from dturbo.data import DataError, DataWarning, load_dataset
from dturbo.federation import build_federation
from dturbo.nn.models import ModelInputError, build_model, check_input_shape
from dturbo.settings import load_config, parse_config
from dturbo.sim import ScheduleWarning, Simulator


def flat(text: str) -> str:
    """CLI output without rich's line wrapping."""
    return " ".join(text.split())


def write_npz(path: Path, x: np.ndarray, y: np.ndarray, n_test: int = 40, **extra: object) -> Path:
    np.savez(path, x_train=x, y_train=y, x_test=x[:n_test], y_test=y[:n_test], **extra)
    return path


@pytest.fixture
def uint8_npz(tmp_path) -> Path:
    """300 flat uint8 samples (12 features), 4 classes from the features: raw scale far from normalised."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (300, 12), dtype=np.uint8)
    y = (x[:, 0] > 128).astype(np.int64) + 2 * (x[:, 1] > 128)
    return write_npz(tmp_path / "flat.npz", x, y, n_test=60)


def toy_config(npz: Path, rounds: int = 1, **sections: dict) -> dict:
    cfg = {
        "experiment": {"rounds": rounds, "seed": 0, "threads": 1},
        "data": {"name": "npz", "path": str(npz)},
        "federation": {"clients": 2, "partition": "iid"},
        "model": {"name": "mlp", "hidden": [8]},
        "train": {"local_steps": 2, "batch_size": 32, "lr": 0.01},
        "dturbo": {"sparsity": {"warmup_rounds": 0, "ramp_rounds": 1}},
    }
    for k, v in sections.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    return cfg


# ------------------------------------------------------------------------- 1. images too small for the model
@pytest.mark.parametrize("model,layer,smallest", [("lenet5", "conv2", 12), ("alexnet-small", "pool4", 15)])
def test_cnn_on_too_small_images_names_model_size_layer_and_smallest(tmp_path, model, layer, smallest):
    rng = np.random.default_rng(0)
    npz = write_npz(tmp_path / "small.npz", rng.integers(0, 256, (60, 8, 8), dtype=np.uint8), np.arange(60) % 4)
    cfg = parse_config(toy_config(npz, model={"name": model}))
    with pytest.raises(ModelInputError) as err:
        Simulator(cfg, tmp_path / "run")
    msg = str(err.value)
    assert f"model '{model}'" in msg and "1x8x8" in msg and f"layer '{layer}'" in msg
    assert f"{smallest}x{smallest}" in msg
    assert not (tmp_path / "run").exists()  # refused before anything is written
    build_model(model, (1, smallest, smallest), 4)  # the size the message names does work
    (tmp_path / "c.toml").write_text(cfg.to_toml())
    cli = CliRunner().invoke(app, ["run", str(tmp_path / "c.toml"), "--out", str(tmp_path / "run")])
    assert cli.exit_code == 2 and "1x8x8" in flat(cli.output) and "Traceback" not in cli.output


def test_dry_forward_leaves_the_global_rng_alone():
    model = build_model("lenet5", (1, 28, 28), 10)
    model.train()
    state = torch.get_rng_state()
    check_input_shape(model, (1, 28, 28), "lenet5")
    assert torch.equal(state, torch.get_rng_state()) and model.training


# ------------------------------------------------------------------------------- 2. a config that is not TOML
def test_config_that_is_not_toml_names_the_file(tmp_path, uint8_npz):
    with pytest.raises(ConfigError, match=r"flat\.npz is not a TOML file"):
        load_config(uint8_npz)
    result = CliRunner().invoke(app, ["run", str(uint8_npz), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2 and "is not a TOML file" in flat(result.output)
    assert "Traceback" not in result.output and not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------ 3. strict config types
@pytest.mark.parametrize("data,key,expected", [
    ({"federation": {"clients": True}}, "federation.clients", "valid integer"),
    ({"experiment": {"rounds": "20"}}, "experiment.rounds", "valid integer"),
    ({"experiment": {"rounds": 20.0}}, "experiment.rounds", "valid integer"),
    ({"train": {"lr": "0.1"}}, "train.lr", "valid number"),
    ({"experiment": {"name": 3}}, "experiment.name", "valid string"),
    ({"dturbo": {"prior": {"conv": {"tie_rows": 1}}}}, "dturbo.prior.conv.tie_rows", "valid boolean"),
    ({"dturbo": {"prior": {"conv": {"tie_rows": "nope"}}}}, "dturbo.prior.conv.tie_rows",  # a union: both members
     "valid boolean, or input should be 'without_batchnorm' (got 'nope')"),
    ({"model": {"hidden": ["8"]}}, "model.hidden.0", "valid integer"),
    ({"model": {"widths": [3, 8, 16]}}, "model.widths", "widths must be 6 sizes of 1 to 65536"),
    ({"model": {"widths": [3, 8, 16, 0, 120, 84]}}, "model.widths", "alexnet-small's are [6, 16, 32, 64, 120, 84]"),
    ({"model": {"name": "mlp", "widths": [3, 8, 16, 16, 120, 84]}}, "model", "takes hidden (mlp)"),
])
def test_values_must_have_their_declared_types(data, key, expected):
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert f"'{key}'" in str(err.value) and expected in str(err.value)


def test_ints_for_floats_and_typed_overrides_still_work():
    cfg = parse_config({"train": {"lr": 1}, "dturbo": {"sparsity": {"target_density": 1, "layer_targets": {"a": 1}}}})
    assert cfg.train.lr == 1.0 and cfg.dturbo.sparsity.target_density == 1.0
    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "configs" / "fmnist_quick.toml", [
        "experiment.rounds=20", "experiment.name=true", "data.path=/x/2024", "train.lr=1", "model.hidden=[64, 32]",
        "dturbo.sparsity.layer_targets={conv1 = 0.3}", "dturbo.prior.conv.tie_rows=true", "faults.deadline=2",
        "dturbo.sparsity.mode=prior",
    ])
    assert cfg.experiment.rounds == 20 and cfg.experiment.name == "true" and cfg.data.path == "/x/2024"
    assert cfg.model.hidden == [64, 32] and cfg.dturbo.sparsity.layer_targets == {"conv1": 0.3}
    assert cfg.dturbo.prior.conv.tie_rows is True and cfg.faults.deadline == 2.0 and cfg.train.lr == 1.0
    with pytest.raises(ConfigError, match="'federation.clients'.*valid integer"):
        load_config(root / "configs" / "fmnist_quick.toml", ["federation.clients=true"])


# ------------------------------------------------------------------------------------------------ 4. labels
def _labels_npz(tmp_path: Path, y_train: np.ndarray, y_test: np.ndarray, **extra: object) -> Path:
    rng = np.random.default_rng(1)
    path = tmp_path / "labels.npz"
    np.savez(path, x_train=rng.normal(size=(len(y_train), 4)).astype(np.float32), y_train=y_train,
             x_test=rng.normal(size=(len(y_test), 4)).astype(np.float32), y_test=y_test, **extra)
    return path


def test_label_gaps_warn_and_name_the_missing_classes(tmp_path):
    y = np.array([*range(10), 12] * 3)
    with pytest.warns(DataWarning, match=r"class 10, 11.*num_classes=13"):
        ds = load_dataset("npz", _labels_npz(tmp_path, y, y))
    assert ds.num_classes == 13


def test_stored_num_classes_bounds_labels_and_silences_gaps(tmp_path):
    y = np.array([*range(10), 12] * 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a deliberate gap: no warning
        ds = load_dataset("npz", _labels_npz(tmp_path, y, y, num_classes=np.int64(15)))
    assert ds.num_classes == 15
    with pytest.raises(DataError, match=r"y_train has label 12, outside \[0, num_classes = 12\)"):
        load_dataset("npz", _labels_npz(tmp_path, y, y, num_classes=12))
    with pytest.raises(DataError, match="num_classes must be one integer"):
        load_dataset("npz", _labels_npz(tmp_path, y, y, num_classes=np.array([13, 13])))


def test_test_label_unseen_in_training_warns(tmp_path):
    with pytest.warns(DataWarning, match=r"test label\(s\) 3 never appear in y_train"):
        load_dataset("npz", _labels_npz(tmp_path, np.arange(30) % 3, np.arange(8) % 4, num_classes=4))


@pytest.mark.parametrize("y,match", [(np.array([0, 1, -1, 2] * 5), "negative"),
                                     (np.array([0.0, 1.0, 2.0, 1.5] * 5), "integer class labels")])
def test_negative_or_non_integer_labels_are_errors(tmp_path, y, match):
    with pytest.raises(DataError, match=match):
        load_dataset("npz", _labels_npz(tmp_path, y, y))


# ------------------------------------------------------------------------------------------- 5. checkpoints
def test_corrupted_checkpoint_is_refused_and_left_untouched(tmp_path):
    folder = tmp_path / "checkpoint"
    state = {"w": np.linspace(-1, 1, 64, dtype=np.float32), "n": np.arange(5)}
    save_checkpoint(folder, state, {"rounds_done": 3})
    got, counters = load_checkpoint(folder)
    assert counters == {"rounds_done": 3} and np.array_equal(got["w"], state["w"])
    path = folder / STATE_FILE
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x01  # a finite corruption: one mantissa bit of one weight
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=rf"checkpoint {path} is corrupted.*left untouched"):
        load_checkpoint(folder)
    assert path.read_bytes() == bytes(raw)


def test_checkpoint_without_checksum_is_refused_unless_asked_for_by_name(tmp_path):
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    state = {"w": np.ones(8, np.float32)}
    raw = save(state, metadata={"counters": json.dumps({"rounds_done": 1})})
    (folder / STATE_FILE).write_bytes(raw)
    with pytest.raises(CheckpointError, match="has no checksum, not one of the whole file.*--resume-unverified"):
        load_checkpoint(folder)
    assert (folder / STATE_FILE).read_bytes() == raw
    with pytest.warns(CheckpointWarning, match="no checksum"):
        got, counters = load_checkpoint(folder, unverified=True)
    assert counters == {"rounds_done": 1} and np.array_equal(got["w"], state["w"])


def test_resume_from_a_corrupted_checkpoint_names_it(tmp_path, uint8_npz):
    cfg = parse_config(toy_config(uint8_npz))
    Simulator(cfg, tmp_path / "run").run()
    path = tmp_path / "run" / "checkpoint" / STATE_FILE
    raw = bytearray(path.read_bytes())
    raw[-7] ^= 0x10
    path.write_bytes(bytes(raw))
    files = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    more = parse_config(toy_config(uint8_npz, rounds=2))
    with pytest.raises(CheckpointError, match="is corrupted"):
        Simulator(more, tmp_path / "run", resume=True).run()
    assert {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == files


# ------------------------------------------------------------------ 6b. pruning with few local steps a round
def test_few_local_steps_warn_with_the_median_clients_step_count(tmp_path, uint8_npz):
    few = parse_config(toy_config(uint8_npz, dturbo={"sparsity": {"target_density": 0.3}}))
    fed = build_federation(few)
    assert local_steps_warning(few, fed).startswith(
        "the median client trains only 2 local steps a round (train.local_steps = 2)")
    # epochs: the step count the client will take, from the median client's sample count
    sizes = sorted(len(c) for c in fed.clients)
    by_epochs = parse_config(toy_config(uint8_npz, dturbo={"sparsity": {"target_density": 0.3}},
                                        train={"local_steps": 0, "local_epochs": 1, "batch_size": 32}))
    steps = -(-sizes[len(sizes) // 2] // 32)
    assert steps < 10
    assert f"only {steps} local steps a round (train.local_epochs = 1 of {sizes[len(sizes) // 2]} samples in " \
           "batches of 32)" in local_steps_warning(by_epochs, fed)
    with pytest.warns(LocalStepsWarning, match="raise train.local_epochs or train.local_steps to >= 10"):
        Simulator(few, tmp_path / "run")
    # enough steps, or no pruning: no warning; another algorithm raises none of D-Turbo-VBI's
    for data in ({"train": {"local_steps": 10}}, {"dturbo": {"sparsity": {"target_density": 1.0}}}):
        assert local_steps_warning(parse_config(toy_config(uint8_npz, **data)), fed) is None
    assert ALGORITHMS["fedavg"].run_warnings(few, fed) == []


# ---------------------------------------------------------------------------------- 6. a ramp past the run
def test_ramp_longer_than_the_run_warns_with_the_density_reached(tmp_path, uint8_npz):
    data = toy_config(uint8_npz, rounds=2, dturbo={"global_model": "cut", "sparsity": {
        "target_density": 0.2, "warmup_rounds": 1, "ramp_rounds": 6}})
    reached = density_schedule(1, target=0.2, warmup=1, ramp=6)
    with pytest.warns(ScheduleWarning, match=rf"final model's scheduled density is {reached:.3f}.*rounds >= 7.*"
                                            rf"ramp_rounds <= 1"):
        Simulator(parse_config(data), tmp_path / "run")
    assert schedule_warning(parse_config(toy_config(uint8_npz, rounds=2))) is None  # warmup 0 + ramp 1 <= 2 - 1
    assert schedule_warning(parse_config({**data, "experiment": {"rounds": 7}})) is None
    # "trained": the final model holds the support the round before the last decided, so the ramp ends a round earlier
    trained = parse_config({**data, "experiment": {"rounds": 7},
                            "dturbo": {**data["dturbo"], "global_model": "trained"}})
    reached = density_schedule(5, target=0.2, warmup=1, ramp=6)
    assert re.search(rf"round before the last.*final model's scheduled density is {reached:.3f}.*rounds >= 8.*"
                     rf"ramp_rounds <= 5", schedule_warning(trained))
    cfg_path = tmp_path / "ramp.toml"
    cfg_path.write_text(parse_config(data).to_toml())
    result = CliRunner().invoke(app, ["run", str(cfg_path), "--out", str(tmp_path / "cli"), "--no-figures"])
    assert result.exit_code == 0, result.output
    assert "warning: the sparsity schedule does not reach target_density 0.2" in flat(result.output)


# ------------------------------------------------------------------------------------ 7. misleading messages
def test_text_file_named_npz_is_not_called_a_pickle(tmp_path):
    fake = tmp_path / "fake.npz"
    fake.write_text("x_train,y_train\n1,2\n")
    with pytest.raises(DataError, match=r"is not a readable \.npz file: it is text, not an npz \(zip\) archive") as err:
        load_dataset("npz", fake)
    assert "pickle" not in str(err.value)


def test_out_naming_a_file_says_so(tmp_path, uint8_npz):
    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(parse_config(toy_config(uint8_npz)).to_toml())
    result = CliRunner().invoke(app, ["run", str(cfg_path), "--out", str(cfg_path)])
    assert result.exit_code == 2 and "--out must be a directory" in flat(result.output)
    assert "Errno" not in result.output
    with pytest.raises(FileExistsError, match="names a file; --out must be a directory"):
        Simulator(parse_config(toy_config(uint8_npz)), cfg_path).run()


def test_messages_about_a_run_without_checkpoint_agree_and_work(tmp_path, uint8_npz):
    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(parse_config(toy_config(uint8_npz)).to_toml())
    out = tmp_path / "run"

    def cli(*extra: str) -> tuple[int, str]:
        r = CliRunner().invoke(app, ["run", str(cfg_path), "--out", str(out), "--no-figures", *extra])
        return r.exit_code, flat(r.output)

    # a run that stopped before its first checkpoint: config.toml, an empty checkpoint folder, metrics
    out.mkdir()
    (out / "config.toml").write_text(cfg_path.read_text())
    (out / "checkpoint").mkdir()
    (out / "metrics.csv").write_text("round,accuracy\n")
    code, text = cli("--resume")
    assert code == 2 and "has no checkpoint to resume" in text and "without --resume into a fresh --out" in text
    code, text = cli()
    assert code == 2 and "nothing to --resume" in text and f"delete {out}" in text
    assert "use --resume" not in text
    for p in sorted(out.rglob("*"), reverse=True):  # follow the advice: delete the folder, run again
        p.rmdir() if p.is_dir() else p.unlink()
    out.rmdir()
    code, text = cli()
    assert code == 0, text
    assert (out / "checkpoint" / STATE_FILE).exists()
    code, text = cli()  # now it holds a run with a checkpoint: --resume is the way
    assert code == 2 and "already holds a run; use --resume to continue it" in text
    code, text = cli("--resume")
    assert code == 0, text


# ------------------------------------------------------------------------------ 8. the export's input scale
def test_export_takes_raw_inputs_with_the_stored_normalisation(tmp_path, uint8_npz):
    cfg = parse_config(toy_config(uint8_npz))
    sim = Simulator(cfg, tmp_path / "run")
    sim.run()
    ds = sim.fed.dataset
    exported = ex.export_run(tmp_path / "run", tmp_path / "model")
    assert exported.input_norm == {**ds.input_norm, "raw_dtype": "uint8"} and exported.input_norm["scale"] == 255
    spec = json.loads((tmp_path / "model" / "model.json").read_text())
    assert spec["version"] == 3 and spec["input_norm"]["mean"] == ds.input_norm["mean"]
    raw = torch.from_numpy(np.load(uint8_npz)["x_test"])  # uint8, as the user has them
    normalised = torch.from_numpy(ds.x_test)
    # Fixed kernels: kernels chosen by timing may differ between two loads on a busy machine (last-bit sums).
    fixed = {"compile": False, "kernels": "dense", "conv": "default", "pool": "default", "channels_last": False}
    m_raw = ex.load(tmp_path / "model", inputs="raw", **fixed)
    m_norm = ex.load(tmp_path / "model", **fixed)
    assert m_raw.inputs == "raw" and m_norm.inputs == "normalised"
    assert torch.equal(m_raw.normalise(raw), normalised)  # bit for bit the reader's values
    with torch.no_grad():
        assert float((m_raw(raw) - m_norm(normalised)).abs().max()) == 0.0
        assert float((m_raw(raw.float()) - m_norm(normalised)).abs().max()) == 0.0
        with pytest.raises(TypeError, match="inputs='raw'"):
            m_norm(raw)  # uint8 pixels into a model that takes normalised inputs


def test_export_of_an_older_run_recomputes_the_normalisation(tmp_path, uint8_npz):
    Simulator(parse_config(toy_config(uint8_npz)), tmp_path / "run").run()
    model_file = tmp_path / "run" / "model.safetensors"
    new = ex.export_run(tmp_path / "run").input_norm
    state = load_torch_file(str(model_file))
    save_torch_file(state, str(model_file), metadata={"model": "mlp", "dataset": "npz", "algorithm": "dturbo"})
    assert ex.export_run(tmp_path / "run").input_norm == new  # from the data, as the run computed it
    uint8_npz.unlink()  # data gone: exported without, and the model takes normalised inputs only
    old = ex.export_run(tmp_path / "run", tmp_path / "model")
    assert old.input_norm is None
    assert ex.load(tmp_path / "model", compile=False).inputs == "normalised"
    with pytest.raises(ex.ExportError, match="does not store the input normalisation"):
        ex.load(tmp_path / "model", inputs="raw")


def test_version_2_exports_still_load(tmp_path, uint8_npz):
    Simulator(parse_config(toy_config(uint8_npz)), tmp_path / "run").run()
    ex.export_run(tmp_path / "run", tmp_path / "model")
    spec_path = tmp_path / "model" / "model.json"
    spec = json.loads(spec_path.read_text())
    spec["version"] = 2
    del spec["input_norm"]
    spec_path.write_text(json.dumps(spec))
    m = ex.load(tmp_path / "model", compile=False)
    assert m.inputs == "normalised" and m(torch.zeros(3, 12)).shape == (3, 4)
    with pytest.raises(ex.ExportError, match="format version 2"):
        ex.load(tmp_path / "model", inputs="raw")
    data = load_file(str(tmp_path / "model" / "model.safetensors"))
    assert data  # the weights file is untouched by reading
