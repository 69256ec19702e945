"""Speed of any run's final model: exported (whole channels and units removed, kernels chosen by timing) against the
same weights run dense (nothing removed, dense kernels), on the same test images, interleaved.

* ``speedup``: dense time / exported time at the first batch size (3000 images), each network in its best
  execution setting (eager, PyTorch's defaults; channels_last with convolution and pooling kernels chosen by timing;
  torch.compile with ``--compile``), in each of ``sessions`` timing sessions (both networks loaded afresh: kernel
  choice, allocation and thread placement redone), the median over sessions;
* the same at the other batch sizes, and batch-1 latency.

A final model with no zero weight (FedAvg's, FedPAQ's, STC's) is the dense network: its speedup is 1.0 by
definition and nothing is timed (``--time-dense`` times it anyway).

Usage: .venv/bin/python benchmarks/speed.py RUN_DIR [RUN_DIR ...] [--out FILE.json] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_inference import SETTINGS, interleaved, load_as, machine, reuse_memory, settings_for  # noqa: E402

from dturbo.export import export_run  # noqa: E402

REPEATS = {3000: 15, 64: 60, 1: 300}


def zero_weights(run_dir: Path) -> int:
    """Weights of a run's final model that are exactly zero (mu * mask of every layer)."""
    from safetensors.torch import load_file

    state = load_file(str(run_dir / "model.safetensors"))
    zeros = 0
    for key, mu in state.items():
        if key.endswith(".weight_mu"):
            mask = state.get(key[: -len("weight_mu")] + "mask", torch.ones_like(mu))
            zeros += int(((mu * mask) == 0).sum())
    return zeros


def time_pair(exported: Path, dense: Path, x: torch.Tensor, *, batches: tuple[int, ...] = (3000, 64, 1),
              threads: tuple[int, ...] = (2,), sessions: int = 3, compile_too: bool = False,
              dev: torch.device = torch.device("cpu")) -> dict[str, Any]:
    """Dense vs exported ms at every batch size, setting and thread count, interleaved, in ``sessions`` sessions;
    the speedups of each session and their median (module docstring)."""
    settings = settings_for(dev, compile_too)
    ms: dict[str, dict[str, dict[str, dict[str, list[float]]]]] = {
        str(t): {str(b): {k: {"dense": [], "exported": []} for k in settings} for b in batches} for t in threads}
    for _ in range(sessions):
        for t in threads:
            torch.set_num_threads(t)
            for b in batches:
                xb = x[:b].to(dev)
                for name in settings:
                    torch._dynamo.reset()
                    models = {"dense": load_as(dense, "dense", b, SETTINGS[name], dev),
                              "exported": load_as(exported, "auto", b, SETTINGS[name], dev)}
                    for net, v in interleaved(models, xb, REPEATS.get(b, 15), dev).items():
                        ms[str(t)][str(b)][name][net].append(round(v, 4))
    torch.set_num_threads(threads[0])

    def best(t: int, b: int, net: str) -> np.ndarray:
        """Per session: the network's time in its best setting."""
        return np.min([v[net] for v in ms[str(t)][str(b)].values()], axis=0)

    def ratio(t: int, b: int, setting: str | None = None) -> np.ndarray:
        if setting is None:
            return best(t, b, "dense") / best(t, b, "exported")
        v = ms[str(t)][str(b)][setting]
        return np.asarray(v["dense"]) / np.asarray(v["exported"])

    t0, b0 = threads[0], batches[0]
    per_session = ratio(t0, b0)
    rec: dict[str, Any] = {
        "ms": ms, "speedup": float(np.median(per_session)),
        "speedup_sessions": [round(float(r), 3) for r in per_session],
        "speedup_eager": float(np.median(ratio(t0, b0, "eager"))),
    }
    for b in batches[1:]:
        rec[f"speedup_batch{b}"] = float(np.median(ratio(t0, b)))
    if 1 in batches:
        rec["latency_batch1_ms"] = float(np.median(best(t0, 1, "exported")))
        rec["latency_batch1_dense_ms"] = float(np.median(best(t0, 1, "dense")))
    for t in threads[1:]:
        rec[f"speedup_{t}thread"] = float(np.median(ratio(t, b0)))
        if 1 in batches:
            rec[f"latency_batch1_{t}thread_ms"] = float(np.median(best(t, 1, "exported")))
    return rec


def time_model(run_dir: Path, x: torch.Tensor, threads: tuple[int, ...], sessions: int, compile_too: bool,
               dev: torch.device, batches: tuple[int, ...] = (3000, 64, 1)) -> dict[str, Any]:
    """A run directory exported (into a temporary folder) and timed (:func:`time_pair`), with what export kept."""
    tmp = Path(tempfile.mkdtemp(prefix="speed_"))
    totals = export_run(run_dir, tmp / "exported").spec()["totals"]
    export_run(run_dir, tmp / "dense", compaction=False)  # the same weights, nothing removed
    rec = time_pair(tmp / "exported", tmp / "dense", x, batches=batches, threads=threads, sessions=sessions,
                    compile_too=compile_too, dev=dev)
    return {"run_dir": str(run_dir), "export_totals": totals, **rec}


def test_images(run_dir: Path, samples: int) -> torch.Tensor:
    """The first ``samples`` test images of a run's own data, as its readers return them."""
    from dturbo.data import load_dataset
    from dturbo.rundir import RunDir

    cfg = RunDir(run_dir).config()
    ds = load_dataset(cfg.data.name, cfg.data.path, limit_test=samples, seed=0)
    return torch.from_numpy(ds.x_test[:samples])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (with model.safetensors)")
    ap.add_argument("--out", type=Path, default=None, help="write the records here (JSON)")
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--threads", type=int, nargs="+", default=[2])
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[3000, 64, 1])
    ap.add_argument("--compile", action="store_true", help="also time torch.compile")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--time-dense", action="store_true", help="time models with no zero weight too")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    allocator = reuse_memory()
    records = []
    for run_dir in args.runs:
        if not (run_dir / "model.safetensors").exists():
            raise SystemExit(f"{run_dir}: no model.safetensors (a finished run directory is needed)")
        if not args.time_dense and zero_weights(run_dir) == 0:
            rec: dict[str, Any] = {"run_dir": str(run_dir), "speedup": 1.0, "timed": False,
                                   "why": "no zero weight: the final model is the dense network"}
        else:
            x = test_images(run_dir, args.samples)
            rec = {**time_model(run_dir, x, tuple(args.threads), args.sessions, args.compile, dev,
                                tuple(args.batches)), "timed": True}
        print(f"{run_dir}: speedup {rec['speedup']:.2f}x" + (f" (sessions {rec['speedup_sessions']})"
                                                               if rec["timed"] else " (dense, not timed)"),
              flush=True)
        records.append(rec)
    if args.out is not None:
        args.out.write_text(json.dumps({"machine": machine(allocator), "device": dev.type,
                                        "batches": args.batches, "threads": args.threads,
                                        "sessions": args.sessions, "runs": records}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
