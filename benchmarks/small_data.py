"""Defaults on data nobody tuned for (issue 14): D-Turbo-VBI's KL weight beta on a small and a large dataset.

    python benchmarks/small_data.py --stage select   # the beta grid, seed 0, chosen on validation accuracy
    python benchmarks/small_data.py --stage confirm  # the library default and FedAvg, seeds 0-2, test accuracy
    python benchmarks/small_data.py --stage report   # results file and docs table from the runs on disk
    python benchmarks/small_data.py --datasets digits fmnist-3k --stage all

Every run is configs/fmnist_quick.toml's training (12 rounds, 1 local epoch of Adam 2e-3, batch 64, Dirichlet 0.5,
target density 25%, 1 warm-up + 7 ramp rounds) with 20% of the training set held out as validation
(``data.validation = 0.2``). The datasets:

- ``digits``: scikit-learn's handwritten digits (1,797 8x8 images, bundled with scikit-learn; ``pip install
  scikit-learn``), 80/20 train/test split (seeded), the MLP (200, 100), 5 clients: 1,150 training samples, about
  4 local steps a round -- the case of issue 14.
- ``fmnist-3k``: Fashion-MNIST, 3,000 training samples (2,400 after validation), the 2,000 first test samples,
  alexnet-small, 10 clients.
- ``fmnist``: the whole of Fashion-MNIST (48,000 after validation), alexnet-small, 10 clients (the main job).

beta is chosen on validation accuracy (seed 0) and reported on test accuracy. Runs land in
runs/small_data/<dataset>/<label>_s<seed>/ (a finished run is reused, a cut one resumed); results:
benchmarks/results/small_data.{json,md}, and the table in docs/library.md's "Tuning" section.
One torch thread a run (two runs side by side use the 2 cores best).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import dturbo  # noqa: E402
from dturbo.report import read_metrics  # noqa: E402

BASE = ROOT / "configs" / "fmnist_quick.toml"
RUNS = ROOT / "runs" / "small_data"
RESULTS = ROOT / "benchmarks" / "results" / "small_data"
DOC = ROOT / "docs" / "library.md"

DATASETS: dict[str, dict[str, Any]] = {
    "digits": {"model.name": "mlp", "federation.clients": 5},
    "fmnist-3k": {"data.limit_train": 3000, "data.limit_test": 2000},
    "fmnist": {},
}
BETAS = [0.3, 0.1, 0.03, 0.01, 0.003, 0.001]
SEEDS = [0, 1, 2]


def digits_arrays(seed: int = 0) -> tuple[np.ndarray, ...]:
    """scikit-learn's digits as (x_train, y_train, x_test, y_test): 8x8 images (values 0..16), 80/20 split."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise SystemExit("the digits dataset needs scikit-learn: pip install scikit-learn") from err
    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    cut = int(0.8 * len(order))
    x, y = digits.images.astype(np.float32), digits.target.astype(np.int64)
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def run(dataset: str, label: str, overrides: dict[str, Any], seed: int) -> dict[str, Any]:
    """Train (or reuse) one run; its last row."""
    out = RUNS / dataset / f"{label}_s{seed}"
    settings = {"data.validation": 0.2, "experiment.seed": seed, "experiment.threads": 1,
                "experiment.name": f"small_data_{dataset}_{label}", **DATASETS[dataset], **overrides}
    cfg = dturbo.load_config(BASE, settings)
    finished = (out / "model.safetensors").exists()
    if not finished:
        print(f"[{dataset} {label} seed {seed}] training into {out}", flush=True)
        data = digits_arrays() if dataset == "digits" else None
        dturbo.Experiment(cfg, data=data, out=out, resume=(out / "checkpoint").exists(), figures=False,
                          progress=False).run()
    return summary(out, dataset, label, seed)


def summary(out: Path, dataset: str, label: str, seed: int) -> dict[str, Any]:
    """The last row of a finished run, with what identifies it."""
    cols = read_metrics(out)
    last = {key: float(cols[key][-1]) for key in ("accuracy", "val_accuracy", "density", "cum_bits")}
    return {"dataset": dataset, "label": label, "seed": seed, **last}


def select(datasets: list[str], betas: list[float], dense: bool) -> list[dict[str, Any]]:
    rows = []
    for dataset in datasets:
        for beta in betas:
            rows.append(run(dataset, f"beta{beta:g}", {"dturbo.beta": beta}, 0))
        if dense:
            rows.append(run(dataset, "dense_default", {"dturbo.sparsity.target_density": 1.0}, 0))
    return rows


def default_beta() -> float:
    """The library's default beta (what a config that does not set it gets)."""
    return dturbo.load_config({}).dturbo.beta


def confirm(datasets: list[str], seeds: list[int]) -> list[dict[str, Any]]:
    """The library's default beta (its runs shared with the grid's) and FedAvg (16-bit, its default)."""
    beta = default_beta()
    return [run(dataset, label, overrides, seed) for dataset in datasets for seed in seeds
            for label, overrides in ((f"beta{beta:g}", {"dturbo.beta": beta}),
                                     ("fedavg", {"experiment.algorithm": "fedavg"}))]


def collect() -> list[dict[str, Any]]:
    """Every finished run on disk (the report is built from these, whatever stage produced them)."""
    rows = []
    for dataset in DATASETS:
        for out in sorted((RUNS / dataset).glob("*_s*")):
            label, seed = out.name.rsplit("_s", 1)
            if (out / "model.safetensors").exists():
                rows.append(summary(out, dataset, label, int(seed)))
    return rows


def _mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{100 * values[0]:.2f} (1 seed)"
    return f"{100 * statistics.mean(values):.2f} +- {100 * statistics.stdev(values):.2f} ({len(values)} seeds)"


def report(rows: list[dict[str, Any]]) -> str:
    beta = default_beta()
    lines = [f"The library's default beta: {beta:g}. Seed 0 unless said; accuracies in %.", "",
             "### beta on validation (seed 0; 25% nonzero weights)", "",
             "| dataset | " + " | ".join(f"beta {b:g}" for b in BETAS) + " | chosen | dense, default beta |",
             "|---|" + "---|" * (len(BETAS) + 2)]
    for dataset in DATASETS:
        by = {r["label"]: r for r in rows if r["dataset"] == dataset and r["seed"] == 0}
        if not any(k.startswith("beta") for k in by):
            continue
        cells = [f"{100 * by[f'beta{b:g}']['val_accuracy']:.1f}" if f"beta{b:g}" in by else "-" for b in BETAS]
        done = [b for b in BETAS if f"beta{b:g}" in by]
        best = max(done, key=lambda b: by[f"beta{b:g}"]["val_accuracy"])
        dense = by.get("dense_default")
        lines.append(f"| {dataset} | " + " | ".join(cells) + f" | {best:g} | "
                     + (f"{100 * dense['val_accuracy']:.1f}" if dense else "-") + " |")
    lines += ["", "### The default against FedAvg (test accuracy, same protocol)", "",
              "| dataset | D-Turbo-VBI, default beta (25% nonzero) | FedAvg 16-bit (dense) | gap (points) |",
              "|---|---|---|---|"]
    for dataset in DATASETS:
        ours = [r["accuracy"] for r in rows if r["dataset"] == dataset and r["label"] == f"beta{beta:g}"]
        peer = [r["accuracy"] for r in rows if r["dataset"] == dataset and r["label"] == "fedavg"]
        if ours and peer:
            gap = 100 * (statistics.mean(peer) - statistics.mean(ours))
            lines.append(f"| {dataset} | {_mean_std(ours)} | {_mean_std(peer)} | {gap:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", choices=["select", "confirm", "report", "all"], default="all")
    parser.add_argument("--datasets", nargs="+", choices=list(DATASETS), default=list(DATASETS))
    parser.add_argument("--seeds", nargs="+", type=int, default=SEEDS, help="seeds of the confirm stage")
    parser.add_argument("--betas", nargs="+", type=float, default=BETAS, help="betas of the select stage")
    parser.add_argument("--no-dense", action="store_true", help="select stage: skip the dense run")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.stage in ("select", "all"):
        select(args.datasets, args.betas, not args.no_dense)
    if args.stage in ("confirm", "all"):
        confirm(args.datasets, args.seeds)
    rows = collect()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    table = report(rows)
    RESULTS.with_suffix(".md").write_text("# Defaults on data nobody tuned for\n\n" + table)
    print(table)


if __name__ == "__main__":
    main()
