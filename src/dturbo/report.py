"""Figures and tables from run directories' own files (config.toml, metrics.csv, messages/, model.safetensors).

One run: its curves, the Dense_2 message heat maps (the paper's Fig. 3) and its final support masks.
Several runs (:func:`compare`): accuracy vs cumulative bits, one curve per method (Fig. 2), and the comparison
table (Table I) in Markdown and CSV: final accuracy, nonzero weights, bits up / down, bits to reach target
accuracies, inference time of a forward pass over 3000 test samples.
"""

from __future__ import annotations

import csv
import io
import math
import time
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

HEATMAP_LAYER = "dense2"  # the paper's "Dense_2" (Fig. 3)


def read_metrics(run_dir: Path) -> dict[str, np.ndarray]:
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    cols: dict[str, np.ndarray] = {}
    for key in rows[0] if rows else []:
        cols[key] = np.array([float(r[key]) if r[key] != "" else np.nan for r in rows])
    return cols


def _save(fig: plt.Figure, path: Path, tight: bool = True) -> list[Path]:
    if tight:  # not with a colorbar spanning several axes: tight_layout cannot place it
        fig.tight_layout()
    out = [path.with_suffix(".png"), path.with_suffix(".svg")]
    for p in out:
        fig.savefig(p, dpi=120)
    plt.close(fig)
    return out


def draw_curves(run_dir: Path, out: Path) -> list[Path]:
    m = read_metrics(run_dir)
    if not m:
        return []
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    axes[0].plot(m["round"], 100 * m["accuracy"], "o-")
    axes[0].set(xlabel="communication round", ylabel="test accuracy (%)", title="Accuracy")
    axes[1].plot(m["round"], 100 * m["density"], "o-", color="C1")
    axes[1].set(xlabel="communication round", ylabel="nonzero weights (%)", title="Density of the global model")
    axes[1].set_ylim(0, 105)
    axes[2].semilogx(m["cum_bits"], 100 * m["accuracy"], "o-", color="C2")
    axes[2].set(xlabel="cumulative communication (bits, up + down)", ylabel="test accuracy (%)",
                title="Accuracy vs communication")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(run_dir.name)
    return _save(fig, out / "curves")


def _message_files(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "messages").glob("round_*.safetensors"))


def draw_heatmaps(run_dir: Path, out: Path, layer: str = HEATMAP_LAYER, panels: int = 5) -> list[Path]:
    """The B->A message pi of one layer as heat maps over rounds (the paper's Fig. 3)."""
    files = _message_files(run_dir)
    if not files:
        return []
    picks = sorted({files[int(round(i))] for i in np.linspace(0, len(files) - 1, min(panels, len(files)))})
    first = load_file(str(picks[0]))
    if f"{layer}.pi" not in first:
        return []
    pis = [load_file(str(p))[f"{layer}.pi"].astype(np.float32) for p in picks]
    # One colour scale for all panels, stretched to the values present (pi is often far below 1).
    vmax = max(0.05, float(max(np.percentile(p, 99.5) for p in pis)))
    fig, axes = plt.subplots(1, len(picks), figsize=(3.2 * len(picks), 3.6), squeeze=False)
    for i, (ax, path, pi) in enumerate(zip(axes[0], picks, pis, strict=True)):
        im = ax.imshow(pi, cmap="viridis", vmin=0, vmax=vmax, aspect="auto", interpolation="nearest")
        ax.set(title=f"round {int(path.stem.split('_')[1])}", xlabel="input unit")
        if i == 0:
            ax.set_ylabel("output unit")
    fig.colorbar(im, ax=axes[0].tolist(), label="pi = P(s = 1) from Module B")
    fig.suptitle(f"Support message v(h->s) of {layer} (grid {pis[0].shape[0]}x{pis[0].shape[1]}) over rounds")
    return _save(fig, out / f"message_{layer}", tight=False)


def draw_masks(run_dir: Path, out: Path) -> list[Path]:
    """The final support mask of every layer (black = kept)."""
    files = _message_files(run_dir)
    if files:
        last = load_file(str(files[-1]))
        source = files[-1].stem
    elif (run_dir / "model.safetensors").exists():  # a baseline: the nonzeros of its final weights
        weights = load_file(str(run_dir / "model.safetensors"))
        last = {}
        for key, w in weights.items():
            if key.endswith(".weight_mu"):
                name = key[: -len(".weight_mu")]
                nz = (w != 0) & (weights.get(f"{name}.mask", np.ones_like(w)) != 0)
                last[f"{name}.mask"] = nz.reshape(nz.shape[0], -1).astype(np.uint8)
        source = "model.safetensors"
    else:
        return []
    names = [k[: -len(".mask")] for k in last if k.endswith(".mask")]
    if not names:
        return []
    fig, axes = plt.subplots(1, len(names), figsize=(2.8 * len(names), 3.0), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        mask = last[f"{name}.mask"]
        ax.imshow(mask, cmap="Greys", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        ax.set(title=f"{name} {mask.shape[0]}x{mask.shape[1]}\n{100 * mask.mean():.1f}% kept",
               xlabel="input (grid column)", ylabel="output")
    fig.suptitle(f"Final support (nonzero weights) of every layer ({source})")
    return _save(fig, out / "support_masks")


# ------------------------------------------------------------------ several runs
@dataclass
class RunSummary:
    run_dir: Path
    label: str
    algorithm: str
    rounds: int
    final_accuracy: float
    best_accuracy: float
    density: float
    up_bits: float
    down_bits: float
    metrics: dict[str, np.ndarray]
    inference_ms: float | None = None

    @property
    def total_bits(self) -> float:
        return self.up_bits + self.down_bits

    def bits_to_reach(self, target: float) -> float | None:
        """Cumulative bits (up + down) at the first evaluated round whose accuracy is >= ``target``."""
        acc = self.metrics["accuracy"]
        hit = np.flatnonzero(np.nan_to_num(acc, nan=-1.0) >= target - 1e-12)
        return float(self.metrics["cum_bits"][hit[0]]) if hit.size else None


def method_label(cfg: object) -> str:
    """A readable name of a run's method and its distinguishing setting."""
    algo = cfg.experiment.algorithm  # type: ignore[attr-defined]
    if algo == "dturbo":
        sp = cfg.dturbo.sparsity  # type: ignore[attr-defined]
        tied = [k for k in ("conv", "dense") if getattr(cfg.dturbo.prior, k).tie_rows]  # type: ignore[attr-defined]
        extra = "".join(", whole conv channels" if k == "conv" else ", whole dense units" for k in tied)
        return f"D-Turbo-VBI ({sp.target_density:.0%} target{extra})" if sp.mode == "target" else \
            f"D-Turbo-VBI (prior{extra})"
    if algo == "fedavg":
        return f"FedAvg {cfg.fedavg.dtype.replace('float', '')}-bit"  # type: ignore[attr-defined]
    if algo == "fedpaq":
        s = cfg.fedpaq.levels  # type: ignore[attr-defined]
        return f"FedPAQ (s={s})" if s else "FedPAQ (unquantised)"
    if algo == "dssm":
        d = cfg.dssm  # type: ignore[attr-defined]
        return f"DSSM (gamma={d.gamma:g}{', weights' if d.mode == 'weights' else ''})"
    return str(algo)


def summarize(run_dir: Path, *, inference: bool = True, samples: int = 3000, repeats: int = 5) -> RunSummary:
    """Read one run directory (config.toml, metrics.csv; model.safetensors for the inference time)."""
    from .config import load_config

    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.toml")
    m = read_metrics(run_dir)
    if not m or "accuracy" not in m:
        raise ValueError(f"{run_dir}/metrics.csv holds no rounds")
    acc = m["accuracy"]
    summary = RunSummary(
        run_dir=run_dir, label=method_label(cfg), algorithm=cfg.experiment.algorithm, rounds=int(m["round"][-1]),
        final_accuracy=float(acc[-1]), best_accuracy=float(np.nanmax(acc)), density=float(m["density"][-1]),
        up_bits=float(m["up_bits"].sum()), down_bits=float(m["down_bits"].sum()), metrics=m,
    )
    if inference and (run_dir / "model.safetensors").exists():
        from .data import DataError

        try:
            summary.inference_ms = inference_time_ms(run_dir, cfg, samples=samples, repeats=repeats)
        except DataError:  # the data is not on this machine: the column stays empty
            summary.inference_ms = None
    return summary


def load_run_model(run_dir: Path, cfg: object | None = None) -> torch.nn.Module:
    """The run's final global model (as saved in model.safetensors) in eval mode."""
    from safetensors.torch import load_file as load_torch

    from .config import load_config
    from .nn.models import build_model

    cfg = cfg or load_config(Path(run_dir) / "config.toml")
    ds = _run_dataset(cfg, 1)
    model = build_model(cfg.model.name, ds.input_shape, ds.num_classes, sigma_mode=cfg.dturbo.sigma_mode,  # type: ignore[attr-defined]
                        hidden=cfg.model.hidden, width=cfg.model.width)  # type: ignore[attr-defined]
    state = load_torch(str(Path(run_dir) / "model.safetensors"))
    model.load_state_dict(state, strict=False)  # tied sigma (sigma_mode "client") is saved once per layer
    return model.eval()


def _run_dataset(cfg: object, limit_test: int) -> object:
    """The run's data, normalised exactly as in the run (same training subset statistics)."""
    from .data import load_dataset

    d = cfg.data  # type: ignore[attr-defined]
    return load_dataset(d.name, d.path, limit_train=d.limit_train, limit_test=limit_test,
                        seed=cfg.experiment.seed)  # type: ignore[attr-defined]


@torch.no_grad()
def inference_time_ms(run_dir: Path, cfg: object, *, samples: int = 3000, repeats: int = 5) -> float:
    """Median wall time (ms) of one forward pass of ``samples`` test images through the saved model, as a
    masked dense network in eval mode (Table I's column; :mod:`dturbo.export` removes the zeros for speed)."""
    model = load_run_model(run_dir, cfg)
    x = torch.from_numpy(_run_dataset(cfg, samples).x_test[:samples])
    model(x)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(x)
        times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times))


def draw_comparison(runs: list[RunSummary], out: Path) -> list[Path]:
    """Accuracy vs cumulative communication bits (log x), one curve per method (the paper's Fig. 2)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, r in enumerate(runs):
        m = r.metrics
        ok = ~np.isnan(m["accuracy"])
        ax.semilogx(m["cum_bits"][ok], 100 * m["accuracy"][ok], "o-", ms=3, color=f"C{i}",
                    label=f"{r.label}: {100 * r.final_accuracy:.1f}%, {100 * r.density:.0f}% nonzero")
    ax.set(xlabel="cumulative communication, up + down (bits, log scale)", ylabel="test accuracy (%)",
           title="Accuracy vs communication")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, out / "accuracy_vs_bits")


def _fmt_bits(b: float | None) -> str:
    if b is None:
        return "not reached"
    return f"{b / 1e6:,.1f} Mbit"


def comparison_table(runs: list[RunSummary], targets: list[float]) -> tuple[str, str]:
    """(Markdown, CSV) of the comparison (the paper's Table I, with bits)."""
    head = ["method", "run", "rounds", "final accuracy (%)", "nonzero weights (%)", "bits up (Mbit)",
            "bits down (Mbit)", "bits total (Mbit)"]
    head += [f"bits to {100 * t:.1f}% (Mbit)" for t in targets]
    head += ["inference 3000 samples (ms)"]
    rows = []
    for r in runs:
        row = [r.label, r.run_dir.name, str(r.rounds), f"{100 * r.final_accuracy:.2f}", f"{100 * r.density:.1f}",
               f"{r.up_bits / 1e6:.1f}", f"{r.down_bits / 1e6:.1f}", f"{r.total_bits / 1e6:.1f}"]
        for t in targets:
            b = r.bits_to_reach(t)
            row.append("not reached" if b is None else f"{b / 1e6:.1f}")
        row.append("" if r.inference_ms is None else f"{r.inference_ms:.1f}")
        rows.append(row)
    md = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    md += ["| " + " | ".join(row) + " |" for row in rows]
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(head)
    writer.writerows(rows)
    return "\n".join(md) + "\n", buf.getvalue()


def compare(run_dirs: list[Path], out: Path, *, targets: list[float] | None = None, inference: bool = True,
            per_run_figures: bool = True) -> tuple[list[RunSummary], list[Path]]:
    """The multi-run report into ``out``: accuracy_vs_bits.{png,svg}, comparison.{md,csv}, and each run's own
    figures in ``out/<run name>/``. Default target: the lowest final accuracy of the runs (every run reaches
    it, so the bits are comparable)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [summarize(Path(d), inference=inference) for d in run_dirs]
    if targets is None:
        targets = [math.floor(1000 * min(r.final_accuracy for r in runs)) / 1000]
    files = draw_comparison(runs, out)
    md, table_csv = comparison_table(runs, targets)
    (out / "comparison.md").write_text(md)
    (out / "comparison.csv").write_text(table_csv)
    files += [out / "comparison.md", out / "comparison.csv"]
    if per_run_figures:
        for r in runs:
            files += draw_run(r.run_dir, out / r.run_dir.name)
    return runs, files


def draw_run(run_dir: Path, out: Path | None = None) -> list[Path]:
    run_dir = Path(run_dir)
    out = Path(out) if out else run_dir / "figures"
    out.mkdir(parents=True, exist_ok=True)
    return draw_curves(run_dir, out) + draw_heatmaps(run_dir, out) + draw_masks(run_dir, out)
