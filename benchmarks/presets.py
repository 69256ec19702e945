"""The presets on the main job's data and rounds: what `dturbo run --preset NAME` gives.

Runs (Fashion-MNIST, alexnet-small, 10 clients, Dirichlet 0.5, 12 rounds of one local epoch, seed 0, one torch
thread a run so that two run side by side):

* ``quick``: the main job (the README's first command), with the library's default transmission;
* ``quick_paper``: the main job with the `paper` preset's transmission (float16 values both ways, positions whole,
  sigma_prior sent): what it sends under the paper's protocol;
* ``recommended``: the `recommended` preset.

Apart (``--stage``): ``alone``, the main job timed on an idle machine; ``models``, ``recommended`` against the
library's defaults on three models; ``candidates``, ``recommended``'s transmission chosen on a validation split;
``warmup``, ``quick``, ``recommended`` and the defaults at a constant and a rising learning rate, on a validation
split; ``dead_units``, ``sampling`` and ``biases`` (:data:`STUDIES`), an option against the value the library held
(``dead_units`` kept and cut on ``quick`` and ``recommended``; ``sampling`` local and detached on ``quick`` and the
defaults; ``biases`` as float16 values and as mu on ``quick`` and ``recommended``), seeds 0-2, on a validation split.

Goal: ``recommended`` within 1 point of the main job's accuracy with at most 0.3x the bits of the main job under the
paper's protocol. Writes ``benchmarks/results/presets.{json,md}`` and copies the main job's figures to
``benchmarks/results/presets/``.

Usage: .venv/bin/python benchmarks/presets.py [--runs runs/presets] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from harness import dataset_path, read_csv, say  # noqa: E402

from dturbo.settings import load_config  # noqa: E402

RESULTS = HERE / "results"
GOAL = {"points": 1.0, "bits_ratio": 0.3}


def configs() -> dict[str, Any]:
    one = {"experiment.threads": 1}
    paper = load_config(preset="paper")
    tr = paper.dturbo.transmission
    paper_keys = {f"dturbo.transmission.{k}": v for k, v in tr.model_dump().items()} | {
        "dturbo.prior_std_dtype": paper.dturbo.prior_std_dtype, "experiment.name": "quick_paper"}
    return {"quick": load_config(preset="quick", overrides=one),
            "quick_paper": load_config(preset="quick", overrides=one | paper_keys),
            "recommended": load_config(preset="recommended", overrides=one)}


def run(name: str, cfg: Any, out: Path) -> Path:
    """Train into ``out`` (a subprocess per run: one torch thread each), reusing a finished run of the same config."""
    import subprocess

    if (out / "model.safetensors").exists():
        # the config as written, every key: a run from before a default changed wrote the old value or none
        if (out / "config.toml").read_text() == cfg.to_toml():
            return out
        shutil.rmtree(out)
    cfg_path = out.parent / f"{name}.toml"
    cfg_path.parent.mkdir(parents=True, exist_ok=True)
    cfg_path.write_text(cfg.to_toml())
    resume = ["--resume"] if (out / "checkpoint").exists() else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent / "src")}
    say(f"{name}: training into {out}")
    with open(out.parent / f"{name}.log", "a") as log:
        subprocess.run([sys.executable, "-m", "dturbo", "run", str(cfg_path), "--out", str(out), *resume], env=env,
                       stdout=log, stderr=subprocess.STDOUT, check=True)
    return out


def summary(name: str, out: Path) -> dict[str, Any]:
    m = read_csv(out / "metrics.csv")
    return {"name": name, "final_accuracy": float(m["accuracy"][-1]), "final_density": float(m["density"][-1]),
            "total_bits": float(m["cum_bits"][-1]), "up_bits": float(m["up_bits"].sum()),
            "down_bits": float(m["down_bits"].sum()), "rounds": int(m["round"][-1]),
            "seconds_per_round_side_by_side": float(np.median(m["seconds"])),
            "accuracy_by_round": [round(float(a), 4) for a in m["accuracy"]],
            "cum_bits_by_round": [float(b) for b in m["cum_bits"]]}


def markdown(res: dict[str, Any]) -> str:
    rows = res["runs"]
    out = ["| run | what | final accuracy | nonzero | bits up + down (Mbit) |", "|---|---|---|---|---|"]
    what = {"quick": "the main job (`--preset quick`)", "quick_paper": "the main job, the paper's transmission",
            "recommended": "`--preset recommended`"}
    for r in rows.values():
        out.append(f"| {r['name']} | {what[r['name']]} | {100 * r['final_accuracy']:.2f}% | "
                   f"{100 * r['final_density']:.1f}% | {r['total_bits'] / 1e6:.1f} |")
    g = res["goal"]
    below = g["points_below_quick"]
    out += ["", f"`recommended` against the main job: {abs(below):.2f} points {'below' if below > 0 else 'above'}, "
                f"{g['bits_ratio_vs_quick_paper']:.3f}x the bits of the main job under the paper's protocol "
                f"(goal: within {GOAL['points']:g} point, at most {GOAL['bits_ratio']:g}x): "
                f"**{'met' if g['met'] else 'missed'}**.", "",
            f"{res['protocol']}; seed 0; one torch thread a run."]
    if res.get("models"):
        out += ["", f"`recommended` against the library's defaults on three models (10 clients, 12 rounds of one "
                    f"local epoch, seed 0: alexnet-small on the main job's data, ResNet-8 and MobileNetV1 (with "
                    f"BatchNorm) on benchmarks/batchnorm.py's 6,000 and 12,000 training images; goal: within "
                    f"{GOAL['points']:g} point, no more bits; trained on {res['models'][0]['device']}, torch "
                    f"{res['models'][0]['torch']}):", "", models_markdown(res["models"]).rstrip()]
        missing = [m for m in MODELS if {(m, q) for q in MODEL_PRESETS} - {(r["model"], r["preset"])
                                                                            for r in res["models"]}]
        if missing:
            out += ["", f"Not measured yet: {', '.join(missing)}."]
    c = res.get("candidates")
    if c:
        out += ["", "`recommended`'s transmission, chosen on a validation split (alexnet-small, the main job's "
                    "protocol, 10% of the training images held out, seed 0); rule: " + c["rule"] + ":", "",
                "| run | final validation accuracy | bits up + down (Mbit) | chosen |", "|---|---|---|---|"]
        for r in [c["defaults"], *c["candidates"]]:
            name = "defaults" if r["preset"] == "defaults" else f"recommended, {r['candidate']}"
            out.append(f"| {name} | {100 * r['final_val_accuracy']:.2f}% | {r['total_bits'] / 1e6:.1f} | "
                       f"{'**yes**' if r['preset'] != 'defaults' and r['candidate'] == c['chosen'] else ''} |")
    w = res.get("warmup")
    if w:
        out += ["", "A rising learning rate on the main job's protocol, with 10% of the training images held out "
                    "(alexnet-small):", "", warmup_markdown(w).rstrip()]
    for name in STUDIES:
        d = res.get(name)
        if d:
            held, alt = STUDIES[name].values
            out += ["", f'`{name} = "{alt}"` against `"{held}"` on the main job\'s protocol, with 10% of the training '
                        f"images held out (alexnet-small, seeds {', '.join(map(str, STUDY_SEEDS))}):", "",
                    study_markdown(d).rstrip()]
    a = res.get("main_job_alone")
    if a:
        out += ["", f"The main job alone (`dturbo run --preset quick`, {a['threads']} cores, nothing else running): "
                    f"{a['seconds_rounds']:.0f} s of rounds ({a['seconds_per_round']:.1f} s a round, median), "
                    f"{a['seconds_wall']:.0f} s in all with its start and figures; its first line estimated "
                    f"\"about {a['first_line_estimate']}\"."]
    return "\n".join(out) + "\n"


def figure(runs: dict[str, Any], path: Path) -> None:
    """Test accuracy against cumulative bits (log x) of the three runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dturbo.report import _save, bits_log_axis

    names = {"quick": "main job (quick): default transmission, 25% kept",
             "quick_paper": "main job, the paper's 16-bit protocol",
             "recommended": f"recommended: {runs['recommended']['final_density']:.0%} kept"}
    fig, ax = plt.subplots(figsize=(7.5, 4.6), layout="constrained")
    for i, (name, r) in enumerate(runs.items()):
        acc = 100 * np.asarray(r["accuracy_by_round"])
        ax.plot(r["cum_bits_by_round"], acc, "-o", ms=3, color=f"C{i}",
                label=f"{names[name]}: {acc[-1]:.2f}%, {r['total_bits'] / 1e6:.1f} Mbit")
    ax.set_xscale("log")
    ax.set(xlabel="cumulative communication, up + down (bits, log scale)", ylabel="test accuracy (%)",
           title="D-Turbo-VBI on Fashion-MNIST, 10 clients, 12 rounds")
    ax.set_ylim(50, 90)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    bits_log_axis(ax)
    path.parent.mkdir(parents=True, exist_ok=True)
    _save(fig, path)


def alone(out: Path) -> dict[str, Any]:
    """The main job as a user runs it (`dturbo run --preset quick`, both cores, its figures), timed with nothing
    else running: the wall time, each round's seconds, and the estimate its first line gives."""
    import re
    import subprocess
    import time

    if out.exists():
        shutil.rmtree(out)
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src")}
    say(f"the main job alone into {out}")
    t0 = time.perf_counter()
    log = subprocess.run([sys.executable, "-m", "dturbo", "run", "--preset", "quick", "--out", str(out)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=True).stdout
    wall = time.perf_counter() - t0
    m = read_csv(out / "metrics.csv")
    estimate = re.search(r"\(about (.+) from a timed training step\)", log)
    return {"seconds_per_round": float(np.median(m["seconds"])), "seconds_rounds": float(np.sum(m["seconds"])),
            "seconds_wall": wall, "rounds": int(m["round"][-1]), "threads": os.cpu_count(),
            "first_line_estimate": estimate.group(1) if estimate else None,
            "final_accuracy": float(m["accuracy"][-1]), "cpu": platform.processor() or platform.machine()}


# --------------------------------------------------------------------------- presets on other models
MODELS = ("alexnet-small", "resnet8", "mobilenet")  # the built-in one; benchmarks/batchnorm.py's two with BatchNorm
MODEL_PRESETS = ("defaults", "recommended")
# Each model on its own protocol: alexnet-small on the main job's (all 60,000 training images), the two with
# BatchNorm on benchmarks/batchnorm.py's (ResNet-8 on 6,000 training images, MobileNetV1 on 12,000, 2,000 test
# images: a ResNet-8 round on all 60,000 takes over 10 minutes on one core)
MODEL_DATA = {"alexnet-small": {}, "resnet8": {"data.limit_train": 6000, "data.limit_test": 2000},
              "mobilenet": {"data.limit_train": 12000, "data.limit_test": 2000}}
# Candidates for `recommended`'s transmission, fixed before their runs (alexnet-small, the main job's protocol, 10% of
# the training images held out; seed 0): the preset as it is, and its downlink as the update against what each client
# holds at 4 bits (down_mu = "update"), on the max levels or clipped to 3 root mean squares. RULE chooses.
CANDIDATES: dict[str, dict[str, Any]] = {
    "as_is": {},
    "update4": {"dturbo.transmission.down_mu": "update", "dturbo.transmission.down_bits": 4},
    "update4_clipped": {"dturbo.transmission.down_mu": "update", "dturbo.transmission.down_bits": 4,
                        "dturbo.transmission.down_quantizer": "clipped"},
}
# A learning rate rising over the first rounds (the joint comparison's schedule) against a constant one: with Adam at
# the full rate from the first step, the presets' round 1 evaluates at chance.
WARMUP: dict[str, dict[str, Any]] = {"constant": {"train.lr_warmup_rounds": 0},
                                     "warmup2": {"train.lr_warmup_rounds": 2}}
WARMUP_RULE = ("a preset (or the defaults) takes the rising rate when its run's round 1 validation accuracy is at "
               "least 15% (5 points above chance) and its final validation accuracy at most 0.2 points below the "
               "constant rate's")
RULE = ("among the candidates whose final validation accuracy is at most 1 point below the defaults' and whose bits "
        "are at most the defaults', the most accurate on validation; when none, the fewest bits among those within 1 "
        "point; when none, the most accurate on validation")


@dataclass(frozen=True)
class Study:
    """One option against the value the library held before it, on presets of the main job's protocol (alexnet-small,
    10% of the training images held out, seeds 0-2). ``values``: the held value first, then the alternative;
    ``axis``: a row key the alternative must also lower (None: it is cheaper by construction, e.g. in time)."""

    option: str
    values: tuple[str, str]
    presets: tuple[str, ...]
    axis: str | None

    @property
    def candidates(self) -> dict[str, dict[str, Any]]:
        return {v: {self.option: v} for v in self.values}

    @property
    def rule(self) -> str:
        held, alt = self.values
        also = f" and its mean {self.axis.replace('_', ' ')} are fewer" if self.axis else ""
        return (f'a preset takes {self.option.split(".")[-1]} = "{alt}" when, over seeds '
                f'{", ".join(map(str, STUDY_SEEDS))}, its mean final validation accuracy is at most '
                f'{100 * STUDY_MARGIN:.1f} points below "{held}"\'s{also}')


STUDY_SEEDS = (0, 1, 2)
STUDY_MARGIN = 0.002  # in accuracy: 0.2 points
STUDIES = {"dead_units": Study("dturbo.dead_units", ("kept", "cut"), ("quick", "recommended"), "total_bits"),
           "sampling": Study("dturbo.sampling", ("local", "detached"), ("quick", "defaults"), None),
           "biases": Study("dturbo.transmission.biases", ("float16", "as_mu"), ("quick", "recommended"), "total_bits")}
STUDY_CANDIDATES = {v: c for st in STUDIES.values() for v, c in st.candidates.items()}


def model_config(model: str, preset: str, device: str, extra: dict[str, Any] | None = None) -> Any:
    """``model``'s protocol (:data:`MODEL_DATA`; 10 clients, 12 rounds of one local epoch) with the library's defaults
    (``defaults``) or a preset, and ``extra`` overrides."""
    protocol = {"experiment.rounds": 12, "experiment.threads": 1, "experiment.device": device,
                "data.path": dataset_path(), "train.local_epochs": 1.0, "train.batch_size": 64,
                "train.optimizer": "adam"} | MODEL_DATA[model] | (extra or {})
    if preset == "defaults":
        return load_config({"experiment": {"name": "defaults"}}, overrides=protocol)
    return load_config(preset=preset, overrides=protocol)


def run_model(model: str, preset: str, device: str, work: str, candidate: str | None = None,
              seed: int = 0) -> dict[str, Any]:
    """One preset on one model into ``work`` (a fresh process; cached); ``candidate``: one of :data:`CANDIDATES` over
    it, with 10% of the training images held out for validation; ``seed``: ``experiment.seed``."""
    import warnings

    import torch

    import dturbo

    tag = f"{model}_{preset}" + (f"_{candidate}" if candidate else "") + (f"_s{seed}" if seed else "")
    out = Path(work) / tag
    cache = out.parent / f"{tag}.json"
    extra = (CANDIDATES | WARMUP | STUDY_CANDIDATES)[candidate] | {"data.validation": 0.1} if candidate else {}
    extra |= {"experiment.seed": seed} if seed else {}
    cfg = model_config(model, preset, device, extra)
    if cache.exists():  # reused only for the same config, every key as written
        row = json.loads(cache.read_text())
        if row.pop("config", None) == cfg.to_toml():
            return row
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    if out.exists():
        shutil.rmtree(out)
    if model == "alexnet-small":
        exp = dturbo.Experiment(cfg, out=out, progress=False, figures=False)
    else:
        from batchnorm import build

        torch.manual_seed(cfg.experiment.seed)
        exp = dturbo.Experiment(cfg, model=build(model), out=out, progress=False, figures=False)
    res = exp.run()
    m = res.metrics
    row = {"model": model, "preset": preset, "final_accuracy": float(res.accuracy), "density": float(res.density),
           "support_density": float(res.support_density), "total_bits": float(m[-1]["cum_bits"]),
           "accuracy_by_round": [round(float(r["accuracy"]), 4) for r in m], "device": device,
           "seconds": float(sum(float(r["seconds"]) for r in m)), "torch": torch.__version__,
           "train_images": cfg.data.limit_train, "seed": cfg.experiment.seed}
    if candidate:
        row |= {"candidate": candidate, "final_val_accuracy": float(m[-1]["val_accuracy"]),
                "val_accuracy_by_round": [round(float(r["val_accuracy"]), 4) for r in m]}
    cache.write_text(json.dumps(row | {"config": cfg.to_toml()}))
    say(f"{tag}: {row['final_accuracy']:.4f}, density {row['density']:.3f}, {row['total_bits'] / 1e6:.1f} Mbit")
    return row


def pool_rows(jobs: int, todo: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """:func:`run_model` on every job of ``todo``, ``jobs`` at a time, one fresh process each."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn"), max_tasks_per_child=1) as pool:
        return list(pool.map(run_model, *zip(*todo, strict=True)))


def model_rows(work: Path, jobs: int, device: str, models: tuple[str, ...] = MODELS) -> list[dict[str, Any]]:
    return pool_rows(jobs, [(m, p, device, str(work)) for m in models for p in MODEL_PRESETS])


def candidate_rows(work: Path, jobs: int, device: str) -> dict[str, Any]:
    """The defaults and every candidate of :data:`CANDIDATES` on alexnet-small with a validation split; the choice by
    :data:`RULE` (validation accuracy and bits only)."""
    rows = pool_rows(jobs, [("alexnet-small", "defaults", device, str(work), "as_is")] +
                     [("alexnet-small", "recommended", device, str(work), c) for c in CANDIDATES])
    base, cands = rows[0], rows[1:]
    within = [r for r in cands if r["final_val_accuracy"] >= base["final_val_accuracy"] - GOAL["points"] / 100]
    both = [r for r in within if r["total_bits"] <= base["total_bits"]]
    chosen = (max(both, key=lambda r: r["final_val_accuracy"]) if both else
              min(within, key=lambda r: r["total_bits"]) if within else
              max(cands, key=lambda r: r["final_val_accuracy"]))
    return {"rule": RULE, "defaults": base, "candidates": cands, "chosen": chosen["candidate"]}


def warmup_rows(work: Path, jobs: int, device: str, seeds: tuple[int, ...] = ()) -> dict[str, Any]:
    """``quick``, ``recommended`` and the library's defaults at :data:`WARMUP`'s rates, on alexnet-small with a
    validation split, seed 0; which takes the rising rate, by :data:`WARMUP_RULE` (validation accuracy only).
    ``seeds``: more seeds of ``quick`` and the defaults, reported beside the rule's seed."""
    rows = pool_rows(jobs, [("alexnet-small", p, device, str(work), c) for p in ("quick", "recommended", "defaults")
                            for c in WARMUP])
    more = pool_rows(jobs, [("alexnet-small", p, device, str(work), c, s) for p in ("quick", "defaults")
                            for s in seeds for c in WARMUP]) if seeds else []
    return {"rule": WARMUP_RULE, "rows": rows, "adopt": warmup_adopt(rows), "more_seeds": more}


def study_rows(name: str, work: Path, jobs: int, device: str) -> dict[str, Any]:
    """Study ``name`` of :data:`STUDIES`: its presets under each value, on alexnet-small with a validation split,
    seeds :data:`STUDY_SEEDS`; which take the alternative, by its rule (validation accuracy, and its axis)."""
    st = STUDIES[name]
    rows = pool_rows(jobs, [("alexnet-small", p, device, str(work), v, s) for p in st.presets
                            for s in STUDY_SEEDS for v in st.values])
    return {"option": st.option, "rule": st.rule, "rows": rows, "summary": study_summary(st, rows),
            "adopt": study_adopt(st, rows)}


def study_summary(st: Study, rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per preset and value: the seeds' means of the final accuracies, density and total bits."""
    keys = ("final_val_accuracy", "final_accuracy", "density", "total_bits")
    return {p: {v: {k: float(np.mean([r[k] for r in rows if r["preset"] == p and r["candidate"] == v])) for k in keys}
                for v in st.values} for p in dict.fromkeys(r["preset"] for r in rows)}


def study_adopt(st: Study, rows: list[dict[str, Any]]) -> dict[str, bool]:
    """The study's rule on the rows of :func:`study_rows`: whether each preset takes the alternative."""
    held, alt = st.values
    return {p: v[alt]["final_val_accuracy"] >= v[held]["final_val_accuracy"] - STUDY_MARGIN
            and (st.axis is None or v[alt][st.axis] < v[held][st.axis]) for p, v in study_summary(st, rows).items()}


def study_markdown(d: dict[str, Any]) -> str:
    key = d["option"].split(".")[-1]
    out = [f"| preset | {key} | mean final validation accuracy | mean final test accuracy | mean nonzero | mean "
           "bits up + down (Mbit) | by seed (validation) |", "|---|---|---|---|---|---|---|"]
    for p, by in d["summary"].items():
        for v, m in by.items():
            seeds = ", ".join(f"{100 * r['final_val_accuracy']:.2f}%" for r in sorted(
                (r for r in d["rows"] if r["preset"] == p and r["candidate"] == v), key=lambda r: r["seed"]))
            out.append(f"| {p} | {v} | {100 * m['final_val_accuracy']:.2f}% | {100 * m['final_accuracy']:.2f}% | "
                       f"{100 * m['density']:.1f}% | {m['total_bits'] / 1e6:.1f} | {seeds} |")
    taken = [p for p, a in d["adopt"].items() if a]
    alt = next(st for st in STUDIES.values() if st.option == d["option"]).values[1]
    pending = [p for p in taken if preset_value(p, d["option"]) != alt]
    later = f" Not yet set in: {', '.join(pending)}." if pending else ""
    return "\n".join(out) + f"\n\nRule: {d['rule']}. Taken by: {', '.join(taken) or 'none'}.{later}\n"


def preset_value(preset: str, option: str) -> Any:
    """The value of ``option`` (a dotted key) that ``preset`` (``defaults``: the library's) sets today."""
    cfg = load_config({"experiment": {"name": "defaults"}}) if preset == "defaults" else load_config(preset=preset)
    for part in option.split("."):
        cfg = getattr(cfg, part)
    return cfg


def warmup_adopt(rows: list[dict[str, Any]]) -> dict[str, bool]:
    """:data:`WARMUP_RULE` on the rows of :func:`warmup_rows`: whether each preset takes the rising rate."""
    by = {(r["preset"], r["candidate"]): r for r in rows}
    return {p: all(by[p, c]["val_accuracy_by_round"][0] >= 0.15 and by[p, c]["final_val_accuracy"]
                   >= by[p, "constant"]["final_val_accuracy"] - 0.002 for c in WARMUP if c != "constant")
            for p in dict.fromkeys(r["preset"] for r in rows)}


def warmup_markdown(w: dict[str, Any]) -> str:
    out = ["| preset | seed | learning rate | round 1 validation accuracy | final validation accuracy | final test "
           "accuracy |", "|---|---|---|---|---|---|"]
    for r in [*w["rows"], *w.get("more_seeds", [])]:
        rate = "constant" if r["candidate"] == "constant" else "rising over the first 2 rounds"
        out.append(f"| {r['preset']} | {r.get('seed', 0)} | {rate} | {100 * r['val_accuracy_by_round'][0]:.2f}% | "
                   f"{100 * r['final_val_accuracy']:.2f}% | {100 * r['final_accuracy']:.2f}% |")
    taken = [p for p, a in w["adopt"].items() if a]
    more = (" Seeds other than 0 are reported beside the rule, which reads seed 0." if w.get("more_seeds") else "")
    return "\n".join(out) + f"\n\nRule: {w['rule']}. The rising rate wins for: {', '.join(taken) or 'none'}.{more}\n"


def models_markdown(rows: list[dict[str, Any]]) -> str:
    by = {(r["model"], r["preset"]): r for r in rows}
    out = ["| model | defaults | recommended | points | bits ratio | goal met |", "|---|---|---|---|---|---|"]
    for model in MODELS:
        d, r = by.get((model, "defaults")), by.get((model, "recommended"))
        if not d or not r:
            continue
        pts = 100 * (r["final_accuracy"] - d["final_accuracy"])
        ratio = r["total_bits"] / d["total_bits"]
        cell = "{:.2f}%, {:.1%} nonzero, {:.1f} Mbit"
        out.append(f"| {model} | {cell.format(100 * d['final_accuracy'], d['density'], d['total_bits'] / 1e6)} | "
                   f"{cell.format(100 * r['final_accuracy'], r['density'], r['total_bits'] / 1e6)} | {pts:+.2f} | "
                   f"{ratio:.2f}x | {pts >= -GOAL['points'] and ratio <= 1.0} |")
    return "\n".join(out) + "\n"


def update_results(**parts: Any) -> int:
    """presets.json with ``parts`` set (a stage measured apart), the rest kept; presets.md from it."""
    res = json.loads((RESULTS / "presets.json").read_text()) | parts
    (RESULTS / "presets.json").write_text(json.dumps(res, indent=1) + "\n")
    (RESULTS / "presets.md").write_text(markdown(res))
    print(markdown(res))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=Path, default=HERE.parent / "runs" / "presets")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--stage", choices=("all", "runs", "alone", "models", "candidates", "warmup", *STUDIES),
                    default="all", help=(
        "runs: the presets side by side; alone: the main job timed with nothing else running (run it on an idle "
        "machine); models: `recommended` against the library's defaults on alexnet-small, ResNet-8 and "
        "MobileNetV1 (both with BatchNorm); candidates: `recommended`'s candidates on a validation split; warmup: "
        "quick, recommended and the defaults with a rising learning rate, on a validation split; dead_units, "
        "sampling, biases: an option against the value the library held, 3 seeds, on a validation split (STUDIES)"))
    ap.add_argument("--device", default="cpu", help="models, candidates: where they train (cpu, cuda)")
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS), help="models: which to train")
    ap.add_argument("--seeds", nargs="*", type=int, default=[], help="warmup: more seeds of quick and the defaults, "
                                                                          "beside seed 0")
    args = ap.parse_args(argv)
    if args.stage == "candidates":
        return update_results(candidates=candidate_rows(args.runs / "candidates", args.jobs, args.device))
    if args.stage in STUDIES:
        return update_results(**{args.stage: study_rows(args.stage, args.runs / args.stage, args.jobs, args.device)})
    if args.stage == "warmup":
        return update_results(warmup=warmup_rows(args.runs / "warmup", args.jobs, args.device, tuple(args.seeds)))
    if args.stage == "models":
        rows = model_rows(args.runs / "models", args.jobs, args.device, tuple(args.models))
        keep = [r for r in json.loads((RESULTS / "presets.json").read_text()).get("models", [])
                if r["model"] not in args.models]
        return update_results(models=sorted(keep + rows, key=lambda r: (MODELS.index(r["model"]), r["preset"])))
    if args.stage == "alone":
        a = alone(args.runs / "alone")
        return update_results(main_job_alone=a, seconds_per_round=a["seconds_per_round"])
    cfgs = configs()
    with ThreadPoolExecutor(args.jobs) as pool:
        outs = dict(zip(cfgs, pool.map(lambda kv: run(kv[0], kv[1], args.runs / kv[0]), cfgs.items()), strict=True))
    runs = {name: summary(name, out) for name, out in outs.items()}
    q, qp, rec = runs["quick"], runs["quick_paper"], runs["recommended"]
    below = 100 * (q["final_accuracy"] - rec["final_accuracy"])
    ratio = rec["total_bits"] / qp["total_bits"]
    old = json.loads((RESULTS / "presets.json").read_text()) if (RESULTS / "presets.json").exists() else {}
    res = {"protocol": "Fashion-MNIST, alexnet-small, 10 clients, Dirichlet(0.5), 12 rounds of one local epoch",
           "runs": runs, "configs": {n: c.to_dict() for n, c in cfgs.items()},
           "goal": {"points_below_quick": below, "bits_ratio_vs_quick_paper": ratio,
                    "met": below <= GOAL["points"] and ratio <= GOAL["bits_ratio"]},
           "machine": {"platform": platform.platform(), "python": platform.python_version()},
           "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}
    # measured apart (--stage alone, --stage models)
    res |= {k: old[k] for k in ("main_job_alone", "seconds_per_round", "models", "candidates", "warmup", *STUDIES)
            if k in old}
    (RESULTS / "presets.json").write_text(json.dumps(res, indent=1) + "\n")
    (RESULTS / "presets.md").write_text(markdown(res))
    figure(runs, HERE.parent / "docs" / "results" / "presets.png")
    figs = RESULTS / "presets"
    figs.mkdir(exist_ok=True)
    for png in (outs["quick"] / "figures").glob("*.png"):
        shutil.copy(png, figs / png.name)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
