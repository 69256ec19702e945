"""Configs are validated with errors that name the key; the CLI reports them without a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from dturbo.cli import app
from dturbo.config import ConfigError
from dturbo.settings import load_config, parse_config

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_configs_parse():
    paths = sorted((ROOT / "configs").rglob("*.toml"))  # strict types refuse none
    assert len(paths) >= 10
    for path in paths:
        cfg = load_config(path)
        assert cfg.experiment.rounds >= 1


@pytest.mark.parametrize("data,key", [
    ({"federation": {"alpha": 0}}, "federation.alpha"),
    ({"federation": {"clients": 3, "clients_per_round": 5}}, "federation"),
    ({"federation": {"cleints": 3}}, "federation.cleints"),
    ({"data": {"name": "imagenet"}}, "data.name"),
    ({"model": {"name": "mlp", "hidden": [0]}}, "model.hidden"),
    ({"dturbo": {"prior": {"conv": {"p11_row": 1.5}}}}, "dturbo.prior.conv.p11_row"),
    ({"dturbo": {"sparsity": {"target_density": 0}}}, "dturbo.sparsity.target_density"),
    ({"train": {"lr": "fast"}}, "train.lr"),
    ({"experiment": {"algorithm": "fedprox"}}, "experiment.algorithm"),
    ({"bogus": {}}, "bogus"),
])
def test_bad_values_name_the_key(data, key):
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert f"'{key}" in str(err.value)


def test_overrides_and_unreadable_files(tmp_path):
    cfg = load_config(ROOT / "configs" / "fmnist_quick.toml", ["experiment.rounds=3", "dturbo.sparsity.mode=prior"])
    assert cfg.experiment.rounds == 3 and cfg.dturbo.sparsity.mode == "prior"
    bad = tmp_path / "bad.toml"
    bad.write_text("[experiment\nrounds = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")


def test_cli_reports_config_errors_cleanly(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[federation]\nalpha = -1\n")
    result = CliRunner().invoke(app, ["run", str(bad), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2
    assert "federation.alpha" in result.output
    assert not (tmp_path / "run").exists()  # nothing half-written


def test_cli_resume_without_run_is_refused(tmp_path):
    result = CliRunner().invoke(app, ["run", str(ROOT / "configs" / "fmnist_quick.toml"), "--out",
                                      str(tmp_path / "none"), "--resume"])
    assert result.exit_code == 2 and "holds no run" in result.output


@pytest.mark.slow
def test_cli_small_npz_run_and_report(tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 12)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    np.savez(tmp_path / "toy.npz", x_train=x, y_train=y, x_test=x[:50], y_test=y[:50])
    cfg = tmp_path / "toy.toml"
    cfg.write_text(f"""
[experiment]
rounds = 2
[data]
name = "npz"
path = "{tmp_path / 'toy.npz'}"
[federation]
clients = 3
partition = "iid"
[model]
name = "mlp"
hidden = [8]
[train]
local_steps = 5
[dturbo.sparsity]
warmup_rounds = 0
ramp_rounds = 2
target_density = 0.5
""")
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", str(cfg), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "figures" / "curves.png").exists() and (out / "figures" / "support_masks.png").exists()
    again = CliRunner().invoke(app, ["run", str(cfg), "--out", str(out)])
    assert again.exit_code == 2 and "--resume" in again.output
    rep = CliRunner().invoke(app, ["report", str(out), "--out", str(tmp_path / "figs")])
    assert rep.exit_code == 0 and (tmp_path / "figs" / "run" / "curves.svg").exists()
    # a FedAvg run's final model is dense: export says it removed nothing and how to train for speed
    dense = tmp_path / "dense"
    fa = CliRunner().invoke(app, ["run", str(cfg), "--out", str(dense), "--no-figures",
                                  "--set", "experiment.algorithm=fedavg", "--set", "experiment.rounds=1"])
    assert fa.exit_code == 0, fa.output
    ex = CliRunner().invoke(app, ["export", str(dense), "--out", str(tmp_path / "model")], terminal_width=200)
    assert ex.exit_code == 0 and "export removed nothing" in ex.output and "--preset speed" in ex.output
