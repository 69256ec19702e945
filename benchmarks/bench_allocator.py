"""What glibc's allocator does to a speedup, and what conv1 costs by output channels (docs/export.md).

1. One run's exported model against the same network dense (3000 Fashion-MNIST test images, channels_last with
   kernels chosen by timing, networks timed interleaved, per-layer times too), in two fresh processes: glibc's
   default allocator, and freed memory kept for reuse (:func:`dturbo.kernels.keep_freed_memory`). With the
   defaults every block above 32 MiB is fresh page-faulted memory on every pass: the dense network's large
   activations pay that, a thinned network's smaller ones do not.
2. conv1's shape (1 input channel, 7x7, 'same', 28x28 images) with 1 to 16 output channels, oneDNN against
   PyTorch's native kernel, NCHW and channels_last, freed memory kept: what removing conv1's channels buys.

Usage (from the repository root): .venv/bin/python benchmarks/bench_allocator.py [RUN_DIR] [--threads 2]
Writes ``benchmarks/results/allocator.json`` and ``allocator.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RUN = ROOT / "runs" / "frontier" / "speed_channels_cost_lr3e-3_s0"
CONV1_CHANNELS = (1, 2, 3, 4, 6, 8, 16)


def child(run_dir: Path, threads: int, keep: bool, samples: int) -> dict[str, Any]:
    """In this (fresh) process: the two networks' times, whole and per layer, and (kept) the conv1 sweep."""
    import torch
    from bench_inference import SETTINGS, interleaved, load_as, per_layer_ms
    from frontier import PROTOCOL

    from dturbo.data import load_dataset
    from dturbo.export import export_run
    from dturbo.kernels import conv_as, keep_freed_memory, time_call

    kept = keep_freed_memory() if keep else False
    torch.set_num_threads(threads)
    dev = torch.device("cpu")
    x = torch.from_numpy(load_dataset("fashion-mnist", PROTOCOL["data_path"], limit_test=samples, seed=0)
                         .x_test[:samples])
    tmp = Path(tempfile.mkdtemp(prefix="bench_allocator_"))
    export_run(run_dir, tmp / "exported")
    export_run(run_dir, tmp / "dense", compaction=False)  # the same weights, nothing removed
    models = {"dense": load_as(tmp / "dense", "dense", samples, SETTINGS["channels_last"], dev),
              "exported": load_as(tmp / "exported", "auto", samples, SETTINGS["channels_last"], dev)}
    out: dict[str, Any] = {"kept": kept, "ms": interleaved(models, x, 15, dev),
                           "per_layer_ms": {k: per_layer_ms(m, x, dev) for k, m in models.items()}}
    if keep:
        sweep = {}
        with torch.no_grad():
            for cout in CONV1_CHANNELS:
                conv = torch.nn.Conv2d(1, cout, 7, padding=3)
                for cl in (False, True):
                    xx = x.contiguous(memory_format=torch.channels_last) if cl else x
                    for kind in ("default", "native"):
                        m = conv_as(kind, conv)
                        if cl:
                            m = m.to(memory_format=torch.channels_last)
                        key = f"{'channels_last' if cl else 'nchw'}/{'oneDNN' if kind == 'default' else 'native'}"
                        sweep.setdefault(key, {})[cout] = 1000 * time_call(lambda m=m, xx=xx: m(xx), dev)
        out["conv1_ms"] = sweep
    return out


def markdown(res: dict[str, Any]) -> str:
    d, k = res["default"], res["kept"]
    lines = [f"Run `{res['run_dir']}`, {res['samples']} Fashion-MNIST test images, {res['threads']} threads, "
             f"channels_last with kernels chosen by timing, {res['date']}.", "",
             "| allocator | dense (ms) | exported (ms) | speedup |", "|---|---|---|---|"]
    for name, r in (("glibc default", d), ("freed memory kept", k)):
        lines.append(f"| {name} | {r['ms']['dense']:.1f} | {r['ms']['exported']:.1f} | "
                     f"{r['ms']['dense'] / r['ms']['exported']:.2f}x |")
    layers = list(d["per_layer_ms"]["dense"])
    lines += ["", "Per layer (ms, eager, in the channels_last setting):", "",
              "| layer | dense, default | dense, kept | exported, default | exported, kept |", "|---|---|---|---|---|"]
    for name in layers:
        cells = [r["per_layer_ms"][net].get(name) for net in ("dense", "exported") for r in (d, k)]
        lines.append(f"| {name} | " + " | ".join("-" if c is None else f"{c:.1f}" for c in cells) + " |")
    sweep = k["conv1_ms"]  # as read back from JSON: channel counts are text
    lines += ["", "conv1's shape (1 -> c channels, 7x7, 'same', 28x28), freed memory kept (ms):", "",
              "| output channels | " + " | ".join(sweep) + " |", "|---|" + "---|" * len(sweep)]
    for c in CONV1_CHANNELS:
        lines.append(f"| {c} | " + " | ".join(f"{v[str(c)]:.1f}" for v in sweep.values()) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, nargs="?", default=RUN)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--child", choices=["default", "kept"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        sys.path.insert(0, str(HERE))
        print(json.dumps(child(args.run_dir, args.threads, args.child == "kept", args.samples)))
        return
    if not (args.run_dir / "model.safetensors").exists():
        raise SystemExit(f"{args.run_dir} has no model.safetensors: train it first "
                         "(python benchmarks/speed_frontier.py --stage train)")
    res: dict[str, Any] = {"run_dir": os.path.relpath(args.run_dir.resolve(), ROOT), "threads": args.threads,
                           "samples": args.samples, "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}
    for mode in ("default", "kept"):  # a fresh process each: the allocator setting lasts a process
        out = subprocess.run([sys.executable, __file__, str(args.run_dir), "--threads", str(args.threads),
                              "--samples", str(args.samples), "--child", mode],
                             capture_output=True, text=True, check=True)
        res[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{mode}: {res[mode]['ms']}", flush=True)
    (HERE / "results" / "allocator.json").write_text(json.dumps(res, indent=1) + "\n")
    md = markdown(json.loads(json.dumps(res)))
    (HERE / "results" / "allocator.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
