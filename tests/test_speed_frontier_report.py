"""The speed frontier's report stage (benchmarks/speed_frontier.py --stage report) from a hand-made timing file:
summaries and goals derived again from the per-seed records, no training and no timing."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from run_helpers import load_benchmark


@pytest.fixture(scope="module")
def sf() -> ModuleType:
    load_benchmark("frontier")  # speed_frontier imports it
    return load_benchmark("speed_frontier")


def _point(label: str, accs: list[float], speedups: list[float]) -> dict:
    per_seed = [{"seed": i, "accuracy": a, "speedup": s, "speedup_sessions": [s - 0.1, s, s + 0.2]}
                for i, (a, s) in enumerate(zip(accs, speedups, strict=True))]
    keys = ("speedup_eager", "speedup_batch64", "speedup_batch1", "latency_batch1_ms", "latency_batch1_dense_ms",
            "speedup_1thread", "latency_batch1_1thread_ms")
    return {"label": label, "setting": label, "note": label, "accuracy": float(np.mean(accs)),
            "accuracy_std": 0.0, "seeds": len(accs), "density": 0.25, "speedup": float(np.mean(speedups)),
            "val_accuracy": 0.0, "per_seed": per_seed, **dict.fromkeys(keys, 1.0)}


def test_report_rederives_std_and_goals(sf: ModuleType, tmp_path: Path) -> None:
    res = {
        "dense_reference": {"label": "fedavg32", "setting": "fedavg32_lr2e-3", "accuracy": 0.88, "seeds": 3},
        # within 1.5 points at 2.2x: meets the first goal; 3.6x but 3 points below: meets neither
        "points": [_point("near", [0.870, 0.874], [2.1, 2.3]), _point("fast", [0.85, 0.85], [3.5, 3.7])],
        "goals": [], "timing": {"samples": 3000, "batches": [3000, 64, 1], "threads": [2, 1], "settings": ["eager"],
                                "rule": "r", "sessions": 3, "repeats": {}},
        "machine": {"platform": "p", "torch": "t"}, "date": "d",
    }
    path = tmp_path / "speed_frontier.json"
    path.write_text(json.dumps(res))
    out = sf.reread(path)
    near, fast = out["points"]
    assert near["accuracy_std"] == pytest.approx(np.std([0.870, 0.874], ddof=1))  # the frontier's convention
    assert [g["met"] for g in out["goals"]] == [True, False]
    assert out["goals"][0]["by"] == ["near"]
    assert out["goals"][1]["most_accurate_at_speed"]["label"] == "fast"
    md = sf.markdown(out)
    assert "**met** by near" in md and "fast, is 3.00 points below" in md
    assert "2.00-2.50x" in md  # the range over seeds x sessions


def test_report_without_timing_file(sf: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="run --stage time first"):
        sf.reread(tmp_path / "speed_frontier.json")


def test_points_timed_alone_replace_theirs_and_keep_the_others(sf: ModuleType) -> None:
    timing = {"samples": 3000, "threads": [2, 1], "sessions": 3, "repeats": {3000: 15}}
    # the old results as read back from speed_frontier.json (its keys text), the new as measure() returns them
    machine = {"allocator": "kept"}
    old = json.loads(json.dumps({"points": [_point("a", [0.8], [2.0]), _point("b", [0.8], [3.0])],
                                 "timing": timing, "date": "day 1", "machine": machine}))
    # measure() records the device; a file from before it did was timed on the CPU
    new = {"points": [_point("b", [0.9], [3.3]), _point("c", [0.7], [4.0])], "timing": {**timing, "device": "cpu"},
           "date": "day 2", "dense_reference": {"accuracy": 0.88}, "machine": machine}
    out = sf.merge(old, new)
    assert [p["label"] for p in out["points"]] == ["a", "b", "c"]
    assert [p["speedup"] for p in out["points"]] == [2.0, 3.3, 4.0]
    assert out["date"] == "day 1; b, c: day 2" and out["dense_reference"] == new["dense_reference"]
    with pytest.raises(SystemExit, match="timing settings differ"):
        sf.merge(old, {**new, "timing": {**new["timing"], "sessions": 1}})
    with pytest.raises(SystemExit, match="timing settings differ"):  # GPU times beside CPU ones: refused
        sf.merge(old, {**new, "timing": {**new["timing"], "device": "cuda"}})
    # a timing with glibc's default allocator is not comparable (the dense network's page faults): refused
    with pytest.raises(SystemExit, match="allocator"):
        sf.merge({k: v for k, v in old.items() if k != "machine"}, new)


def test_a_variant_s_own_points_are_timed_in_that_variant_only(sf: ModuleType, tmp_path: Path) -> None:
    fr = sys.modules["frontier"]
    base = fr.Settings(runs_root=tmp_path / "runs", results=tmp_path / "results", docs=tmp_path / "docs")
    variant = fr.Settings(runs_root=tmp_path / "runs_v", results=tmp_path / "results", docs=tmp_path / "docs",
                          horizon=30, local_epochs=2)
    own = {c.label for c in sf.VARIANT_ONLY}
    assert own and own <= set(sf.VARIANT_POINTS[variant.tag])
    assert not own & {label for label, _, _ in sf.points(base)}
    assert own <= {label for label, _, _ in sf.points(variant)}
    assert all(sf.BY_LABEL[label].line == "speed" for label in own)


def test_gpu_settings_and_words(sf: ModuleType) -> None:
    """CUDA graphs are a GPU setting only, torch.compile's only when asked; a GPU timing says so in its table."""
    import torch

    bi = sys.modules["bench_inference"]
    assert bi.settings_for(torch.device("cpu"), False) == ["eager", "channels_last"]
    assert bi.settings_for(torch.device("cpu"), True) == ["eager", "channels_last", "best"]
    assert bi.settings_for(torch.device("cuda"), False) == ["eager", "channels_last", "cuda_graph"]
    res = {"dense_reference": {"label": "fedavg32", "setting": "f", "accuracy": 0.88, "seeds": 3},
           "points": [_point("p", [0.87, 0.87], [1.4, 1.5])],
           "timing": {"device": "cuda", "samples": 3000, "batches": [3000, 64, 1], "threads": [2],
                      "settings": ["eager"], "rule": "r", "sessions": 3, "repeats": {}},
           "machine": {"platform": "p", "torch": "t", "cuda": "NVIDIA H200"}, "date": "d"}
    md = sf.markdown(sf.derive(res))
    assert "GPU: NVIDIA H200, CUDA events" in md and "threads)" not in md
    assert sf.timed_on({**res, "timing": {"threads": [2]}}) == "CPU, 2 threads"
