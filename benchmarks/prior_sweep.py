"""How the MRF prior's row/column transition probabilities (docs/algorithm.md §2) shape removable structure.

    python benchmarks/prior_sweep.py [--rounds 10] [--limit-train 20000] [--settings default strong rows cols]

Each setting trains D-Turbo-VBI on real Fashion-MNIST (configs/fmnist_quick.toml, same target density), then
exports the final model (``dturbo.export``: all-zero rows / columns / channels removed across layers) and times
a forward pass of 3000 test images, masked dense vs exported, both eager with the same settings. Reported per
setting: accuracy, density, the fraction of weights removed physically by the export (whole rows, columns,
channels), and the speedup. Runs in runs/prior_sweep/<setting>/ (a finished run is reused). Results:
benchmarks/results/prior_sweep.{json,md}.

Settings (p01 = P(active | previous inactive), p11 = P(active | previous active) of the Markov chains along
a row and along a column; both layer kinds):
  default  the configs' values (conv 0.288 / 0.49, dense 0.3 / 0.48: weak coupling, as in the paper's demo)
  strong   p01 = 0.05, p11 = 0.9 along rows and columns (large clusters)
  rows     strong along rows only (a row is an output unit: whole rows on or off)
  cols     strong along columns only (a column is an input: whole inputs on or off)
  layer    default prior, target density per layer (scope = "layer") instead of global
  rows_layer  rows and scope = "layer" together
  conv_rows   convolutions only: very strong coupling along rows (p01 = 0.002, p11 = 0.995), and the
              convolutions' densities set per layer (sparsity.layer_targets: conv1 0.34, conv2-4 0.25; the dense
              layers share the rest of the 25% budget)
  conv_tied   convolutions only: tied rows (prior.conv.tie_rows: a conv channel is one support variable, kept or
              pruned whole), same per-layer targets
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from _runs import run_or_reuse  # noqa: E402
from harness import RECORDED  # noqa: E402

from dturbo.data import load_dataset  # noqa: E402
from dturbo.export import export_run, load, save  # noqa: E402
from dturbo.kernels import time_call  # noqa: E402
from dturbo.report import read_metrics  # noqa: E402
from dturbo.settings import load_config  # noqa: E402

STRONG = {"p01": 0.05, "p11": 0.9}
# The transition probabilities each setting sets for both layer kinds.
SETTINGS: dict[str, dict[str, float]] = {
    "default": {},
    "strong": {f"{p}_{d}": v for d in ("row", "col") for p, v in STRONG.items()},
    "rows": {f"{p}_row": v for p, v in STRONG.items()},
    "cols": {f"{p}_col": v for p, v in STRONG.items()},
    "layer": {},
    "rows_layer": {f"{p}_row": v for p, v in STRONG.items()},
    "conv_rows": {},
    "conv_tied": {},
}
CONV_TARGETS = "dturbo.sparsity.layer_targets={conv1=0.34,conv2=0.25,conv3=0.25,conv4=0.25}"
# Further overrides: the target density per layer instead of over the whole network, so that the first
# convolutions (most of the FLOPs, few of the weights) are thinned too; or the convolutions' prior only.
EXTRA: dict[str, list[str]] = {
    "layer": ["dturbo.sparsity.scope=layer"],
    "rows_layer": ["dturbo.sparsity.scope=layer"],
    "conv_rows": ["dturbo.prior.conv.p01_row=0.002", "dturbo.prior.conv.p11_row=0.995", CONV_TARGETS],
    "conv_tied": ["dturbo.prior.conv.tie_rows=true", CONV_TARGETS],
}



def overrides(setting: str) -> list[str]:
    prior = [f"dturbo.prior.{kind}.{k}={v}" for kind in ("conv", "dense") for k, v in SETTINGS[setting].items()]
    return prior + EXTRA.get(setting, [])


def train(setting: str, rounds: int, limit_train: int) -> Path:
    out = ROOT / "runs" / "prior_sweep" / setting
    cfg = load_config(ROOT / "configs" / "fmnist_quick.toml", [*RECORDED,
        f"experiment.rounds={rounds}", f"data.limit_train={limit_train}", "dturbo.sparsity.ramp_rounds=6",
        "train.lr=0.002",
        # KL / n grows as n shrinks: keep the per-sample weight of the full-data config (beta 0.3 at 60000)
        f"dturbo.beta={0.3 * limit_train / 60000:.6g}",
        *overrides(setting)])
    return run_or_reuse(cfg, out, setting)


@torch.no_grad()
def measure(run: Path, x: torch.Tensor) -> dict:
    m = read_metrics(run)
    exported = export_run(run, run / "exported")
    dense_dir = save(export_run(run, compaction=False), run / "exported_dense")
    # eager, PyTorch's own kernels for convolutions and pooling (the linear kernels of the exported net by timing)
    fast = load(run / "exported", batch_size=len(x), channels_last=False, compile=False, conv="default",
                pool="default")
    dense = load(dense_dir, batch_size=len(x), kernels="dense", channels_last=False, compile=False, conv="default",
                 pool="default")
    err = float((fast(x) - dense(x)).abs().max())
    dev = torch.device("cpu")
    t_dense = time_call(lambda: dense(x), dev, repeats=9, budget_s=5.0)
    t_fast = time_call(lambda: fast(x), dev, repeats=9, budget_s=5.0)
    spec = exported.spec()["totals"]
    per_layer = {r["name"]: f"{r['shape_before']} -> {r['shape_after']}" for r in exported.layers}
    return {
        "final_accuracy": float(m["accuracy"][-1]), "final_density": float(m["density"][-1]),
        "weights_before": spec["weights_before"], "weights_after": spec["weights_after"],
        "removed_fraction": 1 - spec["weights_after"] / spec["weights_before"],
        "density_after_removal": spec["density_after"], "max_abs_error": err,
        "dense_ms": 1000 * t_dense, "exported_ms": 1000 * t_fast, "speedup": t_dense / t_fast,
        "kernels": dict(fast.kernels), "shapes": per_layer,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--limit-train", type=int, default=20000)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--train-only", action="store_true", help="train the runs; time them later on a quiet machine")
    args = ap.parse_args()
    if args.train_only:
        for s in args.settings:
            train(s, args.rounds, args.limit_train)
        return
    torch.set_num_threads(2)
    ds = load_dataset("fashion-mnist", limit_train=args.limit_train, limit_test=3000, seed=0)
    x = torch.from_numpy(ds.x_test[:3000])
    rows = {}
    for s in args.settings:
        run = train(s, args.rounds, args.limit_train)
        rows[s] = {"overrides": overrides(s), **measure(run, x)}
        print(s, {k: v for k, v in rows[s].items() if k not in ("shapes", "kernels", "overrides")}, flush=True)
    res = ROOT / "benchmarks" / "results"
    (res / "prior_sweep.json").write_text(json.dumps({
        "what": "MRF transition probabilities vs removable structure, D-Turbo-VBI on Fashion-MNIST",
        "rounds": args.rounds, "limit_train": args.limit_train, "torch_threads": 2, "settings": rows}, indent=2) + "\n")
    md = ["| setting | accuracy (%) | nonzero (%) | weights removed by export (%) | nonzero among the rest (%) |"
          " dense ms | exported ms | speedup (eager) |", "|---|---|---|---|---|---|---|---|"]
    for s, r in rows.items():
        md.append(f"| {s} | {100 * r['final_accuracy']:.2f} | {100 * r['final_density']:.1f} | "
                  f"{100 * r['removed_fraction']:.1f} | {100 * r['density_after_removal']:.1f} | {r['dense_ms']:.1f} | "
                  f"{r['exported_ms']:.1f} | {r['speedup']:.2f}x |")
    md += ["", f"{args.rounds} rounds, {args.limit_train} training images, 3000 test images per forward pass, "
           "2 threads, median of up to 9 runs. Max abs difference exported vs masked dense: "
           f"{max(r['max_abs_error'] for r in rows.values()):.2e}."]
    (res / "prior_sweep.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
