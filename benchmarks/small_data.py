"""Defaults on data nobody tuned for (issue 14): D-Turbo-VBI's KL weight beta on a small and a large dataset.

    python benchmarks/small_data.py --stage select   # the beta grid, seed 0, chosen on validation accuracy
    python benchmarks/small_data.py --stage confirm  # the library default and FedAvg, seeds 0-2, test accuracy
    python benchmarks/small_data.py --stage knobs    # the other knobs one at a time (the two small datasets)
    python benchmarks/small_data.py --stage schedule # warm-up / ramp in rounds, seeds 0-2, and the paced default
    python benchmarks/small_data.py --stage lr       # the paced default at lr 0.005 / 0.01, FedAvg at 0.005
    python benchmarks/small_data.py --stage report   # results file and docs tables from the runs on disk (and the
                                                     # committed rows of runs not on this disk)
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

The ``paced`` runs leave ``warmup_rounds`` and ``ramp_rounds`` unset, so the library paces them by local steps
(dturbo.sparsity.pruning_schedule); the ``w<W>r<R>`` runs set them explicitly, and the cap of the paced warm-up was
chosen on their validation accuracy (seeds 0-2, the small datasets).

beta is chosen on validation accuracy (seed 0; the library default is the beta whose worst shortfall from each
dataset's best is smallest) and reported on test accuracy. Runs land in
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
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import dturbo  # noqa: E402
from dturbo.config import DEFAULT_LR  # noqa: E402
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
# The other knobs (docs/library.md#tuning), one at a time at the default beta, seed 0; FedAvg gets the training
# knobs too, so that the comparison stays on one protocol.
KNOBS: dict[str, dict[str, Any]] = {
    "epochs5": {"train.local_epochs": 5},
    "lr0.005": {"train.lr": 0.005},
    "warmup3_ramp5": {"dturbo.sparsity.warmup_rounds": 3, "dturbo.sparsity.ramp_rounds": 5},
    "sigma0.01": {"dturbo.sigma_init_ratio": 0.01},
    "target0.5": {"dturbo.sparsity.target_density": 0.5},
    "weak_mrf": {f"dturbo.prior.{kind}.{key}": 0.3 for kind in ("conv", "dense") for key in ("p11_row", "p11_col")},
    "flat": {},  # digits only: N x 64 features (see digits_arrays)
    "fedavg_epochs5": {"experiment.algorithm": "fedavg", "train.local_epochs": 5},
    "fedavg_lr0.005": {"experiment.algorithm": "fedavg", "train.lr": 0.005},
    "fedavg_flat": {"experiment.algorithm": "fedavg"},
}
SEEDS = [0, 1, 2]
# Explicit schedules (warm-up rounds, ramp rounds) of the schedule stage: (0, 1) fixes the support at initialisation,
# the last five end by round 11 of 12;
# PACED unsets both (the library's default: paced by local steps, dturbo.sparsity.pruning_schedule).
SCHEDULES = [(0, 1), (0, 7), (1, 7), (3, 8), (4, 7), (5, 6), (6, 5), (8, 3)]
PACED = {"dturbo.sparsity.warmup_rounds": None, "dturbo.sparsity.ramp_rounds": None}
# The lr stage's grid (the protocol's 0.002 first); runs of lr x are labelled paced_lr<x> / fedavg_lr<x>, except
# the protocol's, which are the paced / fedavg runs.
PROTOCOL_LR = 0.002
LRS = {"dturbo": [PROTOCOL_LR, 0.005, 0.01], "fedavg": [PROTOCOL_LR, 0.005]}
LR_BASE = {"dturbo": PACED, "fedavg": {"experiment.algorithm": "fedavg"}}  # what each lr is applied to


def digits_arrays(seed: int = 0, flat: bool = False) -> tuple[np.ndarray, ...]:
    """scikit-learn's digits as (x_train, y_train, x_test, y_test): 8x8 images (values 0..16), 80/20 split;
    ``flat``: N x 64 features instead (standardised per feature rather than per image channel)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise SystemExit("the digits dataset needs scikit-learn: pip install scikit-learn") from err
    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    cut = int(0.8 * len(order))
    x, y = (digits.data if flat else digits.images).astype(np.float32), digits.target.astype(np.int64)
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def run(dataset: str, label: str, overrides: dict[str, Any], seed: int) -> dict[str, Any]:
    """Train (or reuse) one run; its last row."""
    out = RUNS / dataset / f"{label}_s{seed}"
    settings = {"data.validation": 0.2, "experiment.seed": seed, "experiment.threads": 1, "train.lr": PROTOCOL_LR,
                "experiment.name": f"small_data_{dataset}_{label}", **DATASETS[dataset], **overrides}
    base = tomllib.loads(BASE.read_text())
    for key in [k for k, v in settings.items() if v is None]:  # None: the key unset (the library's default)
        *sections, name = key.split(".")
        node = base
        for section in sections:
            node = node.get(section, {})
        node.pop(name, None)
        del settings[key]
    cfg = dturbo.load_config(base, settings)
    finished = (out / "model.safetensors").exists()
    if not finished:
        print(f"[{dataset} {label} seed {seed}] training into {out}", flush=True)
        data = digits_arrays(flat=label.endswith("flat")) if dataset == "digits" else None
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


def knobs(datasets: list[str]) -> list[dict[str, Any]]:
    return [run(dataset, label, overrides, 0) for dataset in datasets for label, overrides in KNOBS.items()
            if dataset == "digits" or not label.endswith("flat")]


def schedules(datasets: list[str], seeds: list[int]) -> list[dict[str, Any]]:
    """Explicit warm-up / ramp rounds on the small datasets (the paced warm-up's cap is chosen on their validation
    accuracy), and the paced default with FedAvg on every dataset; seeds 0-2."""
    rows = []
    for dataset in datasets:
        for seed in seeds:
            if dataset != "fmnist":
                rows += [run(dataset, f"w{w}r{r}", {"dturbo.sparsity.warmup_rounds": w,
                                                    "dturbo.sparsity.ramp_rounds": r}, seed) for w, r in SCHEDULES]
            rows.append(run(dataset, "paced", PACED, seed))
            rows.append(run(dataset, "fedavg", {"experiment.algorithm": "fedavg"}, seed))
            if dataset != "fmnist":  # 5 local epochs: 16 steps a round, the paced warm-up is then 4 rounds
                rows.append(run(dataset, "paced_epochs5", {**PACED, "train.local_epochs": 5}, seed))
                rows.append(run(dataset, "fedavg_epochs5", KNOBS["fedavg_epochs5"], seed))
    return rows


def learning_rate(datasets: list[str], seeds: list[int]) -> list[dict[str, Any]]:
    """The paced default at Adam's lr 0.005 and 0.01 and FedAvg at 0.005 (the protocol's is 0.002), seeds 0-2;
    on the whole of Fashion-MNIST (its seeds 0-1, as its other rows) D-Turbo-VBI at 0.005 (the frontier measured
    FedAvg's lr there: docs/communication.md). The library's default lr per algorithm (config.DEFAULT_LR) is
    chosen on these runs' validation accuracy."""
    rows = []
    for dataset in datasets:
        small = dataset != "fmnist"
        grid = {"dturbo": LRS["dturbo"][1:] if small else [0.005], "fedavg": LRS["fedavg"][1:] if small else []}
        for seed in seeds if small else [s for s in seeds if s < 2]:
            rows += [run(dataset, _lr_label(algorithm, lr), {**LR_BASE[algorithm], "train.lr": lr}, seed)
                     for algorithm, lrs in grid.items() for lr in lrs]
    return rows


def default_beta() -> float:
    """The library's default beta (what a config that does not set it gets)."""
    return dturbo.load_config({}).dturbo.beta


def confirm(datasets: list[str], seeds: list[int]) -> list[dict[str, Any]]:
    """The library's default beta (its runs shared with the grid's) and FedAvg (16-bit, its default); on the small
    datasets both again with 5 local epochs (the fix the run's LocalStepsWarning names)."""
    beta = default_beta()
    pairs = [(f"beta{beta:g}", {"dturbo.beta": beta}), ("fedavg", {"experiment.algorithm": "fedavg"})]
    return [run(dataset, label, overrides, seed) for dataset in datasets for seed in seeds
            for label, overrides in pairs + ([(k, KNOBS[k]) for k in ("epochs5", "fedavg_epochs5")]
                                             if dataset != "fmnist" else [])]


def collect() -> list[dict[str, Any]]:
    """Every finished run on disk, and the committed results of runs not on this disk (a clone without some run
    directories keeps their rows); the report is built from these, whatever stage produced them."""
    rows = {}
    if RESULTS.with_suffix(".json").exists():
        rows = {(r["dataset"], r["label"], r["seed"]): r for r in json.loads(RESULTS.with_suffix(".json").read_text())}
    for dataset in DATASETS:
        for out in sorted((RUNS / dataset).glob("*_s*")):
            label, seed = out.name.rsplit("_s", 1)
            if (out / "model.safetensors").exists():
                rows[(dataset, label, int(seed))] = summary(out, dataset, label, int(seed))
    return sorted(rows.values(), key=lambda r: (list(DATASETS).index(r["dataset"]), r["label"], r["seed"]))


def _mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{100 * values[0]:.2f} (1 seed)"
    return f"{100 * statistics.mean(values):.2f} +- {100 * statistics.stdev(values):.2f} ({len(values)} seeds)"


def _seed0(rows: list[dict[str, Any]], dataset: str) -> dict[str, dict[str, Any]]:
    return {r["label"]: r for r in rows if r["dataset"] == dataset and r["seed"] == 0}


def beta_table(rows: list[dict[str, Any]]) -> str:
    """Validation accuracy by beta (seed 0), each dataset's best, and each beta's worst shortfall from those bests:
    the library default is the beta with the smallest."""
    lines = ["| dataset | " + " | ".join(f"beta {b:g}" for b in BETAS) + " | best | dense, default beta | FedAvg |",
             "|---|" + "---|" * (len(BETAS) + 3)]
    shortfall = dict.fromkeys(BETAS, 0.0)
    for dataset in DATASETS:
        by = _seed0(rows, dataset)
        done = [b for b in BETAS if f"beta{b:g}" in by]
        if not done:
            continue
        val = {b: 100 * by[f"beta{b:g}"]["val_accuracy"] for b in done}
        best = max(done, key=val.__getitem__)
        for b in BETAS:
            shortfall[b] = max(shortfall[b], val[best] - val[b]) if b in val else float("nan")
        extra = [f"{100 * by[k]['val_accuracy']:.1f}" if k in by else "-" for k in ("dense_default", "fedavg")]
        lines.append(f"| {dataset} | " + " | ".join(f"{val[b]:.1f}" if b in val else "-" for b in BETAS)
                     + f" | {best:g} | " + " | ".join(extra) + " |")
    lines.append("| worst shortfall from the best | " + " | ".join(f"{shortfall[b]:.1f}" for b in BETAS)
                 + " | | | |")
    return "\n".join(lines) + "\n"


def knob_table(rows: list[dict[str, Any]]) -> str:
    beta = default_beta()
    small = [d for d in DATASETS if any(r["dataset"] == d and r["label"] in KNOBS for r in rows)]
    lines = ["| knob (one at a time) | " + " | ".join(small) + " |", "|---|" + "---|" * len(small)]
    for label in (f"beta{beta:g}", *KNOBS, "fedavg"):
        cells = [f"{100 * by[label]['val_accuracy']:.1f} / {100 * by[label]['accuracy']:.1f}"
                 if label in (by := _seed0(rows, dataset)) else "-" for dataset in small]
        name = {f"beta{beta:g}": "D-Turbo-VBI, default beta, 1 / 7 rounds", "fedavg": "FedAvg, defaults"}.get(
            label, f"`{label}`")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def confirm_table(rows: list[dict[str, Any]]) -> str:
    beta = default_beta()
    lines = ["| dataset | D-Turbo-VBI, default beta, 1 / 7 rounds, 25% nonzero | FedAvg 16-bit, dense | FedAvg's lead "
             "(points) |",
             "|---|---|---|---|"]
    for dataset in DATASETS:
        for mine, theirs, what in ((f"beta{beta:g}", "fedavg", ""), ("epochs5", "fedavg_epochs5", ", 5 local epochs")):
            ours = [r["accuracy"] for r in rows if r["dataset"] == dataset and r["label"] == mine]
            peer = [r["accuracy"] for r in rows if r["dataset"] == dataset and r["label"] == theirs]
            if ours and peer and (len(ours) > 1 and len(peer) > 1 or dataset == "fmnist"):
                lead = 100 * (statistics.mean(peer) - statistics.mean(ours))
                lines.append(f"| {dataset}{what} | {_mean_std(ours)} | {_mean_std(peer)} | {lead:.1f} |")
    return "\n".join(lines) + "\n"


def _mean(rows: list[dict[str, Any]], dataset: str, label: str, key: str) -> tuple[float, int]:
    values = [r[key] for r in rows if r["dataset"] == dataset and r["label"] == label]
    return (100 * statistics.mean(values) if values else float("nan")), len(values)


def schedule_table(rows: list[dict[str, Any]]) -> str:
    """Mean validation accuracy (seeds 0-2) of each explicit schedule and of the paced default, with FedAvg's."""
    small = [d for d in DATASETS if any(r["dataset"] == d and r["label"] == "w5r6" for r in rows)]
    lines = ["| warm-up / ramp rounds | " + " | ".join(small) + " |", "|---|" + "---|" * len(small)]
    notes = {(0, 1): " (support chosen at initialisation)", (1, 7): " (fmnist_quick's)"}
    labels = [(f"w{w}r{r}", f"{w} / {r}{notes.get((w, r), '')}") for w, r in SCHEDULES]
    for label, name in [*labels, ("paced", "paced by local steps (the default)"), ("fedavg", "FedAvg, dense")]:
        cells = []
        for dataset in small:
            mean, n = _mean(rows, dataset, label, "val_accuracy")
            cells.append(f"{mean:.1f} ({n} seeds)" if n else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def paced_table(rows: list[dict[str, Any]]) -> str:
    """Test accuracy of the paced default against fmnist_quick's explicit schedule and FedAvg, with each one's mean
    total bits (Mbit, up and down)."""
    beta = default_beta()
    lines = ["| dataset | D-Turbo-VBI, paced schedule (default), 25% nonzero | D-Turbo-VBI, 1 / 7 rounds "
             "(fmnist_quick's), 25% nonzero | FedAvg 16-bit, dense | FedAvg's lead over paced (points) | Mbit: "
             "paced / 1 / 7 / FedAvg |", "|---|---|---|---|---|---|"]
    for dataset in DATASETS:
        for what, labels in (("", ("paced", f"beta{beta:g}", "fedavg")),
                             (", 5 local epochs", ("paced_epochs5", "epochs5", "fedavg_epochs5")),
                             (", lr 0.005 for both", ("paced_lr0.005", "", "fedavg_lr0.005"))):
            sel = [[r for r in rows if r["dataset"] == dataset and r["label"] == label] for label in labels]
            if not sel[0] or not sel[2]:
                continue
            cols = [[r["accuracy"] for r in runs] for runs in sel]
            bits = " / ".join(f"{statistics.mean(r['cum_bits'] for r in runs) / 1e6:.0f}" if runs else "-"
                              for runs in sel)
            lead = 100 * (statistics.mean(cols[2]) - statistics.mean(cols[0]))
            lines.append(f"| {dataset}{what} | " + " | ".join(_mean_std(c) if c else "-" for c in cols)
                         + f" | {lead:.1f} | {bits} |")
    return "\n".join(lines) + "\n"


def _lr_label(algorithm: str, lr: float) -> str:
    base = "paced" if algorithm == "dturbo" else "fedavg"
    return base if lr == PROTOCOL_LR else f"{base}_lr{lr:g}"


def lr_table(rows: list[dict[str, Any]]) -> str:
    """Mean validation accuracy of each learning rate of the lr stage (D-Turbo-VBI: the paced default), each
    dataset's seeds; config.DEFAULT_LR is chosen on it."""
    grid = [(algorithm, lr) for algorithm, lrs in LRS.items() for lr in lrs]
    names = {"dturbo": "D-Turbo-VBI", "fedavg": "FedAvg"}
    lines = ["| dataset | " + " | ".join(f"{names[a]}, lr {lr:g}" for a, lr in grid) + " |",
             "|---|" + "---|" * len(grid)]
    for dataset in DATASETS:
        cells = []
        for algorithm, lr in grid:
            mean, n = _mean(rows, dataset, _lr_label(algorithm, lr), "val_accuracy")
            cells.append(f"{mean:.1f} ({n} seeds)" if n else "-")
        if any(c != "-" for c in cells):
            lines.append(f"| {dataset} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def defaults_table(rows: list[dict[str, Any]]) -> str:
    """Test accuracy of what a config that sets neither the schedule nor the lr gets: the paced schedule at
    D-Turbo-VBI's default lr against FedAvg 16-bit at FedAvg's (config.DEFAULT_LR), with the mean total bits."""
    mine, theirs = (_lr_label(a, DEFAULT_LR[a]) for a in ("dturbo", "fedavg"))
    lines = [f"| dataset | D-Turbo-VBI, paced, lr {DEFAULT_LR['dturbo']:g}, 25% nonzero | FedAvg 16-bit, lr "
             f"{DEFAULT_LR['fedavg']:g}, dense | FedAvg's lead (points) | Mbit: D-Turbo-VBI / FedAvg |",
             "|---|---|---|---|---|"]
    for dataset in DATASETS:
        sel = [[r for r in rows if r["dataset"] == dataset and r["label"] == label] for label in (mine, theirs)]
        if not all(sel):
            continue
        ours, peer = ([r["accuracy"] for r in runs] for runs in sel)
        bits = " / ".join(f"{statistics.mean(r['cum_bits'] for r in runs) / 1e6:.0f}" for runs in sel)
        lead = 100 * (statistics.mean(peer) - statistics.mean(ours))
        lines.append(f"| {dataset} | {_mean_std(ours)} | {_mean_std(peer)} | {lead:.1f} | {bits} |")
    return "\n".join(lines) + "\n"


TABLES = {"beta": ("beta on validation (seed 0; validation accuracy, %)", beta_table),
          "confirm": ("The default against FedAvg (test accuracy, %, same protocol)", confirm_table),
          "knobs": ("Other knobs (seed 0, default beta; validation / test accuracy, %)", knob_table),
          "schedule": ("Warm-up / ramp on validation (mean of seeds 0-2; validation accuracy, %)", schedule_table),
          "paced": ("The paced schedule against FedAvg (test accuracy, %)", paced_table),
          "lr": ("The learning rate on validation (mean of the seeds; validation accuracy, %)", lr_table),
          "defaults": ("The library's defaults against FedAvg's (test accuracy, %)", defaults_table)}


def fill_doc(doc: Path, tables: dict[str, str]) -> None:
    """Each table between its ``<!-- small-data:NAME -->`` and ``<!-- /small-data:NAME -->`` markers in ``doc``."""
    text = doc.read_text()
    for name, table in tables.items():
        start, end = f"<!-- small-data:{name} -->", f"<!-- /small-data:{name} -->"
        if start in text and end in text:
            head, rest = text.split(start, 1)
            text = f"{head}{start}\n{table}{end}{rest.split(end, 1)[1]}"
    doc.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", choices=["select", "confirm", "knobs", "schedule", "lr", "report", "all"],
                        default="all")
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
    if args.stage in ("knobs", "all"):
        knobs([d for d in args.datasets if d != "fmnist"])  # the small datasets: seconds to minutes a run
    if args.stage in ("schedule", "all"):
        schedules(args.datasets, args.seeds)
    if args.stage in ("lr", "all"):
        learning_rate(args.datasets, args.seeds)
    rows = collect()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    tables = {name: make(rows) for name, (_, make) in TABLES.items()}
    lrs = ", ".join(f"{a} {lr:g}" for a, lr in DEFAULT_LR.items())
    text = (f"# Defaults on data nobody tuned for\n\nThe library's default beta: {default_beta():g}; default lr "
            f"by algorithm: {lrs}. Every run sets lr {PROTOCOL_LR:g} unless its label names another.\n\n") + "\n".join(
        f"## {title}\n\n{tables[name]}" for name, (title, _) in TABLES.items())
    RESULTS.with_suffix(".md").write_text(text)
    fill_doc(DOC, tables)
    print(text)


if __name__ == "__main__":
    main()
