"""benchmarks/seeds.py's summary and goals on hand-made rows, against values computed by hand: the means and
standard deviations, the paired differences and their standard error, bits to T against STC's, each goal met or
missed."""

from __future__ import annotations

import pytest
from run_helpers import load_benchmark


def rows(setting: str, acc: list[float], to_t: list[float | None], total: float = 30e6) -> list[dict]:
    return [{"setting": setting, "seed": k, "accuracy": a, "val_accuracy": a + 0.01, "bits_to_t": b,
             "total_bits": total} for k, (a, b) in enumerate(zip(acc, to_t, strict=True))]


def hand_made() -> list[dict]:
    return (rows("dturbo", [0.880, 0.884, 0.878, 0.882], [26e6, 28e6, 27e6, 29e6])
            + rows("settled_biases_nearest", [0.886, 0.881, 0.877, 0.880], [22e6, None, 24e6, 23e6])
            + rows("stc", [0.886, 0.888, 0.884, 0.890], [40e6, 38e6, 39e6, 39e6])
            + rows("fedavg32", [0.892, 0.890, 0.886, 0.892], [300e6, 310e6, 320e6, 330e6]))


def test_the_summary_by_hand():
    s = load_benchmark("seeds")
    summary = s.summarize(hand_made())
    d = summary["dturbo"]
    assert d["seeds"] == [0, 1, 2, 3]
    assert d["accuracy"] == pytest.approx(0.881)
    # deviations -0.001, 0.003, -0.003, 0.001: sum of squares 2e-5 over 3
    assert d["accuracy_std"] == pytest.approx((2e-5 / 3) ** 0.5)
    assert d["val_accuracy"] == pytest.approx(0.891)
    assert d["bits_to_t"] == pytest.approx(27.5e6) and d["seeds_reaching_t"] == 4
    v = summary["settled_biases_nearest"]
    assert v["bits_to_t"] is None and v["seeds_reaching_t"] == 3
    assert v["bits_to_t_reached"] == pytest.approx(23e6)


def test_paired_differences_by_hand():
    s = load_benchmark("seeds")
    p = s.paired(hand_made(), "dturbo", "stc")
    assert p["seeds"] == [0, 1, 2, 3]
    assert p["differences"] == pytest.approx([-0.006, -0.004, -0.006, -0.008])
    assert p["mean"] == pytest.approx(-0.006)
    # deviations 0, 0.002, 0, -0.002: std sqrt(8e-6 / 3), over sqrt(4)
    assert p["standard_error"] == pytest.approx((8e-6 / 3) ** 0.5 / 2)
    # only the seeds both ran
    two = [r for r in hand_made() if not (r["setting"] == "stc" and r["seed"] >= 2)]
    assert s.paired(two, "dturbo", "stc")["seeds"] == [0, 1]


def test_the_goals_by_hand():
    s = load_benchmark("seeds")
    data = hand_made()
    g = s.goals(data, s.summarize(data))
    assert list(g) == ["dturbo", "settled_biases_nearest"]
    d = g["dturbo"]
    assert d["every_seed_reaches_t"]
    assert d["bits_to_t_ratio"] == pytest.approx(27.5 / 39)  # 0.705: above 0.7
    assert not d["bits_goal_met"]
    assert d["test_minus_stc"] == pytest.approx(0.881 - 0.887)  # 0.6 below: more than 0.3
    assert not d["stc_goal_met"]
    assert d["test_minus_fedavg32"] == pytest.approx(0.881 - 0.890)  # 0.9 below: within 1.0
    assert d["fedavg_goal_met"]
    v = g["settled_biases_nearest"]
    assert not v["every_seed_reaches_t"]
    # the ratio over the seeds that reach T, but the goal is missed while one does not
    assert v["bits_to_t_ratio"] == pytest.approx(23 / 39) and not v["bits_goal_met"]
    assert v["test_minus_stc"] == pytest.approx(0.881 - 0.887)


def test_the_markdown_names_each_goal():
    s = load_benchmark("seeds")
    data = [r | {"cpu": "", "label": r["setting"]} for r in hand_made()]
    summary = s.summarize(data)
    md = s.markdown({"t": 0.8793, "seeds": [0, 1, 2, 3], "summary": summary, "goals": s.goals(data, summary),
                     "runs": data})
    assert "| D-Turbo-VBI, the chosen setting | yes | 0.705x (missed) | -0.60 ± 0.08 (-0.60, -0.40, -0.60, -0.80) " \
           "(missed) | -0.90" in md
    assert "never on 1 (23.0 on the others)" in md
