"""benchmarks/rec_bits.py's bound on a synthetic curve, against values computed by hand: bits to T had each upload
of the steady state cost the steady round's KL / upload of its bits."""

from __future__ import annotations

import numpy as np
import pytest
from run_helpers import load_benchmark


def test_bits_to_t_at_kl_by_hand():
    rec = load_benchmark("rec_bits")
    up = np.array([4.0, 3.0, 2.0, 2.0, 2.0])
    down = np.array([6.0, 5.0, 1.0, 1.0, 1.0])
    m = {"round": np.arange(1, 6), "up_bits": up, "cum_bits": np.cumsum(up + down),
         "accuracy": np.array([0.1, 0.5, 0.7, 0.8, 0.85])}
    # T reached in round 4 (cum 10 + 8 + 3 + 3 = 24); rounds 3 and 4 are steady: 4 upload bits, at 0.25 cost 1
    sent, at_kl = rec.bits_to_t_at_kl(m, 0.8, 0.25, 3)
    assert sent == pytest.approx(24.0)
    assert at_kl == pytest.approx(24.0 - 0.75 * 4.0)
    assert rec.bits_to_t_at_kl(m, 0.9, 0.25, 3) == (None, None)
    # a steady state that starts after T saves nothing
    assert rec.bits_to_t_at_kl(m, 0.8, 0.25, 5)[1] == pytest.approx(24.0)
