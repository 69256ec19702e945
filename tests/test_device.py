"""experiment.device: where clients train and the global model is evaluated (the server's math stays on the CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from run_helpers import rows_of
from typer.testing import CliRunner

from dturbo import presets
from dturbo.algorithms.base import ClientData
from dturbo.algorithms.local import train_local
from dturbo.algorithms.registry import ALGORITHMS
from dturbo.cli import app
from dturbo.config import ConfigError, TrainConfig
from dturbo.device import resolve_device
from dturbo.nn.models import build_model
from dturbo.settings import parse_config
from dturbo.sim import Simulator

has_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU on this machine")


@pytest.fixture
def no_gpu(monkeypatch):
    """As on a machine without a GPU, also where there is one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_cpu_and_auto_without_gpu_resolve_to_cpu(no_gpu):
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")


def test_auto_picks_cuda_when_torch_sees_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")


def test_cuda_without_gpu_is_a_clear_error(no_gpu):
    with pytest.raises(ConfigError, match=r"experiment\.device = 'cuda' but .*(CPU-only|no usable GPU).*'auto'"):
        resolve_device("cuda")
    with pytest.raises(ConfigError, match="got 'tpu'"):
        resolve_device("tpu")


def test_cuda_without_gpu_fails_at_start_before_reading_data(no_gpu, tmp_path, tiny_config):
    # the data path does not exist: the device error must come first, before any work
    cfg = parse_config(tiny_config(data={"name": "npz", "path": str(tmp_path / "absent.npz")},
                                   experiment={"device": "cuda"}))
    with pytest.raises(ConfigError, match="experiment.device = 'cuda'"):
        Simulator(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_cli_names_the_device_problem(no_gpu, tmp_path, make_toy):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[data]\nname = "npz"\npath = "{make_toy(300)}"\n')
    result = CliRunner().invoke(app, ["run", str(cfg), "--out", str(tmp_path / "run"), "--set",
                                      "experiment.device=cuda"])
    assert result.exit_code == 2 and "experiment.device = 'cuda'" in result.output


def test_auto_on_cpu_is_bit_identical_and_resumes_a_cpu_run(no_gpu, tmp_path, tiny_config, make_toy):
    """The device is not part of the experiment: a CPU run continues under "auto" (the same checkpoint
    fingerprint), and the metrics equal the uninterrupted CPU run's."""
    data = {"name": "npz", "path": str(make_toy(300))}
    Simulator(parse_config(tiny_config(rounds=2, data=data)), tmp_path / "whole").run()
    Simulator(parse_config(tiny_config(rounds=1, data=data)), tmp_path / "split").run()
    Simulator(parse_config(tiny_config(rounds=2, data=data, experiment={"device": "auto"})), tmp_path / "split",
              resume=True).run()
    assert rows_of(tmp_path / "whole") == rows_of(tmp_path / "split")


def _train(device: torch.device) -> tuple[torch.nn.Module, float]:
    model = build_model("mlp", (12,), 4, hidden=[16], seed=0)
    gen = torch.Generator().manual_seed(0)
    for m in model.modules():
        if hasattr(m, "generator"):
            m.generator = gen
    x = torch.from_numpy(np.random.default_rng(0).normal(size=(64, 12)).astype(np.float32))
    data = ClientData(x, torch.arange(64) % 4)
    result = train_local(model, data, TrainConfig(local_steps=3, batch_size=16, lr=1e-3), gen, device=device)
    return model, result.nll


def test_train_local_leaves_the_model_on_the_cpu_for_encoding():
    model, nll = _train(torch.device("cpu"))
    assert np.isfinite(nll) and all(p.device.type == "cpu" for p in model.parameters())


@has_cuda
def test_train_local_on_cuda_matches_cpu_and_returns_to_cpu():
    cpu_model, cpu_nll = _train(torch.device("cpu"))
    gpu_model, gpu_nll = _train(torch.device("cuda"))
    assert all(p.device.type == "cpu" for p in gpu_model.parameters())
    assert gpu_nll == pytest.approx(cpu_nll, rel=1e-3)  # same minibatches and noise, drawn on the CPU
    for a, b in zip(cpu_model.parameters(), gpu_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@has_cuda
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_a_short_run_on_cuda(tmp_path, tiny_config, make_toy, algorithm):
    cfg = parse_config(tiny_config(rounds=1, data={"name": "npz", "path": str(make_toy(300))},
                                   experiment={"device": "cuda", "algorithm": algorithm}))
    rows = Simulator(cfg, tmp_path / "run").run()
    assert 0 <= float(rows[-1]["accuracy"]) <= 1


# the recommended preset with the biases on the weights' levels and the clipped update downlink rounded to the nearest
NEAREST_BIASES = {"down_quantizer": "settled_sign", "biases": "as_mu", "down_rounding": "nearest"}


@has_cuda
@pytest.mark.parametrize("preset, transmission", [("recommended", {}), ("speed", {}),
                                                  ("recommended", NEAREST_BIASES)],
                         ids=["recommended", "speed", "recommended_nearest_biases"])
def test_a_presets_dturbo_options_on_cuda_match_the_cpu(tmp_path, tiny_config, make_toy, preset, transmission):
    """A preset's [dturbo] options (the update downlink, cut units, its sparsity) train on the GPU to the CPU's
    support and accuracy: the same minibatches and noise, drawn on the CPU, and only rounding between them."""
    options = presets.read(preset)["dturbo"]
    options["sparsity"] = {**options["sparsity"], "warmup_rounds": 0, "ramp_rounds": 1, "layer_targets": {}}
    options["transmission"] = {**options.get("transmission", {}), **transmission}
    data = {"name": "npz", "path": str(make_toy(300))}
    rows = {device: Simulator(parse_config(tiny_config(rounds=2, data=data, dturbo=options,
                                                       experiment={"device": device})), tmp_path / device).run()
            for device in ("cpu", "cuda")}
    for gpu, cpu in zip(rows["cuda"], rows["cpu"], strict=True):
        assert float(gpu["density"]) == pytest.approx(float(cpu["density"]), abs=0.02)
    assert float(rows["cuda"][-1]["accuracy"]) == pytest.approx(float(rows["cpu"][-1]["accuracy"]), abs=0.02)


@has_cuda
def test_a_batchnorm_run_on_cuda_calibrates_and_trains_on(tmp_path, tiny_config, make_toy):
    """Calibration measures on the GPU and leaves the client's model on the CPU, where its next downlink loads
    (it stayed on the GPU, and the next round's load failed on mixed devices)."""
    import dturbo

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.bn, self.fc2 = torch.nn.Linear(12, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.fc2(torch.relu(self.bn(self.fc1(x))))

    cfg = tiny_config(rounds=3, data={"name": "npz", "path": str(make_toy(300))}, experiment={"device": "cuda"})
    result = dturbo.Experiment(cfg, model=Net, out=tmp_path / "run", progress=False, figures=False).run()
    assert len(result.metrics) == 3 and "calibration_bits" in result.metrics[-1]
