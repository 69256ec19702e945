"""The joint protocol's goals over 5 seeds: seeds 3 and 4 of the settings the goals compare, beside seeds 0-2.

The joint goals set D-Turbo-VBI's final test accuracy and bits to T against STC's and FedAvg 32-bit's, over 3 seeds
whose spread (0.5-0.9 points) is as large as the gaps they ask to close. Seeds 3 and 4 of the joint campaign's
chosen D-Turbo-VBI, STC and FedAvg 32-bit settings (``results/joint.json``'s ``chosen``) and of variants.py's
``settled_biases_nearest`` run here (``runs/seeds/``, curves committed in ``results/seeds_runs/``); seeds 0-2 are
those already committed (``joint_runs/``, ``variants_runs/``). Nothing is chosen: the settings are fixed, and T stays
joint.json's (FedAvg 16-bit's 3 seeds, minus 1.5 points). A seed splits the data alike for every method, so each
accuracy goal is also given as the mean of its per-seed difference with the standard error of that mean. Each run
names the CPU it trained on (its committed environment.jsonl; the joint campaign's runs predate it).

Writes ``benchmarks/results/seeds.{json,md}``.

Usage: .venv/bin/python benchmarks/seeds.py [plan|run|report] [--jobs 2] [--only SETTING ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness as h  # noqa: E402
import variants  # noqa: E402
from joint import _mbit  # noqa: E402
from sampling import dispatch, seed_table, shape  # noqa: E402

SEEDS = [3, 4]
VARIANT = "settled_biases_nearest"
# name: what it is; the joint methods by their chosen setting, the variant by variants.py's
SETTINGS = {"dturbo": "D-Turbo-VBI, the chosen setting",
            VARIANT: f"D-Turbo-VBI, {variants.VARIANTS[VARIANT][1]}",
            "stc": "STC", "fedavg32": "FedAvg 32-bit"}
DTURBO = ("dturbo", VARIANT)
# the goals of the joint protocol: bits to T at most this times STC's; test at least STC's minus this, and at most
# this below FedAvg 32-bit's
BITS_RATIO, STC_MARGIN, FEDAVG_MARGIN = 0.7, 0.003, 0.010


def campaigns(s: h.Settings) -> tuple[dict[str, tuple[h.Campaign, h.Candidate]], h.Campaign]:
    """({setting: (the campaign whose runs hold its seeds 0-2, its candidate)}, this campaign: seeds 3 and 4)."""
    joint, variants_camp, chosen = variants.campaigns(s)
    picked = json.loads((s.results / "joint.json").read_text())["chosen"]
    homes = {name: (joint, joint.by_label()[picked[name]]) for name in SETTINGS if name != VARIANT}
    homes[VARIANT] = (variants_camp, variants_camp.by_label()[f"{chosen}_{VARIANT}"])
    cands = [replace(homes[name][1], method=name) for name in SETTINGS]
    return homes, h.Campaign("seeds", {**joint.protocol, "seeds": SEEDS}, cands)


def cpu(s: h.Settings, tag: str, label: str, seed: int) -> str:
    """The CPU a committed run trained on, from its environment.jsonl ("" for runs committed before it)."""
    sessions = h.sessions_of(s.results / f"{tag}_runs" / f"{label}_s{seed}.csv")
    return ", ".join(dict.fromkeys(f"{e.get('cpu', '?')} ({e.get('cpu_capability', '?')})" for e in sessions))


def paired(rows: list[dict[str, Any]], a: str, b: str, key: str = "accuracy") -> dict[str, Any]:
    """``a``'s ``key`` minus ``b``'s on each seed both ran: the differences, their mean and its standard error."""
    by = {(r["setting"], r["seed"]): r[key] for r in rows}
    seeds = sorted(seed for name, seed in by if name == a and (b, seed) in by)
    d = np.array([by[a, seed] - by[b, seed] for seed in seeds])
    return {"seeds": seeds, "differences": d.tolist(), "mean": float(d.mean()),
            "standard_error": float(d.std(ddof=1) / np.sqrt(d.size)) if d.size > 1 else None}


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per setting: the seeds, test and validation means and standard deviations, the seeds reaching T and their mean
    bits to T (``bits_to_t``: None unless every seed reaches it)."""
    out = {}
    for name in dict.fromkeys(r["setting"] for r in rows):
        mine = [r for r in rows if r["setting"] == name]
        acc, val = np.array([r["accuracy"] for r in mine]), np.array([r["val_accuracy"] for r in mine])
        hit = [r["bits_to_t"] for r in mine if r["bits_to_t"] is not None]
        out[name] = {"seeds": [r["seed"] for r in mine], "accuracy": float(acc.mean()),
                     "accuracy_std": float(acc.std(ddof=1)), "val_accuracy": float(val.mean()),
                     "val_accuracy_std": float(val.std(ddof=1)), "seeds_reaching_t": len(hit),
                     "bits_to_t": float(np.mean(hit)) if len(hit) == len(mine) else None,
                     "bits_to_t_reached": float(np.mean(hit)) if hit else None,
                     "total_bits": float(np.mean([r["total_bits"] for r in mine]))}
    return out


def goals(rows: list[dict[str, Any]], summary: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each D-Turbo-VBI setting against the joint goals over every seed: every seed reaching T, bits to T against
    STC's (the seeds that reach T when not all do), test against STC's and FedAvg 32-bit's (the means' gap and the
    per-seed differences)."""
    stc = summary["stc"]
    out = {}
    for name in (n for n in DTURBO if n in summary):
        me = summary[name]
        ratio = None if me["bits_to_t_reached"] is None or stc["bits_to_t"] is None else \
            me["bits_to_t_reached"] / stc["bits_to_t"]
        vs_stc, vs_fedavg = paired(rows, name, "stc"), paired(rows, name, "fedavg32")
        out[name] = {"every_seed_reaches_t": me["seeds_reaching_t"] == len(me["seeds"]),
                     "bits_to_t_ratio": ratio,
                     "bits_goal_met": ratio is not None and me["bits_to_t"] is not None and ratio <= BITS_RATIO,
                     "test_minus_stc": me["accuracy"] - stc["accuracy"], "paired_stc": vs_stc,
                     "stc_goal_met": me["accuracy"] >= stc["accuracy"] - STC_MARGIN,
                     "test_minus_fedavg32": me["accuracy"] - summary["fedavg32"]["accuracy"],
                     "paired_fedavg32": vs_fedavg,
                     "fedavg_goal_met": me["accuracy"] >= summary["fedavg32"]["accuracy"] - FEDAVG_MARGIN}
    return out


def _points(x: float) -> str:
    return f"{100 * x:+.2f}"


def _paired(p: dict[str, Any]) -> str:
    se = "" if p["standard_error"] is None else f" ± {100 * p['standard_error']:.2f}"
    return f"{_points(p['mean'])}{se} ({', '.join(_points(d) for d in p['differences'])})"


def markdown(res: dict[str, Any]) -> str:
    t, summary, rows = res["t"], res["summary"], res["runs"]
    md = [f"The joint protocol's goals over seeds {', '.join(map(str, res['seeds']))} (T = {t:.2%}, joint.json's). "
          f"Seeds {', '.join(map(str, SEEDS))} ran in this campaign; the others are the committed runs of joint.py "
          f"and variants.py. The CPU column is empty for runs committed before their machine was recorded (the "
          f"joint campaign's).", "",
          *seed_table(rows, "setting", lambda r: SETTINGS[r["setting"]], {"CPU": lambda r: r["cpu"]}), "",
          "| setting | seeds | mean test accuracy (std) | mean validation accuracy (std) | seeds reaching T | "
          "mean Mbit to T | mean total Mbit |", "|---|---|---|---|---|---|---|"]
    for name, v in summary.items():
        reached = _mbit(v["bits_to_t"]) if v["bits_to_t"] is not None else \
            f"never on {len(v['seeds']) - v['seeds_reaching_t']} ({_mbit(v['bits_to_t_reached'])} on the others)"
        md.append(f"| {SETTINGS[name]} | {len(v['seeds'])} | {v['accuracy']:.2%} ({100 * v['accuracy_std']:.2f}) | "
                  f"{v['val_accuracy']:.2%} ({100 * v['val_accuracy_std']:.2f}) | {v['seeds_reaching_t']} of "
                  f"{len(v['seeds'])} | {reached} | {v['total_bits'] / 1e6:.1f} |")
    md += ["", f"The goals (bits to T at most {BITS_RATIO:g}x STC's; test accuracy at least STC's minus "
               f"{100 * STC_MARGIN:.1f} points and at most {100 * FEDAVG_MARGIN:.1f} below FedAvg 32-bit's). "
               "A paired column: the mean of the per-seed differences in points, ± its standard error, then each "
               "seed's.", "",
           "| setting | every seed reaches T | bits to T / STC's | test - STC's (paired) | test - FedAvg 32-bit's "
           "(paired) |", "|---|---|---|---|---|"]
    for name, g in res["goals"].items():
        reached = summary[name]["seeds_reaching_t"]
        ratio = "-" if g["bits_to_t_ratio"] is None else f"{g['bits_to_t_ratio']:.3f}x" + (
            "" if g["every_seed_reaches_t"] else f" on the {reached} seeds that reach T")
        md.append(f"| {SETTINGS[name]} | {'yes' if g['every_seed_reaches_t'] else 'no'} | {ratio} "
                  f"({'met' if g['bits_goal_met'] else 'missed'}) | {_paired(g['paired_stc'])} "
                  f"({'met' if g['stc_goal_met'] else 'missed'}) | {_paired(g['paired_fedavg32'])} "
                  f"({'met' if g['fedavg_goal_met'] else 'missed'}) |")
    return "\n".join(md) + "\n"


def report(s: h.Settings) -> None:
    homes, camp = campaigns(s)
    t = float(json.loads((s.results / "joint.json").read_text())["t"])
    # each campaign's committed runs read once (the joint campaign holds three of the settings)
    loaded = {c.tag: h.load_runs(c, s) for c in [camp, *(home for home, _ in homes.values())]}
    rows = []
    for name in SETTINGS:
        home, cand = homes[name]
        mine = [(tag, r) for tag in (home.tag, camp.tag) for r in loaded[tag] if r.cand.label == cand.label]
        for tag, r in sorted(mine, key=lambda x: x[1].seed):
            rows.append({"setting": name, "label": cand.label} | shape(r, t)
                        | {"cpu": cpu(s, tag, cand.label, r.seed)})
    have = {name: sorted(r["seed"] for r in rows if r["setting"] == name) for name in SETTINGS}
    missing = {name: [x for x in range(max(SEEDS) + 1) if x not in seeds] for name, seeds in have.items()}
    if any(missing.values()):
        raise h.HarnessError("seeds not committed yet: " + "; ".join(
            f"{name}: {', '.join(map(str, m))}" for name, m in missing.items() if m)
            + " (run `benchmarks/seeds.py run` first)")
    summary = summarize(rows)
    res = {"t": t, "seeds": list(range(max(SEEDS) + 1)), "settings": {n: c.label for n, (_, c) in homes.items()},
           "summary": summary, "goals": goals(rows, summary), "runs": rows,
           "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}
    h.write_results(s.results, "seeds", res, markdown(res))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", nargs="?", default="plan", choices=["plan", "run", "report"])
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (one torch thread each)")
    ap.add_argument("--only", nargs="+", choices=list(SETTINGS), default=list(SETTINGS),
                    help="train these settings' runs (another process may be training the others)")
    args = ap.parse_args(argv)
    s = h.Settings()
    _, camp = campaigns(s)
    return dispatch(args.command, camp, s, lambda j: j.cand.method in args.only, args.jobs, report)


if __name__ == "__main__":
    sys.exit(main())
