"""Long fuzz run of every decoder and of the servers' upload validation (the recorded figure).

    python benchmarks/fuzz_decoders.py [--cases 20000] [--uplink-cases 3000]

Part 1 (hypothesis, derandomised): mutated valid payloads (random bytes, bit flips, insertions/deletions,
truncations, valid first byte + junk) through every codec decoder, with and without bounds. Passes when the only
exception is CodecError and no output exceeds its bound.
Part 2: real uploads of every algorithm (a tiny MLP), mutated the same way, through ``server.aggregate`` next to
one valid upload. Passes when every mutated upload is either rejected with a reason or decodes to finite values,
the round aggregates, and the new state is finite.
Peak memory (max RSS) is recorded. Results: benchmarks/results/fuzz.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from dturbo import codec  # noqa: E402
from dturbo.algorithms.registry import build_algorithm  # noqa: E402
from dturbo.coding.values import decode_symbols, encode_symbols  # noqa: E402
from dturbo.federation import build_federation  # noqa: E402
from dturbo.settings import parse_config  # noqa: E402
from dturbo.testing import mutate  # noqa: E402

LIMIT = 5000


def valid_payloads() -> list[bytes]:
    rng = np.random.default_rng(7)
    clustered = np.zeros((12, 15))
    clustered[2:7, 3:9] = rng.normal(size=(5, 6))
    clustered[rng.random((12, 15)) < 0.1] = 1.0
    return [
        codec.encode_grid(clustered),
        codec.encode_grid(np.kron(np.eye(3), np.ones((4, 4)))),
        codec.encode_values(np.arange(5.0)),
        codec.encode_dense(np.ones((2, 3))),
        codec.encode_sparse(np.eye(6)),
        codec.encode_sparse(np.where(rng.random(300) < 0.05, 1.0, 0.0)),
        codec.encode_quantized(np.arange(40) % 7, 7, [1.5]),
        encode_symbols(np.clip(np.round(rng.normal(8, 2, 300)), 0, 15).astype(int), 16, [0.5]),
        codec.encode_message("k", [("f", b"\x01\x02"), ("g", codec.encode_values(np.ones(3)))]),
    ]


def fuzz_decoders(cases: int) -> dict:
    payloads = valid_payloads()
    decoders = [codec.decode_grid, codec.decode_values, codec.decode_dense, codec.decode_sparse,
                codec.decode_quantized, decode_symbols, codec.decode_message]
    outcomes: Counter[str] = Counter()
    failures: list[str] = []

    @settings(max_examples=cases, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(which=st.integers(0, len(payloads) - 1), data=st.data())
    def one(which: int, data: st.DataObject) -> None:
        blob = mutate(payloads[which], data)
        for decode in decoders:
            for kw in ({}, {"max_elements": LIMIT}) if decode is not codec.decode_message else ({}, {"max_bytes": 64}):
                try:
                    out = decode(blob, **kw)
                except codec.CodecError:
                    outcomes["CodecError"] += 1
                    continue
                except Exception as err:  # noqa: BLE001 - what the fuzzing is looking for
                    failures.append(f"{decode.__name__}: {type(err).__name__}: {err}")
                    continue
                outcomes["decoded"] += 1
                arr = out[0] if isinstance(out, tuple) else out
                if isinstance(arr, np.ndarray) and arr.size > kw.get("max_elements", codec.DEFAULT_MAX_ELEMENTS):
                    failures.append(f"{decode.__name__}: output of {arr.size} elements beyond its bound")

    t0 = time.perf_counter()
    one()
    return {"cases": cases, "decoder_calls": sum(outcomes.values()), "outcomes": dict(outcomes),
            "unexpected": failures[:20], "n_unexpected": len(failures), "seconds": round(time.perf_counter() - t0, 1)}


def _fuzz_server(server, state: dict, good: bytes, cases: int) -> tuple[Counter[str], list[str]]:  # noqa: ANN001
    outcomes: Counter[str] = Counter()
    failures: list[str] = []

    @settings(max_examples=cases, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def one(data: st.DataObject) -> None:
        blob = mutate(good, data)
        try:
            result = server.aggregate(state, [good, blob], 0)
        except Exception as err:  # noqa: BLE001 - what the fuzzing is looking for
            failures.append(f"{type(err).__name__}: {err}")
            return
        outcomes["rejected" if result.metrics["clients_rejected"] else "accepted"] += 1
        if not all(np.all(np.isfinite(v)) for v in result.state.values() if np.asarray(v).dtype.kind == "f"):
            failures.append("non-finite state")

    one()
    return outcomes, failures


def fuzz_uplinks(cases: int) -> dict:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 12)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    path = ROOT / "runs" / "fuzz_toy.npz"
    path.parent.mkdir(exist_ok=True)
    np.savez(path, x_train=x, y_train=y, x_test=x[:50], y_test=y[:50])
    report = {}
    for algorithm in ("dturbo", "fedavg", "fedpaq", "dssm"):
        cfg = parse_config({"experiment": {"algorithm": algorithm, "threads": 1}, "data": {"name": "npz",
                            "path": str(path)}, "federation": {"clients": 2}, "model": {"name": "mlp",
                            "hidden": [8]}, "train": {"local_steps": 2}, "fedpaq": {"levels": 3}})
        fed = build_federation(cfg)
        server, client = build_algorithm(cfg, fed)
        state = server.init()
        good = client.fit(server.downlink(state, 0), fed.clients[0], 0)
        t0 = time.perf_counter()
        outcomes, failures = _fuzz_server(server, state, good, cases)
        report[algorithm] = {"cases": cases, **dict(outcomes), "n_unexpected": len(failures),
                             "unexpected": failures[:10], "seconds": round(time.perf_counter() - t0, 1)}
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=20000)
    ap.add_argument("--uplink-cases", type=int, default=3000)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "fuzz.json")
    args = ap.parse_args()
    result = {"decoders": fuzz_decoders(args.cases), "uplinks": fuzz_uplinks(args.uplink_cases)}
    result["max_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    result["passed"] = result["decoders"]["n_unexpected"] == 0 and all(
        v["n_unexpected"] == 0 for v in result["uplinks"].values())
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
