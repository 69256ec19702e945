"""BatchNorm under pruning: models with BatchNorm trained by D-Turbo-VBI with the library's defaults, against FedAvg
with float16 transmission (the `fedavg` preset's), with the global model's BatchNorm statistics calibrated (the
default, ``[federation] batchnorm = "calibrated"``); D-Turbo-VBI also with statistics averaged as the clients send
them, with one shared field spreading the density over every layer (``dturbo.sparsity.distribution = "evidence"``;
the default gives the layers BatchNorm follows their targets by the Erdos-Renyi-kernel rule), with whole conv
channels, a slower ramp, and twice the default target density.

Models of one's own through ``dturbo.Experiment(model=...)``, plain torch layers that ``bayesianize`` converts:

* ``resnet8``: a ResNet-8 (conv 3x3 16 + BN, three residual stages of 16, 32, 64 channels with BN, the last two at
  stride 2 with a 1x1 projection + BN, global average pooling, a dense head);
* ``mobilenet``: MobileNetV1 as published (conv 3x3, 13 depthwise-separable blocks, each convolution followed by
  BatchNorm and ReLU; the CIFAR stem at stride 1) at width 0.25.

Protocol: Fashion-MNIST (28x28, a seeded subset of 6,000 training images, 2,000 test images), 10 clients, Dirichlet
0.5, 12 rounds of one local epoch, seeds 0, 1 and 2 (MobileNetV1: seed 0, and again on 12,000 images with seeds 0, 1
and 2, over 12 rounds and over 24, ``mobilenet24r``: its ramp, paced by local steps, is compressed less), one torch
thread a run. Goal: D-Turbo-VBI ends within 1.5 points of FedAvg-16 and no round after the third falls more than 5
points below the round before.
Writes ``benchmarks/results/batchnorm.{json,md}``.

Usage: .venv/bin/python benchmarks/batchnorm.py [--runs runs/batchnorm] [--jobs 2]
       .venv/bin/python benchmarks/batchnorm.py one NAME OUT   (one run, in this process)
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from harness import read_csv, say, write_results  # noqa: E402

RESULTS = HERE / "results"
SEEDS = (0, 1, 2)
GOAL = {"points": 1.5, "drop": 5.0, "after_round": 3}
# model -> training images: the 6,000 of the protocol, and MobileNetV1 again on 12,000, where the median client
# trains 18 local steps a round instead of 9 (D-Turbo-VBI warns below 10: LocalStepsWarning)
TRAIN_IMAGES = {"resnet8": 6000, "mobilenet": 6000, "mobilenet12k": 12000, "mobilenet24r": 12000}
# model -> rounds: 12, and MobileNetV1 on 12,000 images again over 24, where the ramp paced by local steps
# (ramp_steps, 28 rounds at 18 steps) is squeezed into 19 rounds instead of 7
ROUNDS_OF = {"resnet8": 12, "mobilenet": 12, "mobilenet12k": 12, "mobilenet24r": 24}
MODELS = tuple(TRAIN_IMAGES)
# variant -> (algorithm, overrides); FedAvg-16 is the `fedavg` preset's transmission and learning rate
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "dturbo": ("dturbo", {}),
    "dturbo_evidence": ("dturbo", {"dturbo": {"sparsity": {"distribution": "evidence"}}}),
    "dturbo_averaged": ("dturbo", {"federation": {"batchnorm": "averaged"}}),
    "dturbo_channels": ("dturbo", {"dturbo": {"prior": {"conv": {"tie_rows": True}}}}),
    "dturbo_slow": ("dturbo", {"dturbo": {"sparsity": {"warmup_rounds": 3, "ramp_rounds": 8}}}),
    "dturbo_t30": ("dturbo", {"dturbo": {"sparsity": {"target_density": 0.3}}}),
    "fedavg16": ("fedavg", {"fedavg": {"dtype": "float16"},
                            "train": {"lr": 0.002, "lr_schedule": "cosine", "lr_final": 0.1}}),
}
SEEDS_OF = {"resnet8": 3, "mobilenet": 1, "mobilenet12k": 3, "mobilenet24r": 3}  # how many of SEEDS each model runs
# the variants beside the defaults run seed 0 of these models: the density spread by the evidence alone, averaged
# statistics (the failure they illustrate), whole conv channels, a slower ramp, twice the default target density
VARIANT_MODELS = {"dturbo_evidence": ("resnet8", "mobilenet"), "dturbo_averaged": ("resnet8",),
                  "dturbo_channels": ("resnet8", "mobilenet"),
                  "dturbo_slow": ("mobilenet",), "dturbo_t30": ("mobilenet",)}


def build(model: str) -> Any:
    import torch.nn.functional as F
    from torch import nn

    def cbr(c_in: int, c_out: int, k: int, stride: int = 1, groups: int = 1) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(c_out),
                nn.ReLU()]

    class Block(nn.Module):
        def __init__(self, c_in: int, c_out: int, stride: int) -> None:
            super().__init__()
            self.body = nn.Sequential(*cbr(c_in, c_out, 3, stride)[:3], nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False),
                                      nn.BatchNorm2d(c_out))
            self.skip = (nn.Identity() if stride == 1 and c_in == c_out else
                         nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)))

        def forward(self, x: Any) -> Any:
            return F.relu(self.body(x) + self.skip(x))

    if model == "resnet8":
        return nn.Sequential(*cbr(1, 16, 3), Block(16, 16, 1), Block(16, 32, 2), Block(32, 64, 2),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    blocks = ((64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2), (512, 1), (512, 1), (512, 1), (512, 1),
              (512, 1), (1024, 2), (1024, 1))
    width = 0.25
    c = int(32 * width)
    layers: list[nn.Module] = cbr(1, c, 3)
    for c_out, stride in blocks:
        c_out = int(c_out * width)
        layers += cbr(c, c, 3, stride, groups=c) + cbr(c, c_out, 1)
        c = c_out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))


def run_name(model: str, variant: str, seed: int) -> str:
    return f"{model}_{variant}_s{seed}"


def parse_run_name(name: str) -> tuple[str, str, int]:
    """Inverse of :func:`run_name`: (model, variant, seed)."""
    head, seed = name.rsplit("_s", 1)
    model, variant = head.split("_", 1)
    return model, variant, int(seed)


def one(name: str, out: Path) -> None:
    """Train run ``name`` into ``out`` in this process, continuing from its checkpoint where it has one."""
    import torch

    import dturbo

    model, variant, seed = parse_run_name(name)
    algorithm, over = VARIANTS[variant]
    cfg: dict[str, Any] = {
        "experiment": {"name": name, "seed": seed, "rounds": ROUNDS_OF[model], "threads": 1, "algorithm": algorithm},
        "data": {"name": "fashion-mnist", "limit_train": TRAIN_IMAGES[model], "limit_test": 2000},
        "federation": {"clients": 10, "partition": "dirichlet", "alpha": 0.5},
        "model": {"name": "custom"},
        "train": {"local_epochs": 1.0, "batch_size": 64},
    }
    for section, keys in over.items():
        cfg[section] = {**cfg.get(section, {}), **keys}
    torch.manual_seed(seed)
    resume = (out / "checkpoint").exists()
    dturbo.Experiment(cfg, model=build(model), out=out, resume=resume, progress=False, figures=False).run()


def runs() -> list[str]:
    def wanted(model: str, variant: str, seed: int) -> bool:
        return variant not in VARIANT_MODELS or (seed == 0 and model in VARIANT_MODELS[variant])

    names = [(v, run_name(m, v, s)) for m in MODELS for s in SEEDS[: SEEDS_OF[m]] for v in VARIANTS if wanted(m, v, s)]
    return [n for v, n in sorted(names, key=lambda vn: vn[0] not in ("dturbo", "fedavg16"))]  # the defaults first


def train(name: str, root: Path) -> Path:
    """One run in a subprocess (one torch thread), reusing a finished one and continuing a cut one."""
    out = root / name
    if (out / "model.safetensors").exists():
        return out
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    say(f"{name}: training")
    log = root / f"{name}.log"
    with open(log, "a") as f:
        subprocess.run([sys.executable, __file__, "one", name, str(out)], check=True, env=env, stdout=f,
                       stderr=subprocess.STDOUT)
    say(f"{name}: done")
    return out


def summarize(root: Path) -> dict[str, Any]:
    # finished runs only: a model whose runs are not all finished is left out of the table
    curves = {n: read_csv(root / n / "metrics.csv") for n in runs() if (root / n / "model.safetensors").exists()}
    out: dict[str, Any] = {"protocol": {
        "data": "Fashion-MNIST, a seeded subset of 6,000 training images (MobileNetV1 also 12,000), 2,000 test images",
        "train_images": TRAIN_IMAGES, "clients": 10,
        "partition": "dirichlet 0.5", "rounds": ROUNDS_OF, "local_epochs": 1, "seeds": list(SEEDS),
        "seeds_of": SEEDS_OF,
        "variants_on_seed_0": {v: list(m) for v, m in VARIANT_MODELS.items()},
        "goal": GOAL, "threads": 1, "machine": platform.machine(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d")}, "runs": [], "models": {}}
    for name, cols in curves.items():
        model, variant, seed = parse_run_name(name)
        acc = [float(a) for a in cols["accuracy"]]
        after = GOAL["after_round"]  # rounds after it (1-based) against the round before each
        # to the test set's resolution (2,000 images: 0.05 points), not float noise
        drops = [round(100 * (a - b), 2) for a, b in zip(acc[after - 1 : -1], acc[after:], strict=True)]
        calibration = cols.get("calibration_bits", np.zeros(0))
        out["runs"].append({"model": model, "variant": variant, "seed": seed,
                            "final_accuracy": acc[-1], "final_density": float(cols["density"][-1]),
                            "largest_drop_after_round_3": max(drops, default=0.0),
                            "bits": float(cols["cum_bits"][-1]),
                            "calibration_bits": float(np.nansum(calibration)),
                            "curve": [[int(r), a] for r, a in zip(cols["round"], acc, strict=True)]})
    for model in MODELS:
        by = {v: [r for r in out["runs"] if r["model"] == model and r["variant"] == v] for v in VARIANTS}
        if any(len(by[v]) < SEEDS_OF[model] for v in ("dturbo", "fedavg16")):
            out["models"][model] = {"finished": False}
            continue
        mean = {v: float(np.mean([r["final_accuracy"] for r in rs])) for v, rs in by.items() if rs}
        gap = 100 * (mean["fedavg16"] - mean["dturbo"])
        drop = max(r["largest_drop_after_round_3"] for r in by["dturbo"])
        out["models"][model] = {
            "mean_final_accuracy": mean, "points_below_fedavg16": gap, "largest_drop_after_round_3": drop,
            "dturbo_density": float(np.mean([r["final_density"] for r in by["dturbo"]])),
            "variants": {v: {k: by[v][0][k] for k in ("final_accuracy", "final_density",
                                                       "largest_drop_after_round_3")}
                         for v in VARIANT_MODELS if by[v]},
            "calibration_share_of_bits": float(np.mean([r["calibration_bits"] / r["bits"] for r in by["dturbo"]])),
            "met": bool(gap <= GOAL["points"] and drop <= GOAL["drop"])}
    return out


VARIANT_LABELS = {"dturbo_evidence": "one shared field spreads the density (`dturbo.sparsity.distribution = "
                                     "\"evidence\"`)",
                  "dturbo_averaged": "averaged statistics (`federation.batchnorm = \"averaged\"`)",
                  "dturbo_channels": "whole conv channels (`dturbo.prior.conv.tie_rows = true`)",
                  "dturbo_slow": "slower ramp: 3 dense rounds, 8 to the target (`warmup_rounds`, `ramp_rounds`)",
                  "dturbo_t30": "target density 0.3"}


def markdown(res: dict[str, Any]) -> str:
    p = res["protocol"]
    lines = [
        "# BatchNorm under pruning", "",
        f"{p['data']}, {p['clients']} clients, {p['partition']}, 12 rounds (MobileNetV1 on 12,000 images also 24) "
        f"of {p['local_epochs']} local epoch, seeds {', '.join(map(str, p['seeds']))} (MobileNetV1 on 6,000 images: "
        f"seed 0), one torch thread a run; generated by `benchmarks/batchnorm.py`. D-Turbo-VBI runs the library's "
        f"defaults. Goal: D-Turbo-VBI within {GOAL['points']} points of FedAvg-16, no round after the "
        f"{GOAL['after_round']}rd more than {GOAL['drop']} points below the one before (drops to the test set's "
        f"resolution, 0.05 points).", "",
        "| model | training images | rounds | seeds | FedAvg-16 | D-Turbo-VBI | points below | nonzero | "
        "largest drop | calibration share of bits | goal |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for model, m in res["models"].items():
        if not m.get("finished", True):
            lines.append(f"| {model} | {TRAIN_IMAGES[model]:,} | {ROUNDS_OF[model]} | {SEEDS_OF[model]} | not finished "
                         f"| | | | | | |")
            continue
        a = m["mean_final_accuracy"]
        lines.append(f"| {model} | {TRAIN_IMAGES[model]:,} | {ROUNDS_OF[model]} | {SEEDS_OF[model]} | "
                     f"{100 * a['fedavg16']:.2f}% | "
                     f"{100 * a['dturbo']:.2f}% | "
                     f"{m['points_below_fedavg16']:.2f} | {100 * m['dturbo_density']:.1f}% | "
                     f"{m['largest_drop_after_round_3']:.2f} | {100 * m['calibration_share_of_bits']:.1f}% | "
                     f"{'met' if m['met'] else 'missed'} |")
    lines += ["", "Variants beside the defaults, seed 0:", "",
              "| model | variant | accuracy | nonzero | largest drop |", "|---|---|---|---|---|"]
    for model, m in res["models"].items():
        for v, r in m.get("variants", {}).items():
            lines.append(f"| {model} | {VARIANT_LABELS[v]} | {100 * r['final_accuracy']:.2f}% | "
                         f"{100 * r['final_density']:.1f}% | {r['largest_drop_after_round_3']:.2f} |")
    # seed 0 of every run, and every seed of MobileNetV1 on 12,000 images (where the seeds' drops differ)
    shown = [r for r in res["runs"] if r["seed"] == 0 or r["model"] in ("mobilenet12k", "mobilenet24r")]
    for rounds in sorted({ROUNDS_OF[r["model"]] for r in shown}):
        lines += ["", f"Accuracy per round (%), {rounds} rounds:", "",
                  "| run | " + " | ".join(str(k) for k in range(1, rounds + 1)) + " |", "|---|" + "---|" * rounds]
        lines += [f"| {r['model']} {r['variant']} s{r['seed']} | " + " | ".join(f"{100 * a:.1f}" for _, a in r["curve"])
                  + " |" for r in shown if ROUNDS_OF[r["model"]] == rounds]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", nargs="?", default="all", choices=["all", "one", "report"])
    ap.add_argument("name", nargs="?")
    ap.add_argument("out", nargs="?", type=Path)
    ap.add_argument("--runs", type=Path, default=HERE.parent / "runs" / "batchnorm")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    if args.command == "one":
        one(args.name, args.out)
        return 0
    args.runs.mkdir(parents=True, exist_ok=True)
    if args.command == "all":
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(lambda n: train(n, args.runs), runs()))
    res = summarize(args.runs)
    write_results(RESULTS, "batchnorm", res, markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
