"""SIGKILL at a random moment of a real run, then --resume: metrics identical to an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from run_helpers import rows_of


def _config(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 16)).astype(np.float32)
    y = (x[:, :3].sum(1) > 0).astype(np.int64) + 2 * (x[:, 3] > 0)
    np.savez(tmp_path / "toy.npz", x_train=x, y_train=y, x_test=x[:100], y_test=y[:100])
    cfg = tmp_path / "toy.toml"
    cfg.write_text(f"""
[experiment]
rounds = 10
seed = 3
threads = 1
[data]
name = "npz"
path = "{tmp_path / 'toy.npz'}"
[federation]
clients = 4
alpha = 1.0
[model]
name = "mlp"
hidden = [32, 16]
[train]
local_steps = 40
lr = 0.01
[dturbo]
beta = 0.01
[dturbo.sparsity]
target_density = 0.3
warmup_rounds = 1
ramp_rounds = 5
""")
    return cfg


def _run(cfg: Path, out: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    return subprocess.Popen([sys.executable, "-m", "dturbo", "run", str(cfg), "--out", str(out), "--no-figures",
                             *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_sigkill_then_resume_gives_identical_metrics(tmp_path, seed):
    cfg = _config(tmp_path)
    ref = _run(cfg, tmp_path / "ref")
    assert ref.wait(timeout=300) == 0, ref.stderr.read().decode()
    reference = rows_of(tmp_path / "ref")
    assert len(reference) == 10

    out = tmp_path / "killed"
    proc = _run(cfg, out)
    # wait until at least one round is checkpointed, then kill at a random moment of a later round
    deadline = time.time() + 120
    while not (out / "checkpoint" / "state.safetensors").exists() and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(np.random.default_rng(seed).uniform(0.0, 1.5))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL or proc.returncode == 0
    resumed = _run(cfg, out, "--resume")
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read().decode()
    assert rows_of(out) == reference
    assert (out / "metrics.csv").read_text().count("\n") == 11
