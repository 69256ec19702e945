"""benchmarks/downlink.py's summary and rule on hand-made rows: the means, bits to T after round 1's downlink, and
the choice on validation accuracy and total bits."""

from __future__ import annotations

import pytest
from run_helpers import load_benchmark


def rows(bits: int, val: list[float], total: float, to_t: list[float | None]) -> list[dict]:
    return [{"down_bits": bits, "seed": k, "accuracy": v - 0.01, "val_accuracy": v, "bits_to_t": b,
             "bits_to_t_val": None, "initial_bits": 2e6, "total_bits": total, "steady_down_mbit": 0.05 * bits,
             "largest_drop": 0.01 * k} for k, (v, b) in enumerate(zip(val, to_t, strict=True))]


def test_the_summary_and_the_rule_by_hand():
    d = load_benchmark("downlink")
    three = rows(3, [0.890, 0.886, 0.884], 33e6, [28e6, 30e6, 32e6])
    two = rows(2, [0.889, 0.884, 0.883], 26e6, [24e6, 25e6, None])  # 0.13 points below: within 0.2
    one = rows(1, [0.880, 0.878, 0.879], 22e6, [27e6, 28e6, 29e6])  # 0.77 points below
    summary = d.summarize(three + two + one, 3)
    assert list(summary) == [3, 2, 1]
    assert summary[3]["bits_to_t_after_initial"] == pytest.approx(28e6)  # (26 + 28 + 30) / 3
    assert summary[2]["bits_to_t"] is None and summary[2]["seeds_reaching_t"] == 2
    assert summary[2]["val_accuracy"] == pytest.approx((0.889 + 0.884 + 0.883) / 3)
    assert summary[1]["largest_drop"] == pytest.approx(0.02)
    assert d.recommend(summary, 3) == 2  # the fewest total bits within 0.2 validation points; test never read
    assert d.recommend({b: v for b, v in summary.items() if b != 2}, 3) == 3
