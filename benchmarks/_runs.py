"""Shared by the benchmark scripts: train a run directory, reusing a finished run and resuming a cut one."""

from __future__ import annotations

from pathlib import Path

from dturbo.config import Config
from dturbo.sim import Simulator


def run_or_reuse(cfg: Config, out: Path, label: str) -> Path:
    """Train ``cfg`` into ``out`` unless ``out`` holds a finished run (its model); continue a checkpoint."""
    if not (out / "model.safetensors").exists():
        resume = (out / "checkpoint" / "state.safetensors").exists()
        Simulator(cfg, out, resume=resume, on_round=lambda r: print(
            f"  [{label}] round {r['round']}: acc {float(r['accuracy']):.4f} density {float(r['density']):.3f}",
            flush=True)).run()
    return out
