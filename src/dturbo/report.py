"""Figures and tables from run directories' own files (config.toml, metrics.csv, messages/, model.safetensors),
read through :class:`dturbo.rundir.RunDir`.

One run: its curves, the Dense_2 message heat maps (the paper's Fig. 3) and its final support masks.
Several runs (:func:`compare`): accuracy vs cumulative bits, one curve per method (Fig. 2), and the comparison
table (Table I) in Markdown and CSV: final accuracy, nonzero weights, bits up / down, bits to reach target
accuracies, inference time of a forward pass over 3000 test samples (fewer when the test set is smaller: the
column is named after the number really timed).
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
import matplotlib.axis  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.text  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import EngFormatter, FixedLocator, LogLocator, MaxNLocator, NullFormatter  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from .rundir import RunDir  # noqa: E402

HEATMAP_LAYER = "dense2"  # the paper's "Dense_2" (Fig. 3)
DPI = 120


def read_metrics(run_dir: Path) -> dict[str, np.ndarray]:
    with open(RunDir(run_dir).metrics_path, newline="") as f:
        rows = list(csv.DictReader(f))
    cols: dict[str, np.ndarray] = {}
    for key in rows[0] if rows else []:
        cols[key] = np.array([float(r[key]) if r[key] != "" else np.nan for r in rows])
    return cols


def _figure(ncols: int, nrows: int = 1, *, figsize: tuple[float, float]) -> tuple[Figure, np.ndarray]:
    """A figure whose layout engine keeps the suptitle, titles, labels and colorbars apart (constrained layout)."""
    fig, axes = plt.subplots(nrows, ncols, figsize=figsize, squeeze=False, layout="constrained")
    return fig, axes


def _save(fig: Figure, path: Path) -> list[Path]:
    """PNG and SVG; ``bbox_inches="tight"`` so that nothing drawn is cut at the edge. Closes the figure.

    The same figure gives the same bytes: no date in the SVG and its element ids hashed with a fixed salt (the
    default is a random one), so regenerating a committed figure changes the file only where the drawing does."""
    out = [path.with_suffix(".png"), path.with_suffix(".svg")]
    with plt.rc_context({"svg.hashsalt": "dturbo"}):
        for p in out:
            fig.savefig(p, dpi=DPI, bbox_inches="tight", pad_inches=0.1, metadata={"Date": None})
    plt.close(fig)
    return out


def round_axis(ax: Axes) -> None:
    """Communication rounds are integers: no tick at round 2.5."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.set_xlabel("communication round")


def _visible_tick_labels(axis: matplotlib.axis.Axis) -> list[matplotlib.text.Text]:
    """The major tick labels drawn inside the axis' view (after a draw), with their text."""
    lo, hi = sorted(axis.get_view_interval())
    locs = axis.get_majorticklocs()
    ticks = axis.get_major_ticks(len(locs))
    span = abs(hi - lo) * 1e-9
    return [t.label1 for loc, t in zip(locs, ticks, strict=True)
            if lo - span <= loc <= hi + span and t.label1.get_visible() and t.label1.get_text()]


def labels_overlap(labels: list[matplotlib.text.Text], renderer: object, pad_px: float = 3.0) -> bool:
    """Whether any two of these texts (drawn) overlap, with ``pad_px`` pixels of air required between them."""
    boxes = [t.get_window_extent(renderer) for t in labels]  # type: ignore[arg-type]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if a.x0 < b.x1 + pad_px and b.x0 < a.x1 + pad_px and a.y0 < b.y1 + pad_px and b.y0 < a.y1 + pad_px:
                return True
    return False


# Log-axis tick choices, densest first: every 1..9 x 10^k, fewer mantissas, then decades (thinned).
_LOG_TICKS: tuple[tuple[tuple[float, ...], int], ...] = (
    (tuple(range(1, 10)), 12), ((1, 2, 4, 6, 8), 12), ((1, 2, 3, 5), 12), ((1, 2, 5), 12), ((1, 3), 12),
    ((1,), 12), ((1,), 6), ((1,), 4), ((1,), 3),
)
LABEL_GAP_PX = 8.0  # the least air between two tick labels of a log axis (at the figure's dpi)


def bits_log_axis(ax: Axes) -> None:
    """Log-scale x axis of bits with engineering labels (``20 Mbit``), as many ticks as fit without any two
    labels overlapping (checked on the drawn figure: call once the figure's content is complete)."""
    axis = ax.xaxis
    axis.set_major_formatter(EngFormatter(unit="bit", sep=" "))
    axis.set_minor_locator(LogLocator(base=10, subs=tuple(range(2, 10)), numticks=12))
    axis.set_minor_formatter(NullFormatter())
    fig = ax.figure
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    fallback = None
    for subs, numticks in _LOG_TICKS:
        axis.set_major_locator(LogLocator(base=10, subs=subs, numticks=numticks))
        fig.draw_without_rendering()  # positions and texts of the ticks, no pixels
        labels = _visible_tick_labels(axis)
        if labels and not labels_overlap(labels, renderer, LABEL_GAP_PX):
            if len(labels) >= 2:
                return
            fallback = fallback or (subs, numticks)
    if fallback is not None:  # one label only: a narrow range of bits
        axis.set_major_locator(LogLocator(base=10, subs=fallback[0], numticks=fallback[1]))
        return
    lo, hi = sorted(axis.get_view_interval())  # nothing fits: both ends of the view, 2 significant digits
    ends = [float(f"{v:.2g}") for v in np.geomspace(lo, hi, 4)[1:3]]
    axis.set_major_locator(FixedLocator(ends))


def curves_figure(run_dir: Path) -> Figure | None:
    """Accuracy and density over rounds, accuracy vs cumulative bits; None without rounds."""
    m = read_metrics(run_dir)
    if not m:
        return None
    fig, axes = _figure(3, figsize=(14, 4.0))
    axes = axes[0]
    ok = ~np.isnan(m["accuracy"])  # rounds without an evaluation (eval_every > 1) are left out, not gaps
    axes[0].plot(m["round"][ok], 100 * m["accuracy"][ok], "o-")
    axes[0].set(ylabel="test accuracy (%)", title="Accuracy")
    axes[1].plot(m["round"], 100 * m["density"], "o-", color="C1")
    axes[1].set(ylabel="nonzero weights (%)", title="Density of the global model")
    axes[1].set_ylim(0, 105)
    for ax in axes[:2]:
        round_axis(ax)
    axes[2].semilogx(m["cum_bits"][ok], 100 * m["accuracy"][ok], "o-", color="C2")
    axes[2].set(xlabel="cumulative communication, up + down", ylabel="test accuracy (%)",
                title="Accuracy vs communication")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[2].grid(alpha=0.15, which="minor")
    fig.suptitle(Path(run_dir).name)
    bits_log_axis(axes[2])
    return fig


def draw_curves(run_dir: Path, out: Path) -> list[Path]:
    fig = curves_figure(run_dir)
    return [] if fig is None else _save(fig, out / "curves")


def heatmap_figure(run_dir: Path, layer: str = HEATMAP_LAYER, panels: int = 5) -> Figure | None:
    """The B->A message pi of one layer as heat maps over rounds (the paper's Fig. 3); None without messages."""
    files = RunDir(run_dir).message_files()
    if not files:
        return None
    picks = sorted({files[int(round(i))] for i in np.linspace(0, len(files) - 1, min(panels, len(files)))})
    first = load_file(str(picks[0]))
    if f"{layer}.pi" not in first:
        return None
    pis = [load_file(str(p))[f"{layer}.pi"].astype(np.float32) for p in picks]
    # One colour scale for all panels, stretched to the values present (pi is often far below 1).
    vmax = max(0.05, float(max(np.percentile(p, 99.5) for p in pis)))
    fig, axes = _figure(len(picks), figsize=(3.0 * len(picks) + 1.2, 3.9))
    for i, (ax, path, pi) in enumerate(zip(axes[0], picks, pis, strict=True)):
        im = ax.imshow(pi, cmap="viridis", vmin=0, vmax=vmax, aspect="auto", interpolation="nearest")
        ax.set(title=f"round {int(path.stem.split('_')[1])}", xlabel="input unit")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(MaxNLocator(nbins=4, integer=True))
        if i == 0:
            ax.set_ylabel("output unit")
    fig.colorbar(im, ax=axes[0].tolist(), label="pi = P(s = 1) from Module B", shrink=0.9)
    fig.suptitle(f"Support message v(h->s) of {layer} (grid {pis[0].shape[0]}x{pis[0].shape[1]}) over rounds")
    return fig


def draw_heatmaps(run_dir: Path, out: Path, layer: str = HEATMAP_LAYER, panels: int = 5) -> list[Path]:
    fig = heatmap_figure(run_dir, layer, panels)
    return [] if fig is None else _save(fig, out / f"message_{layer}")


MASK_COLUMNS = 7  # panels per row of the support-mask figure (MobileNetV1 has 28 layers)


def masks_figure(run_dir: Path) -> Figure | None:
    """The final support mask of every layer (black = kept); None when the run has neither messages nor model."""
    run = RunDir(run_dir)
    files = run.message_files()
    if files:
        last = load_file(str(files[-1]))
        source = files[-1].stem
    elif run.model_path.exists():  # a baseline: the nonzeros of its final weights
        weights = load_file(str(run.model_path))
        last = {}
        for key, w in weights.items():
            if key.endswith(".weight_mu"):
                name = key[: -len(".weight_mu")]
                nz = (w != 0) & (weights.get(f"{name}.mask", np.ones_like(w)) != 0)
                last[f"{name}.mask"] = nz.reshape(nz.shape[0], -1).astype(np.uint8)
        source = "model.safetensors"
    else:
        return None
    names = sorted((k[: -len(".mask")] for k in last if k.endswith(".mask")), key=_natural)
    if not names:
        return None
    ncols = min(len(names), MASK_COLUMNS)
    nrows = math.ceil(len(names) / ncols)
    fig, axes = _figure(ncols, nrows, figsize=(2.6 * ncols, 2.9 * nrows + 0.4))
    flat = axes.ravel()
    for ax, name in zip(flat, names, strict=False):
        mask = last[f"{name}.mask"]
        ax.imshow(mask, cmap="Greys", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        ax.set(title=f"{name} {mask.shape[0]}x{mask.shape[1]}\n{100 * mask.mean():.1f}% kept",
               xlabel="input (grid column)", ylabel="output")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(MaxNLocator(nbins=4, integer=True))
    for ax in flat[len(names):]:
        ax.set_axis_off()
    fig.suptitle(f"Final support (nonzero weights) of every layer ({source})")
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(facecolor="black", edgecolor="0.5", label="weight kept (in the support)"),
                        Patch(facecolor="white", edgecolor="0.5", label="weight removed")],
               loc="outside lower center", ncols=2, frameon=False, fontsize=9)
    return fig


def _natural(name: str) -> list[object]:
    """Sort key that orders digits by value: conv2 before conv10 (the model's order for numbered layers)."""
    import re

    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def draw_masks(run_dir: Path, out: Path) -> list[Path]:
    fig = masks_figure(run_dir)
    return [] if fig is None else _save(fig, out / "support_masks")


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
    inference_samples: int | None = None  # how many test images the timed forward pass held

    @property
    def total_bits(self) -> float:
        return self.up_bits + self.down_bits

    def bits_to_reach(self, target: float) -> float | None:
        """Cumulative bits (up + down) at the first evaluated round whose accuracy is >= ``target``."""
        acc = self.metrics["accuracy"]
        hit = np.flatnonzero(np.nan_to_num(acc, nan=-1.0) >= target - 1e-12)
        return float(self.metrics["cum_bits"][hit[0]]) if hit.size else None


def method_label(cfg: object) -> str:
    """A readable name of a run's method and its distinguishing settings (its spec's, :class:`AlgorithmSpec`)."""
    from .algorithms.registry import ALGORITHMS

    algo = cfg.experiment.algorithm  # type: ignore[attr-defined]
    return ALGORITHMS[algo].label_of(cfg) if algo in ALGORITHMS else str(algo)  # type: ignore[arg-type]


def summarize(run_dir: Path, *, inference: bool = True, samples: int = 3000, repeats: int = 5) -> RunSummary:
    """Read one run directory (config.toml, metrics.csv; model.safetensors for the inference time)."""
    run_dir = Path(run_dir)
    run = RunDir(run_dir)
    cfg = run.config()
    m = read_metrics(run_dir)
    if not m or "accuracy" not in m:
        raise ValueError(f"{run_dir}/metrics.csv holds no rounds")
    acc = m["accuracy"]
    label = method_label(cfg)
    scheduled = m.get("scheduled_density")
    if scheduled is not None and abs(float(scheduled[-1]) - float(m["density"][-1])) > 0.02:
        label += f", {float(m['density'][-1]):.0%} reached"  # a target the run did not reach is not its label
    summary = RunSummary(
        run_dir=run_dir, label=label, algorithm=cfg.experiment.algorithm, rounds=int(m["round"][-1]),
        final_accuracy=float(acc[-1]), best_accuracy=float(np.nanmax(acc)), density=float(m["density"][-1]),
        up_bits=float(m["up_bits"].sum()), down_bits=float(m["down_bits"].sum()), metrics=m,
    )
    # a model of one's own (model.name "custom") cannot be rebuilt from the run directory: no timing for it
    if inference and run.model_path.exists() and cfg.model.name != "custom":
        from .data import DataError

        try:
            summary.inference_ms, summary.inference_samples = time_inference(run_dir, cfg, samples=samples,
                                                                              repeats=repeats)
        except DataError:  # the data is not on this machine: the column stays empty
            summary.inference_ms = summary.inference_samples = None
    return summary


def _run_dataset(cfg: object, limit_test: int) -> object:
    """The run's data, normalised exactly as in the run (same training subset statistics)."""
    from .data import load_dataset

    d = cfg.data  # type: ignore[attr-defined]
    return load_dataset(d.name, d.path, limit_train=d.limit_train, limit_test=limit_test,
                        seed=cfg.experiment.seed, standardize=d.standardize)  # type: ignore[attr-defined]


@torch.no_grad()
def time_inference(run_dir: Path, cfg: object, *, samples: int = 3000, repeats: int = 5) -> tuple[float, int]:
    """(median wall time in ms, images) of one forward pass of up to ``samples`` test images (fewer when the
    test set is smaller) through the saved model, as a masked dense network in eval mode (Table I's column;
    :mod:`dturbo.export` removes the zeros for speed)."""
    x = torch.from_numpy(_run_dataset(cfg, samples).x_test[:samples])  # first: DataError when it is elsewhere
    model = RunDir(run_dir).load_model(cfg)  # type: ignore[arg-type]
    model(x)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(x)
        times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times)), int(x.shape[0])


def inference_time_ms(run_dir: Path, cfg: object, *, samples: int = 3000, repeats: int = 5) -> float:
    """The time of :func:`time_inference` alone."""
    return time_inference(run_dir, cfg, samples=samples, repeats=repeats)[0]


def comparison_figure(runs: list[RunSummary]) -> Figure:
    """Accuracy vs cumulative communication bits (log x), one curve per method (the paper's Fig. 2); the legend
    sits below the axes so that it never hides a curve."""
    fig, axes = _figure(1, figsize=(8.0, 4.4 + 0.22 * len(runs)))
    ax = axes[0, 0]
    for i, r in enumerate(runs):
        m = r.metrics
        ok = ~np.isnan(m["accuracy"])
        ax.semilogx(m["cum_bits"][ok], 100 * m["accuracy"][ok], "o-", ms=3, color=f"C{i % 10}",
                    label=f"{r.label}: {100 * r.final_accuracy:.1f}%, {100 * r.density:.0f}% nonzero")
    ax.set(xlabel="cumulative communication, up + down (log scale)", ylabel="test accuracy (%)",
           title="Accuracy vs communication")
    ax.grid(alpha=0.3, which="major")
    ax.grid(alpha=0.15, which="minor")
    fig.legend(loc="outside lower center", fontsize=8, ncols=1, frameon=False)
    bits_log_axis(ax)
    return fig


def draw_comparison(runs: list[RunSummary], out: Path) -> list[Path]:
    return _save(comparison_figure(runs), out / "accuracy_vs_bits")


def _fmt_bits(b: float | None) -> str:
    if b is None:
        return "not reached"
    return f"{b / 1e6:,.1f} Mbit"


def _inference_counts(runs: list[RunSummary]) -> list[int]:
    return sorted({r.inference_samples for r in runs if r.inference_samples is not None})


def inference_column(runs: list[RunSummary]) -> str:
    """The inference column's name, after the number of test images really timed: ``inference 3000 samples
    (ms)``; ``inference ms [samples]`` (each cell ``12.3 [400]``) when the runs timed different numbers."""
    counts = _inference_counts(runs)
    if not counts:
        return "inference (ms)"
    if len(counts) == 1:
        return f"inference {counts[0]} samples (ms)"
    return "inference ms [samples]"


def _inference_cell(r: RunSummary, mixed: bool) -> str:
    if r.inference_ms is None:
        return ""
    return f"{r.inference_ms:.1f} [{r.inference_samples}]" if mixed else f"{r.inference_ms:.1f}"


def comparison_table(runs: list[RunSummary], targets: list[float]) -> tuple[str, str]:
    """(Markdown, CSV) of the comparison (the paper's Table I, with bits)."""
    head = ["method", "run", "rounds", "final accuracy (%)", "nonzero weights (%)", "bits up (Mbit)",
            "bits down (Mbit)", "bits total (Mbit)"]
    head += [f"bits to {100 * t:.1f}% (Mbit)" for t in targets]
    head += [inference_column(runs)]
    mixed = len(_inference_counts(runs)) > 1
    rows = []
    for r in runs:
        row = [r.label, r.run_dir.name, str(r.rounds), f"{100 * r.final_accuracy:.2f}", f"{100 * r.density:.1f}",
               f"{r.up_bits / 1e6:.1f}", f"{r.down_bits / 1e6:.1f}", f"{r.total_bits / 1e6:.1f}"]
        for t in targets:
            b = r.bits_to_reach(t)
            row.append("not reached" if b is None else f"{b / 1e6:.1f}")
        row.append(_inference_cell(r, mixed))
        rows.append(row)
    md = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    md += ["| " + " | ".join(row) + " |" for row in rows]
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(head)
    writer.writerows(rows)
    return "\n".join(md) + "\n", buf.getvalue()


def default_target(final: list[float]) -> float:
    """The accuracy the bits-to-reach column uses by default: the lowest final accuracy among the runs that learned
    (ended at half the best run's final accuracy or above), rounded down to 0.1 point: every such run reaches it, so
    their bits compare; a run that never learned reads "never" instead of pulling the target down to chance."""
    best = max(final)
    return math.floor(1000 * min(a for a in final if a >= best / 2)) / 1000


def compare(run_dirs: list[Path], out: Path, *, targets: list[float] | None = None, inference: bool = False,
            per_run_figures: bool = True) -> tuple[list[RunSummary], list[Path]]:
    """The multi-run report into ``out``: accuracy_vs_bits.{png,svg}, comparison.{md,csv}, and each run's own
    figures in ``out/<run name>/``. Default target: :func:`default_target`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [summarize(Path(d), inference=inference) for d in run_dirs]
    if targets is None:
        targets = [default_target([r.final_accuracy for r in runs])]
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
    out = Path(out) if out else RunDir(run_dir).figures_dir
    out.mkdir(parents=True, exist_ok=True)
    return draw_curves(run_dir, out) + draw_heatmaps(run_dir, out) + draw_masks(run_dir, out)
