"""Figures from a run directory's own files (metrics.csv, messages/)."""

from __future__ import annotations

import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
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
    if not files:
        return []
    last = load_file(str(files[-1]))
    names = [k[: -len(".mask")] for k in last if k.endswith(".mask")]
    fig, axes = plt.subplots(1, len(names), figsize=(2.8 * len(names), 3.0), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        mask = last[f"{name}.mask"]
        ax.imshow(mask, cmap="Greys", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        ax.set(title=f"{name} {mask.shape[0]}x{mask.shape[1]}\n{100 * mask.mean():.1f}% kept",
               xlabel="input (grid column)", ylabel="output")
    fig.suptitle(f"Final support of every layer ({files[-1].stem})")
    return _save(fig, out / "support_masks")


def draw_run(run_dir: Path, out: Path | None = None) -> list[Path]:
    run_dir = Path(run_dir)
    out = Path(out) if out else run_dir / "figures"
    out.mkdir(parents=True, exist_ok=True)
    return draw_curves(run_dir, out) + draw_heatmaps(run_dir, out) + draw_masks(run_dir, out)
