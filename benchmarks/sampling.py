"""D-Turbo-VBI's local training under the cheaper ``[dturbo] sampling`` variants against ``"local"``, on the joint
protocol.

The joint comparison's chosen D-Turbo-VBI setting (``results/joint.json``'s ``chosen``) runs its 3 seeds again with
``sampling`` alone changed, once per variant of :data:`SAMPLINGS` (``runs/sampling/``, curves committed in
``results/sampling_runs/``); the ``"local"`` runs are the joint campaign's own (``results/joint_runs/``). Not a tuning
candidate: the setting stays the one the joint rule chose, and the question is what each cheaper sampling costs in
accuracy, bits and the rounds' shape, seed by seed; a variant enters the report once all its seeds are done. The
cost per round comes from ``benchmarks/round_time.py`` (``results/round_time.json``).
The rule, fixed before the runs: the recommended sampling is the cheapest (lowest local training cost in
round_time.json) whose mean validation accuracy is at most ``MARGIN`` below ``"local"``'s (the seeds' spread is about
0.4 points), ``"local"`` itself when none is.
Writes ``benchmarks/results/sampling.{json,md}``.

Usage: .venv/bin/python benchmarks/sampling.py [plan|run|report] [--jobs 2] [--only SAMPLING ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness as h  # noqa: E402
from joint import _mbit, largest_drop  # noqa: E402

RESULTS = HERE / "results"
SAMPLINGS = ("channel", "support", "detached")
MARGIN = 0.002  # in accuracy: 0.2 points


def campaigns(s: h.Settings) -> tuple[h.Campaign, h.Campaign, str]:
    """(the joint campaign, this one: its chosen D-Turbo-VBI setting once per sampling of :data:`SAMPLINGS`, that
    setting's label)."""
    joint = h.load_campaign(HERE / "joint.toml")
    chosen = json.loads((s.results / "joint.json").read_text())["chosen"]["dturbo"]
    base = joint.by_label()[chosen]
    cands = [replace(base, label=f"{chosen}_{name}", overrides={**base.overrides, "dturbo.sampling": name},
                     note=f"{base.note}; sampling = {name}") for name in SAMPLINGS]
    return joint, h.Campaign("sampling", joint.protocol, cands), chosen


def jobs(camp: h.Campaign, s: h.Settings) -> list[h.Job]:
    return [h.plan(h.Job(camp, cand, seed, s)) for cand in camp.candidates for seed in camp.seeds]


def row(run: h.Run, t: float) -> dict[str, Any]:
    return {"sampling": run.cfg.dturbo.sampling} | shape(run, t)


def shape(run: h.Run, t: float) -> dict[str, Any]:
    """One run's seed, accuracy, bits (to T = ``t``: None, never) and its curve's lowest round and largest drop."""
    m = run.m
    return {"seed": run.seed, "accuracy": run.final_acc,
            "val_accuracy": run.final_val, "final_density": run.density, "bits_to_t": run.bits_to(t),
            "total_bits": run.total_bits, "lowest_accuracy": float(np.min(m["accuracy"])),
            "largest_drop": largest_drop(m["accuracy"]), "round_seconds": float(np.median(m["seconds"])),
            "curve": run.curve()}


def seed_table(rows: list[dict[str, Any]], first: str, label: Callable[[dict[str, Any]], str],
               extra: dict[str, Callable[[dict[str, Any]], str]]) -> list[str]:
    """A table of one line per run of :func:`shape`'s rows: ``first`` (each row's ``label``), the seed, accuracies
    and bits, then the ``extra`` columns."""
    head = [first, "seed", "test accuracy", "validation accuracy", "Mbit to T", "total Mbit", *extra]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [label(r), str(r["seed"]), f"{r['accuracy']:.2%}", f"{r['val_accuracy']:.2%}", _mbit(r["bits_to_t"]),
                 f"{r['total_bits'] / 1e6:.1f}", *(f(r) for f in extra.values())]
        out.append("| " + " | ".join(cells) + " |")
    return out


def report(s: h.Settings) -> None:
    joint, camp, chosen = campaigns(s)
    t = float(json.loads((s.results / "joint.json").read_text())["t"])
    local = [r for r in h.load_runs(joint, s) if r.cand.label == chosen]
    runs = h.load_runs(camp, s)
    done = [r for r in runs if sum(o.cand.label == r.cand.label for o in runs) == len(camp.seeds)]
    if not done:
        raise h.HarnessError(f"no sampling has all {len(camp.seeds)} seeds done: run `benchmarks/sampling.py run` "
                             f"first")
    order = ("local", *SAMPLINGS)
    rows = [row(r, t) for r in sorted(local + done, key=lambda r: (order.index(r.cfg.dturbo.sampling), r.seed))]
    by = {name: [r for r in rows if r["sampling"] == name] for name in order if any(
        r["sampling"] == name for r in rows)}

    def mean(name: str, key: str) -> float | None:
        xs = [r[key] for r in by[name]]
        return None if any(x is None for x in xs) else float(np.mean(xs))

    timing_path = s.results / "round_time.json"
    timing = json.loads(timing_path.read_text()) if timing_path.exists() else {}
    ratios = timing.get("ratio_client_by_sampling", {})
    summary = {name: {"accuracy": mean(name, "accuracy"), "val_accuracy": mean(name, "val_accuracy"),
                      "bits_to_t": mean(name, "bits_to_t"), "total_bits": mean(name, "total_bits"),
                      "largest_drop": max(r["largest_drop"] for r in by[name]),
                      "seeds_reaching_t": sum(r["bits_to_t"] is not None for r in by[name]),
                      "ratio_client": ratios.get(name)} for name in by}
    fit = [name for name, v in summary.items() if v["ratio_client"] is not None
           and v["val_accuracy"] >= summary["local"]["val_accuracy"] - MARGIN]
    recommended = min(fit, key=lambda name: summary[name]["ratio_client"], default="local")
    res = {"setting": chosen, "t": t, "seeds": camp.seeds, "summary": summary, "recommended": recommended,
           "margin": MARGIN,
           "runs": [{k: v for k, v in r.items()} for r in rows],
           "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}

    md = [f"D-Turbo-VBI's chosen joint setting `{chosen}` under each `[dturbo] sampling`, on the joint protocol "
          f"(3 seeds; T = {t:.2%}); local training's cost against FedAvg's from round_time.md.", "",
          *seed_table(rows, "sampling", lambda r: r["sampling"],
                      {"lowest round": lambda r: f"{r['lowest_accuracy']:.2%}",
                       "largest drop after round 3": lambda r: f"{r['largest_drop'] * 100:.1f} points"})]
    md += ["", "| sampling | mean validation accuracy | mean test accuracy | mean Mbit to T | seeds reaching T | "
           "local training x FedAvg |", "|---|---|---|---|---|---|"]
    for name, v in summary.items():
        ratio = "-" if v["ratio_client"] is None else f"{v['ratio_client']:.2f}x"
        md.append(f"| {name} | {v['val_accuracy']:.2%} | {v['accuracy']:.2%} | {_mbit(v['bits_to_t'])} | "
                  f"{v['seeds_reaching_t']} of {len(camp.seeds)} | {ratio} |")
    md += ["", f"Recommended (the cheapest whose mean validation accuracy is at most {100 * MARGIN:.1f} points below "
               f"local's): **{recommended}**."]
    ratio, goal = summary[recommended]["ratio_client"], timing.get("goal_ratio")
    if ratio is not None and goal is not None:
        md[-1] += (f" Its local training costs {ratio:.2f}x FedAvg's in the steady state (goal: at most {goal:g}x): "
                   f"**{'met' if ratio <= goal else 'missed'}**.")
    h.write_results(s.results, "sampling", res, "\n".join(md) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", nargs="?", default="plan", choices=["plan", "run", "report"])
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (one torch thread each)")
    ap.add_argument("--only", nargs="+", choices=SAMPLINGS, default=SAMPLINGS,
                    help="train these samplings' runs (another process may be training the others)")
    args = ap.parse_args(argv)
    s = h.Settings()
    _, camp, _ = campaigns(s)
    return dispatch(args.command, camp, s, lambda j: j.cand.overrides["dturbo.sampling"] in args.only, args.jobs,
                    report)


def dispatch(command: str, camp: h.Campaign, s: h.Settings, keep: Callable[[h.Job], bool], n_jobs: int,
             report: Callable[[h.Settings], None]) -> int:
    """A study's command: ``plan`` its runs, ``run`` those ``keep`` selects, ``n_jobs`` at a time, or ``report``."""
    if command == "plan":
        h.print_plan(f"{', '.join(c.label for c in camp.candidates)}, every seed", jobs(camp, s))
    elif command == "run":
        return 1 if h.run_jobs([j for j in jobs(camp, s) if keep(j)], n_jobs) else 0
    else:
        report(s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
