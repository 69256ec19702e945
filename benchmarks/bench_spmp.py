"""SPMP (Module B) speed: every grid of the downsized AlexNet in one round, and one 40 x 84 grid against
``sumproduct`` 0.0.7, the package the paper authors' demo used (``pip install sumproduct==0.0.7``).

Usage: python benchmarks/bench_spmp.py [--repeats 20] [--skip-sumproduct]
Writes benchmarks/results/spmp.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from scipy.special import expit

from dturbo.config import DturboConfig
from dturbo.nn import build_model
from dturbo.nn.bayes import bayesian_layers
from dturbo.prior import grid_shape, layer_kind
from dturbo.spmp import grid_bp

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def model_grids(input_shape: tuple[int, ...]) -> list[tuple[str, tuple[int, int], dict]]:
    cfg = DturboConfig()
    out = []
    for name, layer in bayesian_layers(build_model("alexnet-small", input_shape, 10)):
        p = getattr(cfg.prior, layer_kind(layer))
        mrf = dict(p01_row=p.p01_row, p11_row=p.p11_row, p01_col=p.p01_col, p11_col=p.p11_col)
        out.append((name, grid_shape(layer), mrf))
    return out


def time_all_grids(input_shape, repeats: int, rng) -> dict:
    cfg = DturboConfig()
    grids = model_grids(input_shape)
    unaries = [rng.normal(scale=2.0, size=shape) for _, shape, _ in grids]
    kw = dict(max_iter=cfg.spmp.max_iter, tol=cfg.spmp.tol, damping=cfg.spmp.damping)
    times, iters = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = [grid_bp(u, **mrf, **kw) for u, (_, _, mrf) in zip(unaries, grids, strict=True)]
        times.append(time.perf_counter() - t0)
        iters = [r.iterations for r in res]
    return {
        "input_shape": list(input_shape),
        "grids": {name: list(shape) for name, shape, _ in grids},
        "nodes": int(sum(np.prod(s) for _, s, _ in grids)),
        "iterations": dict(zip([g[0] for g in grids], iters, strict=True)),
        "median_seconds": statistics.median(times),
        "settings": kw,
    }


def sumproduct_grid(unary: np.ndarray, p01: float, p11: float, max_iter: int, tol: float) -> tuple[np.ndarray, float]:
    from sumproduct import Factor, FactorGraph, Variable

    k, m = unary.shape
    fac = np.array([[1 - p01, p01], [1 - p11, p11]])
    g = FactorGraph(silent=True)
    names = [[f"x{i}_{j}" for j in range(m)] for i in range(k)]
    for i in range(k):
        for j in range(m):
            f = Factor(f"u{i}_{j}", np.array([1.0, float(np.exp(unary[i, j]))]))
            g.add(f)
            g.append(f"u{i}_{j}", Variable(names[i][j], 2))
    for i in range(k):
        for j in range(m):
            for di, dj, tag in ((0, 1, "h"), (1, 0, "v")):
                if i + di < k and j + dj < m:
                    fname = f"{tag}{i}_{j}"
                    g.add(Factor(fname, fac.copy()))
                    g.append(fname, g.nodes[names[i][j]])  # previous state first: potential is (prev, next)
                    g.append(fname, g.nodes[names[i + di][j + dj]])
    t0 = time.perf_counter()
    g.compute_marginals(max_iter=max_iter, tolerance=tol)
    seconds = time.perf_counter() - t0
    p = np.array([[g.nodes[names[i][j]].marginal()[1] for j in range(m)] for i in range(k)])
    return p, seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--skip-sumproduct", action="store_true")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    result: dict = {
        "what": "SPMP (loopy sum-product on the support grids, SPEC 8)",
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "numpy": np.__version__,
                    "cpus": os.cpu_count()},
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "alexnet_small_28x28x1": time_all_grids((1, 28, 28), args.repeats, rng),
        "alexnet_small_32x32x3": time_all_grids((3, 32, 32), args.repeats, rng),
    }
    # One 40 x 84 grid with the demo's dense-layer transitions, against sumproduct 0.0.7.
    unary = rng.normal(scale=2.0, size=(40, 84))
    p01, p11, max_iter, tol = 0.3, 0.48, 50, 1e-6
    ours = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        res = grid_bp(unary, p01_row=p01, p11_row=p11, p01_col=p01, p11_col=p11, max_iter=max_iter, tol=tol)
        ours.append(time.perf_counter() - t0)
    cmp = {"grid": [40, 84], "p01": p01, "p11": p11, "ours_median_seconds": statistics.median(ours),
           "ours_iterations": res.iterations}
    if not args.skip_sumproduct:
        try:
            p_sp, sp_seconds = sumproduct_grid(unary, p01, p11, max_iter, tol)
            cmp.update({
                "sumproduct_version": "0.0.7", "sumproduct_seconds": sp_seconds,
                "speedup": sp_seconds / cmp["ours_median_seconds"],
                "max_abs_marginal_difference": float(np.abs(p_sp - expit(res.belief)).max()),
            })
        except ImportError:
            cmp["sumproduct_seconds"] = None
            print("sumproduct not installed: pip install sumproduct==0.0.7", file=sys.stderr)
    result["vs_sumproduct_40x84"] = cmp
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "spmp.json").write_text(json.dumps(result, indent=2) + "\n")
    for key in ("alexnet_small_28x28x1", "alexnet_small_32x32x3"):
        r = result[key]
        print(f"{key}: all {len(r['grids'])} grids ({r['nodes']} nodes) in {1e3 * r['median_seconds']:.1f} ms "
              f"(median of {args.repeats}); iterations {r['iterations']}")
    print(f"40x84 grid: ours {1e3 * cmp['ours_median_seconds']:.2f} ms", end="")
    if cmp.get("sumproduct_seconds"):
        print(f", sumproduct 0.0.7 {cmp['sumproduct_seconds']:.2f} s, ratio {cmp['speedup']:.0f}x, "
              f"max |marginal difference| {cmp['max_abs_marginal_difference']:.2e}")
    else:
        print()


if __name__ == "__main__":
    main()
