"""The README's main job, measured: configs/fmnist_quick.toml on real Fashion-MNIST.

Usage: python benchmarks/fmnist_quick.py [--out runs/fmnist_quick] [--rerun]
Runs the config into --out (or reuses a finished run there unless --rerun), then writes
benchmarks/results/fmnist_quick.json and copies the run's figures to benchmarks/results/fmnist_quick/.
Targets (issue 2): accuracy >= 80% with <= 35% nonzero weights; clusters in the dense2 message heat map.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path

from dturbo.config import load_config
from dturbo.report import draw_run, read_metrics
from dturbo.sim import Simulator

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "fmnist_quick.toml")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "fmnist_quick")
    ap.add_argument("--rerun", action="store_true")
    args = ap.parse_args()
    cfg = load_config(args.config)
    if args.rerun and args.out.exists():
        shutil.rmtree(args.out)
    if not (args.out / "model.safetensors").exists():
        resume = (args.out / "checkpoint" / "state.safetensors").exists()
        Simulator(cfg, args.out, resume=resume,
                  on_round=lambda r: print(f"round {r['round']}: acc {float(r['accuracy']):.4f} "
                                           f"density {float(r['density']):.3f} ({r['seconds']} s)", flush=True)).run()
        draw_run(args.out)
    m = read_metrics(args.out)
    layers = {k[len("density_"):]: round(float(v[-1]), 4) for k, v in m.items() if k.startswith("density_")}
    result = {
        "what": "configs/fmnist_quick.toml: D-Turbo-VBI, alexnet-small, real Fashion-MNIST, 10 clients, Dirichlet 0.5",
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0]},
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "rounds": int(m["round"][-1]),
        "final_accuracy": float(m["accuracy"][-1]),
        "final_density": float(m["density"][-1]),
        "density_by_layer": layers,
        "accuracy_by_round": [round(float(a), 4) for a in m["accuracy"]],
        "density_by_round": [round(float(d), 4) for d in m["density"]],
        "up_bits_total": float(m["up_bits"].sum()),
        "down_bits_total": float(m["down_bits"].sum()),
        "cum_bits": float(m["cum_bits"][-1]),
        "up_bits_round1_vs_last": [float(m["up_bits"][0]), float(m["up_bits"][-1])],
        "down_bits_round1_vs_last": [float(m["down_bits"][0]), float(m["down_bits"][-1])],
        "train_seconds_total": float(m["seconds"].sum()),
        "targets": {"accuracy>=0.80": bool(m["accuracy"][-1] >= 0.80), "density<=0.35": bool(m["density"][-1] <= 0.35)},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fmnist_quick.json").write_text(json.dumps(result, indent=2) + "\n")
    figs = RESULTS / "fmnist_quick"
    figs.mkdir(exist_ok=True)
    for png in (args.out / "figures").glob("*.png"):
        shutil.copy(png, figs / png.name)
    print(json.dumps({k: result[k] for k in ("final_accuracy", "final_density", "cum_bits", "train_seconds_total",
                                             "targets")}, indent=2))


if __name__ == "__main__":
    main()
