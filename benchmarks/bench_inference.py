"""Inference speed of an exported model (``dturbo export``) against the same network dense.

For a run directory, five networks compute on the same test samples (default 3000 Fashion-MNIST images):

* ``exported``: the run's model after export (all-zero rows/columns/channels removed across layers, kernels
  per linear layer chosen by timing at this batch size);
* ``dense``: the same weights (``weight_mu * mask``) in the same torch layers, nothing removed, dense kernels;
* ``unstructured``: a model magnitude-pruned per layer to the same per-layer density (the same number of
  nonzeros, spread without structure), exported the same way as ``exported``. Its weights come from a dense
  run (``--unstructured-from``, default ``runs/fmnist_compare/fedavg`` when it exists): pruning the run's own
  weights again would give back its own mask;
* what-ifs ``channel_pruned`` / ``channel_uniform``: the structure export removes. Each layer but the
  classifier keeps its top ``d x units`` output channels/units by L2 norm, d = the layer's own density /
  the run's overall density (not retrained, so their accuracy is low): what the export gives when training
  leaves whole channels zero.

Each is timed under three execution settings: eager (PyTorch's defaults: NCHW, oneDNN convolutions, PyTorch's
max-pooling), channels_last with each convolution's kernel (default = oneDNN, or native) and each max-pooling's
(default, or separable: strided maxima, the same values) chosen by timing, and that plus ``torch.compile`` kept
for a network only where its own timing at load finds it faster ("best"; every network gets the same menu).
Within a setting the networks are timed interleaved in one loop (median of ``--repeats`` passes each), so a
ratio is measured in one run under the same machine load. A per-layer table (eager, in the setting's memory
format) shows where the time goes. CUDA is used when available (CUDA events for timing).

Usage (from the repository root): .venv/bin/python benchmarks/bench_inference.py RUN_DIR [--out benchmarks/results]
    [--samples 3000] [--repeats 15] [--no-compile] [--unstructured-from DENSE_RUN_DIR]
Writes ``inference.json`` and ``inference.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import torch

from dturbo.export import Exported, InferenceModel, export_run, export_state, load, read_run, save
from dturbo.kernels import choose_linear_kernel, keep_freed_memory, sync

RESULTS = Path(__file__).resolve().parent / "results"
DENSE_RUN = Path(__file__).resolve().parents[1] / "runs" / "fmnist_compare" / "fedavg"


class Setting(NamedTuple):
    """How a network is loaded for timing (:func:`dturbo.export.load`'s arguments of the same names)."""

    channels_last: bool | None
    compile: bool | None  # None: kept where the load's timing finds it faster
    conv: str
    pool: str
    cuda_graph: bool = False  # a GPU only: the whole pass as one CUDA graph replay


# "eager" is PyTorch's defaults; "cuda_graph" runs on a GPU only (the memory format timed at load).
SETTINGS = {"eager": Setting(False, False, "default", "default"), "channels_last": Setting(True, False, "auto", "auto"),
            "best": Setting(True, None, "auto", "auto"), "cuda_graph": Setting(None, False, "auto", "auto", True)}


def settings_for(dev: torch.device, compile_too: bool) -> list[str]:
    """The settings timed on ``dev``: torch.compile's only with ``compile_too``, CUDA graphs only on a GPU."""
    return [k for k, v in SETTINGS.items()
            if (compile_too or v.compile is False) and (dev.type == "cuda" or not v.cuda_graph)]


NETS = ("exported", "dense", "unstructured", "channel_pruned", "channel_uniform")
WHAT_IF = ("channel_pruned", "channel_uniform")


def _nonzeros(state: dict[str, torch.Tensor], base: str) -> int:
    w = state[f"{base}.weight_mu"].float() * state.get(f"{base}.mask", torch.ones_like(state[f"{base}.weight_mu"]))
    return int((w != 0).sum())


def magnitude_pruned(state: dict[str, torch.Tensor], like: dict[str, torch.Tensor] | None = None
                     ) -> dict[str, torch.Tensor]:
    """``state`` with every layer's mask replaced by the top-|w| mask (w = mu * mask) with as many nonzeros as
    that layer has in ``like`` (default: in ``state``)."""
    out = dict(state)
    for key in state:
        if not key.endswith(".weight_mu"):
            continue
        base = key[: -len(".weight_mu")]
        w = state[key].float() * state.get(f"{base}.mask", torch.ones_like(state[key])).float()
        nnz = _nonzeros(like if like is not None else state, base)
        flat = torch.zeros(w.numel())
        if nnz:
            flat[torch.topk(w.abs().flatten(), nnz).indices] = 1.0
        out[f"{base}.mask"] = flat.reshape(w.shape)
    return out


def channel_pruned(state: dict[str, torch.Tensor], density: float | None = None) -> dict[str, torch.Tensor]:
    """A what-if with the structure export removes: every layer but the classifier keeps its
    ``round(d * units)`` output channels/units of largest L2 norm (w = mu * mask; d = ``density``, or each
    layer's own density when None), dense inside; a dropped unit's bias is zeroed too (the unit is gone).
    The classifier keeps its mask. Not retrained: its accuracy is low."""
    out = dict(state)
    layers = [k[: -len(".weight_mu")] for k in state if k.endswith(".weight_mu")]
    last = max((b for b in layers if b.startswith("dense")), key=lambda b: int(b[5:]), default=None)
    for base in layers:
        if base == last:
            continue
        mu = state[f"{base}.weight_mu"].float()
        w = mu * state.get(f"{base}.mask", torch.ones_like(mu)).float()
        units = w.shape[0]
        d = float((w != 0).float().mean()) if density is None else density
        keep = max(1, round(d * units))
        rows = torch.zeros(units)
        rows[torch.topk(w.reshape(units, -1).norm(dim=1), keep).indices] = 1.0
        out[f"{base}.mask"] = rows.reshape(-1, *([1] * (w.dim() - 1))).expand_as(w).contiguous()
        if f"{base}.bias" in state:
            out[f"{base}.bias"] = state[f"{base}.bias"] * rows
    return out


def timed(fn: Any, x: torch.Tensor, device: torch.device) -> float:
    """Seconds of one call ``fn(x)`` (CUDA events on a GPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0
    t0 = time.perf_counter()
    fn(x)
    return time.perf_counter() - t0


@torch.no_grad()
def interleaved(models: dict[str, InferenceModel], x: torch.Tensor, repeats: int, device: torch.device
                ) -> dict[str, float]:
    """Median ms per network, timed round-robin (one pass of each per round; the order rotates from round to
    round so that no network always follows the same one)."""
    for m in models.values():  # warm-up (and compilation)
        for _ in range(3):
            m(x)
    sync(device)
    times: dict[str, list[float]] = {k: [] for k in models}
    names = list(models)
    for i in range(repeats):
        for k in names[i % len(names):] + names[: i % len(names)]:
            times[k].append(timed(models[k], x, device))
    return {k: 1000 * statistics.median(v) for k, v in times.items()}


@torch.no_grad()
def per_layer_ms(model: InferenceModel, x: torch.Tensor, device: torch.device, repeats: int = 7) -> dict[str, float]:
    """Median ms of each of the network's modules (eager) on its real input."""
    out: dict[str, float] = {}
    h = model.prepare(x)
    for name, mod in model.net.named_children():
        mod(h)
        ts = [timed(mod, h, device) for _ in range(repeats)]
        out[name] = 1000 * statistics.median(ts)
        h = mod(h)
    return out


def load_as(model_dir: Path, kernels: str, batch: int, setting: Setting, dev: torch.device) -> InferenceModel:
    return load(model_dir, batch_size=batch, kernels=kernels, device=dev, **setting._asdict())


def reuse_memory() -> str:
    """Both networks are timed with freed memory kept for reuse (:func:`dturbo.kernels.keep_freed_memory`):
    with glibc's defaults a dense network's large activations are fresh page-faulted pages on every pass, and a
    ratio against it measures the allocator (docs/export.md). Returns the words the results record."""
    if keep_freed_memory():
        return "glibc, freed blocks of up to 1 GiB kept for reuse (dturbo.kernels.keep_freed_memory)"
    return "the platform's default (not glibc: nothing changed)"


def machine(allocator: str) -> dict[str, Any]:
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "allocator": allocator,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            # PyTorch's defaults on a GPU: convolutions in TF32 (the matrix units' 10-bit mantissa), matmuls not
            **({"cuda_tf32": {"cudnn": torch.backends.cudnn.allow_tf32,
                              "matmul": torch.backends.cuda.matmul.allow_tf32}} if torch.cuda.is_available() else {})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile setting")
    ap.add_argument("--unstructured-from", type=Path, default=None,
                    help="dense run whose weights are magnitude-pruned for the unstructured network "
                         f"(default: {DENSE_RUN.relative_to(DENSE_RUN.parents[2])} if it exists, else the run itself)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    allocator = reuse_memory()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    from dturbo.data import load_dataset
    from dturbo.nn.models import build_model

    cfg, state, meta = read_run(args.run_dir)
    d = cfg.data
    ds = load_dataset(d.name, d.path, limit_train=d.limit_train, limit_test=args.samples, seed=cfg.experiment.seed)
    x = torch.from_numpy(ds.x_test[: args.samples]).to(dev)
    y = torch.from_numpy(ds.y_test[: args.samples]).to(dev)
    batch = len(x)

    ref = build_model(cfg.model.name, ds.input_shape, ds.num_classes, sigma_mode=cfg.dturbo.sigma_mode,
                      hidden=cfg.model.hidden, width=cfg.model.width)
    ref.load_state_dict(state, strict=False)
    ref = ref.to(dev).eval()
    with torch.no_grad():
        ref_out = ref(x)

    bases = [k[: -len(".weight_mu")] for k in state if k.endswith(".weight_mu")]
    density = sum(_nonzeros(state, b) for b in bases) / sum(state[f"{b}.weight_mu"].numel() for b in bases)
    kw = {"hidden": cfg.model.hidden, "width": cfg.model.width, "num_classes": ds.num_classes}
    source = args.unstructured_from or (DENSE_RUN if (DENSE_RUN / "model.safetensors").exists() else None)
    if source is not None:
        src_cfg, src_state, _ = read_run(source)
        if src_cfg.model != cfg.model:
            raise SystemExit(f"--unstructured-from {source}: model {src_cfg.model} differs from the run's {cfg.model}")
        unstructured = magnitude_pruned(src_state, like=state)
    else:
        unstructured = magnitude_pruned(state)
    other_weights = source is not None and Path(source).resolve() != Path(args.run_dir).resolve()
    tmp = Path(tempfile.mkdtemp(prefix="bench_inference_"))
    exports: dict[str, Exported] = {
        "exported": export_run(args.run_dir, tmp / "exported"),
        "dense": export_state(cfg.model.name, state, ds.input_shape, compaction=False, **kw),
        "unstructured": export_state(cfg.model.name, unstructured, ds.input_shape, **kw),
        "channel_pruned": export_state(cfg.model.name, channel_pruned(state), ds.input_shape, **kw),
        "channel_uniform": export_state(cfg.model.name, channel_pruned(state, density), ds.input_shape, **kw),
    }
    for n in NETS[1:]:
        save(exports[n], tmp / n)
    kernels = {n: "dense" if n == "dense" else "auto" for n in NETS}

    settings = {k: SETTINGS[k] for k in settings_for(dev, not args.no_compile)}
    results: dict[str, Any] = {"settings": {}}
    per_layer: dict[str, dict[str, dict[str, float]]] = {}
    chosen: dict[str, dict[str, str]] = {}
    checks: dict[str, dict[str, float]] = {}
    accuracy: dict[str, float] = {}
    for sname, setting in settings.items():
        cl, comp, conv, pool, graph = setting
        torch._dynamo.reset()
        t0 = time.perf_counter()
        models = {n: load_as(tmp / n, kernels[n], batch, setting, dev) for n in NETS}
        load_s = time.perf_counter() - t0
        ms = interleaved(models, x, args.repeats, dev)
        entry: dict[str, Any] = {
            "channels_last": "auto" if cl is None else cl, "compile": "auto" if comp is None else comp, "conv": conv,
            "pool": pool, "cuda_graph": graph, "graphed": {n: m.graphed for n, m in models.items()},
            "load_and_choose_s": round(load_s, 2), "pools": {n: dict(m.pools) for n, m in models.items()},
            "kernels": {n: dict(m.kernels) for n, m in models.items()},
            "compiled": {n: m.compiled for n, m in models.items()},
            "ms": {n: round(v, 3) for n, v in ms.items()},
            "speedup_exported_vs_dense": ms["dense"] / ms["exported"],
            "speedup_unstructured_vs_dense": ms["dense"] / ms["unstructured"],
            **{f"speedup_{n}_vs_dense": ms["dense"] / ms[n] for n in WHAT_IF},
        }
        for n, m in models.items():
            if "compile_error" in m.info:
                entry.setdefault("compile_error", {})[n] = m.info["compile_error"]
            with torch.no_grad():
                out = m(x)
            if n in WHAT_IF or (n == "unstructured" and other_weights):  # another function: its accuracy only
                accuracy[n] = float((out.argmax(1) == y).float().mean())
            else:
                checks.setdefault(n, {})[sname] = float((out - ref_out).abs().max())
            chosen.setdefault(n, {}).update({k: v for k, v in m.kernels.items()})
        if comp is False and not graph:
            per_layer[sname] = {n: per_layer_ms(models[n], x, dev) for n in ("exported", "dense", *WHAT_IF)}
        results["settings"][sname] = entry
        print(f"{sname:>14}: " + "  ".join(f"{n} {v:.1f} ms" for n, v in ms.items())
              + f"  speedup {entry['speedup_exported_vs_dense']:.2f}x (unstructured "
              f"{entry['speedup_unstructured_vs_dense']:.2f}x, what-ifs "
              + ", ".join(f"{entry[f'speedup_{n}_vs_dense']:.2f}x" for n in WHAT_IF)
              + f")  [load {load_s:.1f} s]", flush=True)
        del models

    eager_dense = results["settings"]["eager"]["ms"]["dense"]
    top = "best" if "best" in settings else "channels_last"
    results["speedup_exported_best_vs_dense_eager"] = eager_dense / results["settings"][top]["ms"]["exported"]

    # Kernel choice for the exported model's linear layers at a few batch sizes (times in ms per candidate).
    kernel_choice: dict[str, dict[str, Any]] = {}
    for op in exports["exported"].ops:
        if op.type == "linear" and op.weight is not None:
            kernel_choice[op.name] = {}
            for b in (1, 64, batch):
                with torch.no_grad():
                    _, kind, times = choose_linear_kernel(op.weight.to(dev), None if op.bias is None
                                                          else op.bias.to(dev), b, device=dev)
                kernel_choice[op.name][str(b)] = {"kernel": kind, "ms": {k: round(v, 4) for k, v in times.items()}}

    with torch.no_grad():
        acc_ref = float((ref_out.argmax(1) == y).float().mean())
    results.update({
        "run_dir": str(args.run_dir), "run_config": cfg.to_dict(),
        "model": meta.get("model", cfg.model.name), "dataset": d.name,
        "samples": batch, "repeats": args.repeats, "device": str(dev), "machine": machine(allocator),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "accuracy_masked_model": acc_ref, "accuracy_what_if_not_retrained": accuracy, "density": density,
        "unstructured_from": os.path.relpath(source, Path(__file__).resolve().parents[1]) if other_weights
        else "the run itself",
        "max_abs_error_vs_masked_model": checks,
        "totals": {n: e.spec()["totals"] for n, e in exports.items()},
        "layers": {n: e.layers for n, e in exports.items()},
        "kernels": chosen, "kernel_choice_by_batch": kernel_choice, "per_layer_ms": per_layer,
        "load_ms_best_setting_note": "load_and_choose_s includes kernel timing and torch.compile",
    })
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "inference.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "inference.md").write_text(markdown(results))
    print(f"wrote {args.out / 'inference.json'} and {args.out / 'inference.md'}")
    return 0


def _shape(s: list[int]) -> str:
    return "x".join(map(str, s))


def markdown(r: dict[str, Any]) -> str:
    """The results as Markdown tables."""
    lines = [
        "# Inference: exported (structured-sparse) model vs the same network dense",
        "",
        f"run `{r['run_dir']}` ({r['model']}, {r['dataset']}, config `{r['run_config']['experiment']['name']}`, "
        f"{r['run_config']['experiment']['rounds']} rounds, algorithm {r['run_config']['experiment']['algorithm']}), "
        f"{r['samples']} test samples in one batch, "
        f"median of {r['repeats']} passes, device {r['device']}, torch {r['machine']['torch']}, "
        f"{r['machine']['threads']} threads, {r['date']}. Masked model's accuracy on these samples: "
        f"{100 * r['accuracy_masked_model']:.2f}%.",
        "",
        "Weights: " + ", ".join(
            f"{n} {t['weights_after']} kept of {t['weights_before']} ({t['nonzeros']} nonzero, density "
            f"{100 * t['density_before']:.1f}% -> {100 * t['density_after']:.1f}% of the kept shape)"
            for n, t in r["totals"].items()) + ".",
        "",
        "## Forward pass time (ms) and speedup (dense time / time), networks timed interleaved per setting",
        "",
        "| setting | dense | exported | unstructured | what-if per-layer | what-if uniform | exported speedup | "
        "unstructured speedup | what-if per-layer speedup | what-if uniform speedup |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s, e in r["settings"].items():
        ms = e["ms"]
        lines.append(f"| {s} (channels_last={e['channels_last']}, compile={e['compile']}, conv={e['conv']}, "
                     f"pool={e.get('pool', 'default')}) | "
                     + " | ".join(f"{ms[n]:.1f}" for n in NETS[1:2] + NETS[:1] + NETS[2:]) + " | "
                     + " | ".join(f"{e[f'speedup_{n}_vs_dense']:.2f}x" for n in ("exported", "unstructured", *WHAT_IF))
                     + " |")
    acc = r["accuracy_what_if_not_retrained"]
    src = r.get("unstructured_from", "the run itself")
    unstr = ("the run's own weights magnitude-pruned to its per-layer density (this gives back the run's mask "
             "when it is already sparse)" if src == "the run itself" else
             f"the weights of the dense run `{src}` magnitude-pruned to the same per-layer numbers of nonzeros "
             f"(accuracy {100 * acc.get('unstructured', 0):.1f}%, not retrained)")
    lines += ["", "dense: the run's masked weights, nothing removed. exported: the same after `dturbo export`. "
              f"unstructured: {unstr}. What-ifs (structure that export "
              "removes; not retrained, so their accuracy is low): every layer but the classifier keeps its top "
              "d x units output channels/units by L2 norm and zeroes the rest (bias included), with d = the "
              "layer's own density (per-layer: accuracy "
              f"{100 * acc.get('channel_pruned', 0):.1f}%) or d = the run's overall density "
              f"{100 * r['density']:.1f}% (uniform: accuracy {100 * acc.get('channel_uniform', 0):.1f}%). "
              "Shapes after export: " + "; ".join(
                  f"{n}: " + ", ".join(f"{x['name']} {_shape(x['shape_after'])}" for x in r["layers"][n])
                  for n in WHAT_IF) + "."]
    for s, e in r["settings"].items():
        lines.append(f"\nKernels in setting {s}: " + "; ".join(
            f"{n}: " + ", ".join(f"{k} {v}" for k, v in {**ks, **e.get("pools", {}).get(n, {})}.items())
            + (" (compiled)" if e["compiled"][n] else "") for n, ks in e["kernels"].items()) + ".")
    lines += ["", f"Exported model in the best setting vs the dense network run eagerly: "
              f"{r['speedup_exported_best_vs_dense_eager']:.2f}x.", "",
              "Max abs difference from the masked Bayesian model: " + "; ".join(
                  f"{n}: " + ", ".join(f"{s} {v:.1e}" for s, v in c.items())
                  for n, c in r["max_abs_error_vs_masked_model"].items()) + ".", "",
              "## Per layer (exported model; eager timings in the channels_last setting)", "",
              "| layer | shape before | shape after | density before | density after | kernel | ms exported | "
              "ms dense | ms what-if per-layer | ms what-if uniform |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    pl = r["per_layer_ms"].get("channels_last") or r["per_layer_ms"].get("eager", {})
    nan = float("nan")
    for layer in r["layers"]["exported"]:
        n = layer["name"]
        lines.append(
            f"| {n} | {_shape(layer['shape_before'])} | {_shape(layer['shape_after'])} | "
            f"{100 * layer['density_before']:.1f}% | {100 * layer['density_after']:.1f}% | "
            f"{r['kernels']['exported'].get(n, '')} | {pl.get('exported', {}).get(n, nan):.2f} | "
            f"{pl.get('dense', {}).get(n, nan):.2f} | {pl.get('channel_pruned', {}).get(n, nan):.2f} | "
            f"{pl.get('channel_uniform', {}).get(n, nan):.2f} |")
    params = {x["name"] for x in r["layers"]["exported"]}
    for who in ("exported", "dense", *WHAT_IF):
        rest = sum(v for k, v in pl.get(who, {}).items() if k not in params)
        lines.append(f"\nOther operations (activations, pooling, flatten) of the {who} network: {rest:.2f} ms.")
    lines += ["", "## Linear-layer kernel chosen at load by batch size (ms per candidate)", "",
              "| layer | batch | chosen | timings |", "|---|---|---|---|"]
    for n, by_b in r["kernel_choice_by_batch"].items():
        for b, c in by_b.items():
            t = ", ".join(f"{k} {v:.3f}" for k, v in c["ms"].items()) or "(density above the sparse threshold)"
            lines.append(f"| {n} | {b} | {c['kernel']} | {t} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
