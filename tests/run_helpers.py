"""Helpers the tests share for reading and re-running run directories (imported by name: pytest puts tests/ on
the path)."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from dturbo.settings import parse_config
from dturbo.sim import Simulator

# Wall-time columns of metrics.csv: the only ones two equal runs may differ in.
TIMING = frozenset({"seconds", "server_seconds"})


def rows_of(out: Path) -> list[dict[str, str]]:
    """A run directory's metrics.csv rows, without the wall-time columns."""
    with open(out / "metrics.csv", newline="") as f:
        return [{k: v for k, v in r.items() if k not in TIMING} for r in csv.DictReader(f)]


def cut_and_resume(cfg: dict, whole: Path, part: Path, cut: int) -> None:
    """Run ``cfg`` uninterrupted into ``whole``; into ``part``, stop after round ``cut`` (as if killed there), then
    resume it to the end."""
    Simulator(parse_config(cfg), whole).run()
    sim = Simulator(parse_config(cfg), part)
    sim.cfg.experiment.rounds = cut
    sim.run()
    Simulator(parse_config(cfg), part, resume=True).run()


def flower_and_simulator(cfg: dict, tmp_path: Path) -> tuple[Path, Path]:
    """``cfg`` run by the Simulator into ``tmp_path / "sim"`` and by Flower in process into ``tmp_path / "flower"``
    (the caller skips without flwr); returns both run directories."""
    import tomli_w

    from dturbo.flower.inprocess import run_inprocess

    path = tmp_path / "config.toml"
    path.write_text(tomli_w.dumps(cfg))
    Simulator(parse_config(cfg), tmp_path / "sim").run()
    run_inprocess(path, tmp_path / "flower")
    return tmp_path / "sim", tmp_path / "flower"


def load_benchmark(name: str) -> ModuleType:
    """Import ``benchmarks/<name>.py`` (not a package) as module ``name``, registered in ``sys.modules``:
    dataclasses look their module up by name, and one benchmark may import another."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


# The paper's 16-bit protocol ([dturbo.transmission] of the `paper` preset), for tests about its messages.
PAPER_TRANSMISSION = {"up_bits": 16, "down_bits": 16, "prior_std": "sent", "positions": "full",
                      "values_code": "fixed"}
