"""D-Turbo-VBI settings on the fmnist_compare setup: what closes the accuracy gap to FedAvg at 25% nonzero weights.

    python benchmarks/dturbo_variants.py [--variants beta0.3 beta0.1 ...]

Each variant is configs/fmnist_compare/dturbo.toml (20 rounds, 10 clients, Dirichlet 0.5, alexnet-small,
1 local epoch of Adam, target density 25%) with a few overrides; runs land in runs/dturbo_variants/<name>/ (a
finished run is reused, a cut one resumed). Results: benchmarks/results/dturbo_variants.{json,md}, with
FedAvg 32-bit's final accuracy from runs/fmnist_compare/fedavg when that run exists; the variants not run
this time keep their recorded rows. The recorded runs used one torch thread (OMP_NUM_THREADS=1), as
fmnist_compare does: the thread count changes the float sums.

The first ten variants chose the config's values (beta 0.003, sigma_init_ratio 0.02, 5 warm-up rounds); they
were run on the config as it was before (sigma_init_ratio 0.1, 1 warm-up round), which their overrides now
spell out. The ``ch_`` variants (issue 4) shape the support into whole conv channels for a faster exported
model: MRF row coupling on the convolutions, or tied conv rows, with the convolutions' own target densities.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402
from _runs import run_or_reuse  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from dturbo.config import load_config  # noqa: E402
from dturbo.export import export_run  # noqa: E402
from dturbo.report import read_metrics  # noqa: E402

CONFIG = ROOT / "configs" / "fmnist_compare" / "dturbo.toml"
# The config as the first ten variants were run on (later overrides win).
BEFORE = ["dturbo.sigma_init_ratio=0.1", "dturbo.sparsity.warmup_rounds=1", "dturbo.sparsity.ramp_rounds=10"]
CONV = "dturbo.sparsity.layer_targets={conv1=0.34,conv2=0.25,conv3=0.25,conv4=0.25}"
CONV375 = "dturbo.sparsity.layer_targets={conv1=0.34,conv2=0.375,conv3=0.375,conv4=0.375}"
VARIANTS: dict[str, list[str]] = {
    "beta0.3": [*BEFORE, "dturbo.beta=0.3"],
    "beta0.1": [*BEFORE, "dturbo.beta=0.1"],
    "beta0.03": [*BEFORE, "dturbo.beta=0.03"],
    "beta0.01": [*BEFORE, "dturbo.beta=0.01"],
    "b0.01_sig0.02": [*BEFORE, "dturbo.beta=0.01", "dturbo.sigma_init_ratio=0.02"],
    "b0.01_ramp6": [*BEFORE, "dturbo.beta=0.01", "dturbo.sparsity.ramp_rounds=6"],
    "b0.003_sig0.02": [*BEFORE, "dturbo.beta=0.003", "dturbo.sigma_init_ratio=0.02"],
    "b0.01_sig0.02_warm3_ramp12": [*BEFORE, "dturbo.beta=0.01", "dturbo.sigma_init_ratio=0.02",
                                   "dturbo.sparsity.warmup_rounds=3", "dturbo.sparsity.ramp_rounds=12"],
    "b0.003_sig0.02_warm3_ramp12": [*BEFORE, "dturbo.beta=0.003", "dturbo.sigma_init_ratio=0.02",
                                    "dturbo.sparsity.warmup_rounds=3", "dturbo.sparsity.ramp_rounds=12"],
    "b0.003_sig0.02_warm5_ramp10": [*BEFORE, "dturbo.beta=0.003", "dturbo.sigma_init_ratio=0.02",
                                    "dturbo.sparsity.warmup_rounds=5", "dturbo.sparsity.ramp_rounds=10"],
    # issue 4: whole conv channels (on the config as it is now)
    "ch_mrf_rows0.98": ["dturbo.prior.conv.p01_row=0.01", "dturbo.prior.conv.p11_row=0.98", CONV],
    "ch_mrf_rows0.995": ["dturbo.prior.conv.p01_row=0.002", "dturbo.prior.conv.p11_row=0.995", CONV],
    "ch_tied_25": ["dturbo.prior.conv.tie_rows=true", CONV],
    "ch_tied_375": ["dturbo.prior.conv.tie_rows=true", CONV375],
    "ch_tied_375_ramp8": ["dturbo.prior.conv.tie_rows=true", CONV375, "dturbo.sparsity.ramp_rounds=8"],
    "ch_tied_375_50": ["dturbo.prior.conv.tie_rows=true",
                       "dturbo.sparsity.layer_targets={conv1=0.34,conv2=0.375,conv3=0.5,conv4=0.5}"],
    # another seed (data split, initialisation, batches) for the config and for its whole-channel variant
    "seed1": ["experiment.seed=1"],
    "ch_tied_375_seed1": ["dturbo.prior.conv.tie_rows=true", CONV375, "experiment.seed=1"],
}


def row_kinds(mask: np.ndarray) -> list[int]:
    """How many output channels (rows of the grid) of a final mask are empty, partial and full."""
    rows = mask.reshape(mask.shape[0], -1) != 0
    empty, full = int((~rows.any(1)).sum()), int(rows.all(1).sum())
    return [empty, len(rows) - empty - full, full]


def train(name: str, runs: Path) -> Path:
    return run_or_reuse(load_config(CONFIG, VARIANTS[name]), runs / name, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "dturbo_variants")
    args = ap.parse_args()
    res = ROOT / "benchmarks" / "results"
    recorded = json.loads((res / "dturbo_variants.json").read_text()).get("variants", {}) \
        if (res / "dturbo_variants.json").exists() else {}
    rows = {k: v for k, v in recorded.items() if k in VARIANTS}
    for name in args.variants:
        run = train(name, args.runs)
        m = read_metrics(run)
        removed = export_run(run).spec()["totals"]
        masks = load_file(str(run / "model.safetensors"))
        rows[name] = {"overrides": VARIANTS[name], "final_accuracy": float(m["accuracy"][-1]),
                      "best_accuracy": float(m["accuracy"].max()), "final_density": float(m["density"][-1]),
                      "total_bits": float(m["cum_bits"][-1]),
                      "removed_by_export": 1 - removed["weights_after"] / removed["weights_before"],
                      "conv_rows_empty_partial_full": {k[: -len(".mask")]: row_kinds(v) for k, v in masks.items()
                                                       if k.startswith("conv") and k.endswith(".mask")}}
        print(name, rows[name], flush=True)
    rows = {k: {**rows[k], "overrides": VARIANTS[k]} for k in VARIANTS if k in rows}
    fedavg_dir = ROOT / "runs" / "fmnist_compare" / "fedavg"
    # only a finished run (its model is written last)
    fedavg = float(read_metrics(fedavg_dir)["accuracy"][-1]) if (fedavg_dir / "model.safetensors").exists() else None
    (res / "dturbo_variants.json").write_text(json.dumps(
        {"what": "D-Turbo-VBI variants on the fmnist_compare setup", "config": str(CONFIG.relative_to(ROOT)),
         "fedavg32_final_accuracy": fedavg, "variants": rows}, indent=2) + "\n")
    md = ["| variant | overrides | final accuracy (%) | gap to FedAvg 32-bit (points) | nonzero (%) | bits (Mbit) |"
          " weights removed by export (%) | conv channels empty / partial / full |", "|---" * 8 + "|"]
    for name, r in rows.items():
        gap = "n/a" if fedavg is None else f"{100 * (fedavg - r['final_accuracy']):.2f}"
        rm = f"{100 * r['removed_by_export']:.1f}" if "removed_by_export" in r else "-"
        rk = ", ".join(f"{n} {'/'.join(map(str, c))}" for n, c in r.get("conv_rows_empty_partial_full", {}).items())
        md.append(f"| {name} | `{' '.join(r['overrides'])}` | {100 * r['final_accuracy']:.2f} | {gap} | "
                  f"{100 * r['final_density']:.2f} | {r['total_bits'] / 1e6:.1f} | {rm} | {rk or '-'} |")
    md += ["", "Same data split, seed, rounds and local work as every method of fmnist_compare (the `seed1` rows: "
           "seed 1, so another split, initialisation and batch order; their gap is still to FedAvg's seed 0); "
           "FedAvg 32-bit: " + ("n/a" if fedavg is None else f"{100 * fedavg:.2f}%") + "."]
    (res / "dturbo_variants.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
