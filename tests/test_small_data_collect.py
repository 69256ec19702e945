"""benchmarks/small_data.py builds its report from the runs on disk and keeps the committed rows of runs that are
not on this disk (a fresh clone, or a machine that ran only some stages): a report never drops a result."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from run_helpers import load_benchmark


@pytest.fixture(scope="module")
def sd() -> ModuleType:
    return load_benchmark("small_data")


def _run_on_disk(runs: Path, dataset: str, name: str, accuracy: float) -> None:
    out = runs / dataset / name
    out.mkdir(parents=True)
    (out / "metrics.csv").write_text(f"round,accuracy,val_accuracy,density,cum_bits\n1,0.1,0.1,1.0,10\n"
                                     f"2,{accuracy},0.5,0.25,20\n")
    (out / "model.safetensors").write_bytes(b"")  # only its presence marks a finished run
    (runs / dataset / "unfinished_s0").mkdir()  # no model: not a result


def test_collect_keeps_committed_rows_and_prefers_the_disk(sd: ModuleType, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    runs, results = tmp_path / "runs", tmp_path / "results" / "small_data"
    results.parent.mkdir()
    committed = [{"dataset": "digits", "label": "paced", "seed": 0, "accuracy": 0.9, "val_accuracy": 0.9,
                  "density": 0.25, "cum_bits": 1.0},
                 {"dataset": "digits", "label": "fedavg", "seed": 1, "accuracy": 0.3, "val_accuracy": 0.3,
                  "density": 1.0, "cum_bits": 1.0}]
    results.with_suffix(".json").write_text(json.dumps(committed))
    _run_on_disk(runs, "digits", "fedavg_s1", 0.8)  # run again here: the disk's row replaces the committed one
    monkeypatch.setattr(sd, "RUNS", runs)
    monkeypatch.setattr(sd, "RESULTS", results)
    rows = {(r["dataset"], r["label"], r["seed"]): r for r in sd.collect()}
    assert set(rows) == {("digits", "paced", 0), ("digits", "fedavg", 1)}
    assert rows[("digits", "paced", 0)]["accuracy"] == 0.9
    assert rows[("digits", "fedavg", 1)]["accuracy"] == pytest.approx(0.8)
    assert rows[("digits", "fedavg", 1)]["density"] == pytest.approx(0.25)


def test_collect_without_committed_results(sd: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = tmp_path / "runs"
    _run_on_disk(runs, "fmnist-3k", "paced_s2", 0.5)
    monkeypatch.setattr(sd, "RUNS", runs)
    monkeypatch.setattr(sd, "RESULTS", tmp_path / "none" / "small_data")
    assert [(r["label"], r["seed"]) for r in sd.collect()] == [("paced", 2)]
