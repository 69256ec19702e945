"""Accuracy vs density of D-Turbo-VBI (issue: density must be controllable and gradual; docs/algorithm.md §11).

Two sweeps on real Fashion-MNIST, each a list of runs of a base config with one key changed:

* ``target``: the knob ``dturbo.sparsity.target_density`` (the calibrated MRF field, docs/sparsity.md);
* ``prior``: the literal algorithm (``dturbo.sparsity.mode = "prior"``) with its only knob, the prior
  variance ratio ``r`` of the scale-matched prior (docs/algorithm.md §11's all-or-nothing transition).

Usage:
    python benchmarks/sparsity_sweep.py target [--values 0.1 0.2 0.35 0.5] [--config configs/fmnist_quick.toml]
    python benchmarks/sparsity_sweep.py prior  [--values 8 12 15 25 100] [--set data.limit_train=12000 ...]

Each run goes to runs/sweep_<kind>/<value>/ (skipped if it already finished, so the sweep can be resumed);
the final row of every run is written to benchmarks/results/sparsity_<kind>.json and .md, and a plot of
accuracy vs density to benchmarks/results/sparsity_<kind>.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from harness import RECORDED  # noqa: E402

from dturbo.report import read_metrics  # noqa: E402
from dturbo.settings import load_config  # noqa: E402
from dturbo.sim import Simulator  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DEFAULTS = {"target": [0.1, 0.2, 0.35, 0.5], "prior": [8.0, 12.0, 15.0, 25.0, 100.0]}



def run_one(kind: str, value: float, config: Path, extra: list[str]) -> dict:
    out = ROOT / "runs" / f"sweep_{kind}" / f"{value:g}"
    if kind == "target":
        overrides = [f"dturbo.sparsity.target_density={value}"]
    else:
        overrides = ["dturbo.sparsity.mode=\"prior\"", f"dturbo.prior.conv.r={value}", f"dturbo.prior.dense.r={value}"]
    cfg = load_config(config, [*RECORDED, "dturbo.beta=0.3", "train.lr=0.002", *overrides, *extra])
    done = out / "model.safetensors"
    if not done.exists():
        resume = (out / "checkpoint" / "state.safetensors").exists()
        Simulator(cfg, out, resume=resume,
                  on_round=lambda r: print(f"  [{kind}={value:g}] round {r['round']}: acc {float(r['accuracy']):.4f} "
                                           f"density {float(r['density']):.3f}", flush=True)).run()
    m = read_metrics(out)
    return {
        "knob": "target_density" if kind == "target" else "r",
        "value": value,
        "final_accuracy": float(m["accuracy"][-1]),
        "final_density": float(m["density"][-1]),
        "density_by_round": [round(float(d), 4) for d in m["density"]],
        "accuracy_by_round": [round(float(a), 4) for a in m["accuracy"]],
        "total_bits": float(m["cum_bits"][-1]),
        "rounds": int(m["round"][-1]),
        "round_seconds_total": round(float(m["seconds"].sum()), 1),  # from the run itself, not this call
        "run_dir": str(out.relative_to(ROOT)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["target", "prior"])
    ap.add_argument("--values", type=float, nargs="+")
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "fmnist_quick.toml")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="extra config override")
    args = ap.parse_args()
    values = args.values or DEFAULTS[args.kind]
    rows = [run_one(args.kind, v, args.config, args.extra) for v in values]
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {
        "what": f"D-Turbo-VBI accuracy vs density, sweep of {rows[0]['knob']}",
        "config": str(args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config),
        "overrides": args.extra,
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0]},
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "runs": rows,
    }
    (RESULTS / f"sparsity_{args.kind}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"| {rows[0]['knob']} | final density | final accuracy | density by round |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['value']:g} | {100 * r['final_density']:.1f}% | {100 * r['final_accuracy']:.2f}% | "
                     f"{' '.join(f'{100 * d:.0f}' for d in r['density_by_round'])} |")
    table = "\n".join(lines)
    (RESULTS / f"sparsity_{args.kind}.md").write_text(
        f"# {result['what']}\n\nconfig `{result['config']}`, overrides {args.extra or 'none'}, {result['date']}\n\n"
        + table + "\n")
    print(table)
    fig, ax = plt.subplots(figsize=(5, 3.6))
    ax.plot([100 * r["final_density"] for r in rows], [100 * r["final_accuracy"] for r in rows], "o-")
    for r in rows:
        ax.annotate(f"{r['value']:g}", (100 * r["final_density"], 100 * r["final_accuracy"]),
                    textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set(xlabel="nonzero weights at the end (%)", ylabel="test accuracy (%)",
           title=f"D-Turbo-VBI, Fashion-MNIST: accuracy vs density\n(labels: {rows[0]['knob']})")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / f"sparsity_{args.kind}.png", dpi=120)


if __name__ == "__main__":
    main()
