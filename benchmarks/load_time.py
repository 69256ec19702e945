"""How long ``dturbo.export.load`` takes with its defaults, in a fresh process each time, as a user's script pays it.

Two exported models: the built-in ``alexnet-small`` (Fashion-MNIST's shape) with every conv keeping a seeded 40% of
its output channels (so export removes units and the sparse kernels are timed), and a small residual CNN with
BatchNorm of one's own, exported as a graph. Each is loaded ``--repeats`` times, each time in a new Python process:
the import of ``dturbo.export`` and the ``load()`` call are timed apart. The first load times the kernels and
writes them to ``choices.json`` (and builds the native conv kernel if this machine has never built it); the later
ones apply them. The machine's load average is recorded beside the times: a busy machine
reads slower. Writes ``benchmarks/results/load_time.{json,md}``.

Usage: .venv/bin/python benchmarks/load_time.py [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from dturbo.testing import Residual  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
GOAL_S = 1.0  # a later load; the first (it times the kernels, the native one built at setup) at most FIRST_GOAL_S
FIRST_GOAL_S = 5.0

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads(int(sys.argv[2]))
import dturbo.export as ex
t1 = time.perf_counter()
m = ex.load(sys.argv[1])
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "kernels": m.kernels, "channels_last": m.channels_last,
                  "compiled": m.compiled}))
"""


class SmallResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.block = Residual(16)
        self.head = nn.Linear(16 * 7 * 7, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(F.max_pool2d(self.block(self.stem(x)), 4), 1))


def export_models(folder: Path) -> dict[str, Path]:
    import dturbo
    from dturbo.export import export_model
    from dturbo.nn import bayesian_layers
    from dturbo.nn.models import build_model

    x = torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    alex = build_model("alexnet-small", (1, 28, 28), 10, seed=0)
    g = torch.Generator().manual_seed(1)
    for _, layer in bayesian_layers(alex):
        if isinstance(layer, nn.Conv2d) or layer.weight_mu.dim() == 4:
            keep = (torch.rand(layer.weight_mu.shape[0], generator=g) < 0.4).float()
            with torch.no_grad():
                layer.weight_mu.mul_(keep.view(-1, *[1] * (layer.weight_mu.dim() - 1)))
    torch.manual_seed(0)
    own = dturbo.bayesianize(SmallResNet())
    out = {"alexnet-small, 40% of conv channels": folder / "alex", "residual CNN with BatchNorm (own)": folder / "res"}
    export_model(alex, out["alexnet-small, 40% of conv channels"], example_input=x)
    export_model(own, out["residual CNN with BatchNorm (own)"], example_input=x)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="loads per model, at least 2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, path in export_models(Path(tmp)).items():
            runs = []
            for i in range(args.repeats):
                load_avg = os.getloadavg()[0]
                out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(args.threads)], env=env,
                                     capture_output=True, text=True, check=True)
                rec = json.loads(out.stdout.strip().splitlines()[-1])
                runs.append({**rec, "load_average": load_avg})
                print(f"{label}, load {i + 1}: import {rec['import_s']:.2f} s, load() {rec['load_s']:.2f} s "
                      f"(load average {load_avg:.1f})", flush=True)
            later = [r["load_s"] for r in runs[1:]]
            rows.append({"model": label, "runs": runs, "first_load_s": runs[0]["load_s"],
                         "later_median_load_s": statistics.median(later), "later_max_load_s": max(later),
                         "median_import_s": statistics.median(r["import_s"] for r in runs),
                         "kernels": runs[-1]["kernels"], "channels_last": runs[-1]["channels_last"]})
    res = {"what": "dturbo.export.load(model_dir) with its defaults, each in a fresh process", "goal_s": GOAL_S,
           "first_goal_s": FIRST_GOAL_S,
           "threads": args.threads, "repeats": args.repeats, "cpu": platform.processor() or platform.machine(),
           "cores": os.cpu_count(), "torch": torch.__version__, "date": datetime.now(UTC).date().isoformat(),
           "models": rows}
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "load_time.json").write_text(json.dumps(res, indent=1) + "\n")
    lines = ["# Loading an exported model", "", f"`dturbo.export.load(model_dir)` with its defaults, each load in a "
             f"fresh Python process, {args.threads} torch threads, {args.repeats} loads per model, on "
             f"{res['cores']} cores (`benchmarks/load_time.py`), after `scripts/setup.sh` built the native kernel. "
             f"Goal: the first load at most {FIRST_GOAL_S:g} s, a later one at most {GOAL_S:g} s.", "",
             "| model | first load() (times kernels) | later loads: median, slowest | import of dturbo.export | "
             "load average |", "|---|---|---|---|---|"]
    for r in rows:
        avg = statistics.median(x["load_average"] for x in r["runs"])
        lines.append(f"| {r['model']} | {r['first_load_s']:.2f} s | {r['later_median_load_s']:.2f} s, "
                     f"{r['later_max_load_s']:.2f} s | {r['median_import_s']:.2f} s | {avg:.1f} |")
    (args.results / "load_time.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
