"""Presets shipped in the package (dturbo.presets) and the command line around them: listing, running, showing,
loading in Python; the wheel installed alone, outside the repository."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dturbo import presets
from dturbo.cli import app
from dturbo.config import ConfigError
from dturbo.settings import load_config

ROOT = Path(__file__).resolve().parents[1]
FMNIST = Path("/usr/share/datasets/fashion-mnist")


def test_every_preset_is_a_valid_config_with_a_description():
    names = presets.names()
    assert {"quick", "recommended", "speed", "paper", "fedavg", "fedavg32", "fedpaq", "dssm", "stc", "fedpm",
            "feddst"} <= set(names)
    assert names[:4] == ["quick", "recommended", "speed", "paper"]
    for name in names:
        cfg = load_config(preset=name)
        assert presets.describe(name).endswith(".")  # the whole first comment, not its first line
        assert cfg.experiment.name == name or name == "quick"
    assert load_config(preset="fedpm").experiment.algorithm == "fedpm"


def test_the_quick_preset_is_the_main_jobs_config_file():
    assert load_config(preset="quick") == load_config(ROOT / "configs" / "fmnist_quick.toml")


def test_presets_name_no_layer_of_a_particular_model():
    """Layer targets select by position or kind (first, last, conv, dense), so a preset fits any model."""
    from dturbo.algorithms.dturbo.sparsity import SELECTORS

    for name in presets.names():
        targets = load_config(preset=name).dturbo.sparsity.layer_targets
        assert set(targets) <= set(SELECTORS), (name, targets)


def test_paper_preset_sends_float16_and_the_defaults_do_not():
    paper, default = load_config(preset="paper").dturbo.transmission, load_config({}).dturbo.transmission
    assert (paper.up_bits, paper.down_bits, paper.positions, paper.prior_std) == (16, 16, "full", "sent")
    assert (default.up_bits, default.down_bits, default.positions, default.values_code, default.prior_std) == (
        4, 8, "delta", "range", "rebuilt")


def test_load_config_takes_a_preset_with_overrides_and_names_an_unknown_one():
    cfg = load_config(preset="recommended", overrides={"experiment.rounds": 3})
    assert cfg.experiment.rounds == 3 and cfg.dturbo.sparsity.target_density == 0.17
    with pytest.raises(ConfigError, match="unknown preset 'recomended' \\(did you mean 'recommended'\\?\\)"):
        load_config(preset="recomended")
    with pytest.raises(ConfigError, match="one of the two"):
        load_config(ROOT / "configs" / "fmnist_quick.toml", preset="quick")


def test_an_unknown_key_suggests_the_nearest_one():
    with pytest.raises(ConfigError, match="'dturbo.sparsity.target': unknown key \\(did you mean "
                                          "'dturbo.sparsity.target_density'\\?\\)"):
        load_config({}, ["dturbo.sparsity.target=0.1"])
    with pytest.raises(ConfigError, match="'experimnt': unknown key \\(did you mean 'experiment'\\?\\)"):
        load_config({"experimnt": {"rounds": 2}})


def test_cli_version_presets_and_config_show():
    runner = CliRunner()
    from dturbo import __version__

    assert runner.invoke(app, ["--version"]).output.strip() == f"dturbo {__version__}"
    listed = runner.invoke(app, ["presets"]).output.splitlines()
    assert [line.split()[0] for line in listed] == presets.names()
    shown = runner.invoke(app, ["config", "show", "--preset", "recommended", "--set", "experiment.rounds=5"])
    assert shown.exit_code == 0
    cfg = load_config(tomllib.loads(shown.output))
    assert cfg == load_config(preset="recommended", overrides=["experiment.rounds=5"])
    bad = runner.invoke(app, ["run", "--preset", "nope", "--out", "x"])
    assert bad.exit_code == 2 and "unknown preset 'nope'" in bad.output


def test_run_help_shows_what_each_argument_is():
    out = CliRunner().invoke(app, ["run", "--help"], terminal_width=120).output
    assert "experiment config (TOML)" in out and "--preset" in out
    assert "run directories" in CliRunner().invoke(app, ["report", "--help"], terminal_width=120).output


@pytest.mark.slow
@pytest.mark.skipif(not (FMNIST / "train-images-idx3-ubyte.gz").exists(), reason="Fashion-MNIST not installed")
def test_the_wheel_works_alone_outside_the_repository(tmp_path):
    """Build the wheel, install it (no dependencies) into a fresh virtual environment outside the repository whose
    dependencies come from this one's, and run the installed command there: --version, presets, one round of the
    quick preset on Fashion-MNIST. Nothing may come from the repository's files."""
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(ROOT)], check=True, cwd=tmp_path, capture_output=True)
    wheel = next(dist.glob("dturbo-*.whl"))
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # The dependencies (torch, numpy, ...) from this environment; a .pth path line is not itself scanned for .pth
    # files, so this environment's editable install of the repository is not seen there.
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site),
                    str(wheel)], check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run_dir = tmp_path / "work"
    run_dir.mkdir()

    def dturbo(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(py), "-m", "dturbo", *args], cwd=run_dir, env=env, capture_output=True,
                              text=True, timeout=600)

    where = subprocess.run([str(py), "-c", "import dturbo; print(dturbo.__file__)"], cwd=run_dir, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(str(site)) and not where.startswith(str(ROOT))
    assert dturbo("--version").stdout.startswith("dturbo ")
    assert "recommended" in dturbo("presets").stdout
    done = dturbo("run", "--preset", "quick", "--out", "run", "--no-figures", "--set", "experiment.rounds=1",
                  "--set", "data.limit_train=2000", "--set", "data.limit_test=500", "--set", "experiment.threads=1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (run_dir / "run" / "metrics.csv").read_text().count("\n") == 2


def test_every_preset_fits_a_conv_model_with_batchnorm():
    """On a model of convolutions with BatchNorm and one dense head, every preset's layer targets resolve; where they
    name every layer the model's density is theirs, and a warning says target_density is not used. The stem reads
    one input channel: it keeps dense unless named by position. `recommended` ties no row under BatchNorm: its
    targets name the last layer only, and the conv between takes what is left of 17%."""
    import warnings

    import numpy as np
    from torch import nn

    import dturbo
    from dturbo.algorithms.dturbo import layer_infos
    from dturbo.algorithms.dturbo.sparsity import budget_sizes, layer_targets

    net = dturbo.bayesianize(nn.Sequential(
        nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)))
    for name in presets.names():
        cfg = load_config(preset=name)
        infos = layer_infos(net, cfg)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            targets = layer_targets(infos, cfg.dturbo.sparsity)
        assert targets[0] == 1.0, name  # the stem: no preset names it by name or position
        sizes = budget_sizes(infos, cfg.dturbo.sparsity)
        overall = float(np.nansum(targets * sizes) / sizes.sum())
        named = not np.isnan(targets).any() and abs(overall - cfg.dturbo.sparsity.target_density) > 0.005
        assert named == any("target_density" in str(w.message) for w in caught), name
    cfg = load_config(preset="recommended")
    infos = layer_infos(net, cfg)
    targets = layer_targets(infos, cfg.dturbo.sparsity)
    assert not any(i.prior.tie_rows for i in infos)
    sizes = budget_sizes(infos, cfg.dturbo.sparsity)
    assert targets[2] == 1.0 and targets[1] * sizes[1] == pytest.approx(0.17 * sizes.sum() - sizes[0] - sizes[2])
    # a dense head of most of the weights: the targets by group leave the rest no room, which the run says first
    wide = dturbo.bayesianize(nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3),
                                            nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 10)), input_shape=(2, 12, 12))
    infos = layer_infos(wide, cfg)
    with pytest.warns(UserWarning, match=r"no room in target_density = 0.17: they keep 2% and the model ends at 9"):
        targets = layer_targets(infos, cfg.dturbo.sparsity)
    assert [i.prior.tie_rows for i in infos] == [False, True, False] and list(targets)[1:] == [0.25, 1.0]
    cfg = load_config(preset="recommended", overrides={"dturbo.sparsity.layer_targets": {"first": 0.5, "last": 1.0}})
    assert layer_targets(layer_infos(net, cfg), cfg.dturbo.sparsity)[0] == 0.5
