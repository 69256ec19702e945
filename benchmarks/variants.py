"""D-Turbo-VBI's downlink at fewer bits: the joint comparison's chosen setting with ``transmission.down_bits``
alone changed, on the joint protocol.

The chosen setting (``results/joint.json``'s ``chosen``; its downlink: the update from what each client holds, on
2**3 clipped levels, range-coded, with error feedback) runs its 3 seeds again once per value of :data:`DOWN_BITS`
(``runs/downlink/``, curves committed in ``results/downlink_runs/``); the 3-bit runs are the joint campaign's own.
Not a tuning candidate: the question is what each downlink costs in accuracy and saves in bits, seed by seed.
The rule, fixed before the runs: the recommended downlink is the one with the fewest mean total bits among those
whose mean final validation accuracy is at most ``MARGIN`` below the 3-bit runs'; test accuracy and bits to T are
only reported.
Writes ``benchmarks/results/downlink.{json,md}``.

Usage: .venv/bin/python benchmarks/downlink.py [plan|run|report] [--jobs 2] [--only BITS ...]
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
from sampling import jobs, shape  # noqa: E402

DOWN_BITS = (2,)
MARGIN = 0.002  # in accuracy: 0.2 points, as sampling.py's


def campaigns(s: h.Settings) -> tuple[h.Campaign, h.Campaign, str]:
    """(the joint campaign, this one: its chosen D-Turbo-VBI setting once per value of :data:`DOWN_BITS`, that
    setting's label)."""
    joint = h.load_campaign(HERE / "joint.toml")
    chosen = json.loads((s.results / "joint.json").read_text())["chosen"]["dturbo"]
    base = joint.by_label()[chosen]
    cands = [replace(base, label=f"{chosen}_down{bits}",
                     overrides={**base.overrides, "dturbo.transmission.down_bits": bits},
                     note=f"{base.note}; down_bits = {bits}") for bits in DOWN_BITS]
    return joint, h.Campaign("downlink", joint.protocol, cands), chosen


def row(run: h.Run, t: float, t_val: float) -> dict[str, Any]:
    m = run.m
    n = max(1, min(5, len(m["round"])))
    return ({"down_bits": run.cfg.dturbo.transmission.down_bits} | shape(run, t)
            | {"bits_to_t_val": run.bits_to(t_val, "val_accuracy"), "initial_bits": float(m["down_bits"][0]),
               # the steady state: the mean downlink of the last rounds, per participating client, in Mbit
               "steady_down_mbit": float(np.mean(m["down_bits"][-n:] / np.maximum(m["participants"][-n:], 1))) / 1e6})


def summarize(rows: list[dict[str, Any]], seeds: int) -> dict[int, dict[str, Any]]:
    """Per downlink: the seeds' means (None where a seed never reaches T or T_val), the seeds reaching T."""
    out = {}
    for bits in sorted({r["down_bits"] for r in rows}, reverse=True):
        mine = [r for r in rows if r["down_bits"] == bits]

        def mean(key: str, mine: list[dict[str, Any]] = mine) -> float | None:
            xs = [r[key] for r in mine]
            return None if any(x is None for x in xs) else float(np.mean(xs))

        after = [None if r["bits_to_t"] is None else r["bits_to_t"] - r["initial_bits"] for r in mine]
        out[bits] = {"accuracy": mean("accuracy"), "val_accuracy": mean("val_accuracy"),
                     "bits_to_t": mean("bits_to_t"), "bits_to_t_val": mean("bits_to_t_val"),
                     "bits_to_t_after_initial": None if None in after else float(np.mean(after)),
                     "total_bits": mean("total_bits"), "steady_down_mbit": mean("steady_down_mbit"),
                     "largest_drop": max(r["largest_drop"] for r in mine),
                     "seeds_reaching_t": sum(r["bits_to_t"] is not None for r in mine), "seeds": seeds}
    return out


def recommend(summary: dict[int, dict[str, Any]], reference: int) -> int:
    """The rule of the module docstring: validation only."""
    floor = summary[reference]["val_accuracy"] - MARGIN
    fit = [b for b, v in summary.items() if v["val_accuracy"] >= floor]
    return min(fit, key=lambda b: summary[b]["total_bits"], default=reference)


def report(s: h.Settings) -> None:
    joint, camp, chosen = campaigns(s)
    res_joint = json.loads((s.results / "joint.json").read_text())
    t, t_val = float(res_joint["t"]), float(res_joint["t_val"])
    reference = [r for r in h.load_runs(joint, s) if r.cand.label == chosen]
    runs = h.load_runs(camp, s)
    done = [r for r in runs if sum(o.cand.label == r.cand.label for o in runs) == len(camp.seeds)]
    if not done:
        raise h.HarnessError(f"no downlink has all {len(camp.seeds)} seeds done: run `benchmarks/downlink.py run` "
                             f"first")
    ref_bits = reference[0].cfg.dturbo.transmission.down_bits
    rows = [row(r, t, t_val) for r in sorted(reference + done,
                                             key=lambda r: (-r.cfg.dturbo.transmission.down_bits, r.seed))]
    summary = summarize(rows, len(camp.seeds))
    recommended = recommend(summary, ref_bits)
    stc = next((r for r in res_joint["table"] if r["method"] == "stc"), None)
    res = {"setting": chosen, "t": t, "t_val": t_val, "seeds": camp.seeds, "margin": MARGIN,
           "summary": {str(b): v for b, v in summary.items()}, "recommended": recommended, "runs": rows,
           "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}

    def mbit(x: float | None) -> str:
        return "never" if x is None else f"{x / 1e6:.1f}"

    def vs_stc(x: float | None, key: str) -> str:
        return "" if x is None or stc is None or not stc.get(key) else f"{x / stc[key]:.3f}x"

    md = [f"D-Turbo-VBI's chosen joint setting `{chosen}` with `transmission.down_bits` alone changed (the update "
          f"from what each client holds, clipped levels, error feedback), on the joint protocol (3 seeds; T = "
          f"{t:.2%}, T_val = {t_val:.2%}).", "",
          "| down_bits | seed | test accuracy | validation accuracy | Mbit to T | Mbit to T_val | total Mbit | "
          "steady downlink (Mbit a client) | largest drop after round 3 |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['down_bits']} | {r['seed']} | {r['accuracy']:.2%} | {r['val_accuracy']:.2%} | "
                  f"{mbit(r['bits_to_t'])} | {mbit(r['bits_to_t_val'])} | {r['total_bits'] / 1e6:.1f} | "
                  f"{r['steady_down_mbit']:.3f} | {r['largest_drop'] * 100:.1f} points |")
    md += ["", "| down_bits | mean validation accuracy | mean test accuracy | seeds reaching T | mean Mbit to T | "
               "x STC's | after round 1's downlink | x STC's |", "|---|---|---|---|---|---|---|---|"]
    for bits, v in summary.items():
        md.append(f"| {bits} | {v['val_accuracy']:.2%} | {v['accuracy']:.2%} | {v['seeds_reaching_t']} of "
                  f"{v['seeds']} | {mbit(v['bits_to_t'])} | {vs_stc(v['bits_to_t'], 'bits_to_t')} | "
                  f"{mbit(v['bits_to_t_after_initial'])} | "
                  f"{vs_stc(v['bits_to_t_after_initial'], 'bits_to_t_after_initial')} |")
    md += ["", f"Recommended (the fewest mean total bits among the downlinks whose mean validation accuracy is at most "
               f"{100 * MARGIN:.1f} points below the {ref_bits}-bit runs'): **down_bits = {recommended}**."]
    h.write_results(s.results, "downlink", res, "\n".join(md) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", nargs="?", default="plan", choices=["plan", "run", "report"])
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (one torch thread each)")
    ap.add_argument("--only", nargs="+", type=int, choices=DOWN_BITS, default=DOWN_BITS,
                    help="train these downlinks' runs (another process may be training the others)")
    args = ap.parse_args(argv)
    s = h.Settings()
    _, camp, _ = campaigns(s)
    if args.command == "plan":
        h.print_plan(f"{', '.join(c.label for c in camp.candidates)}, every seed", jobs(camp, s))
    elif args.command == "run":
        failed = h.run_jobs([j for j in jobs(camp, s)
                             if j.cand.overrides["dturbo.transmission.down_bits"] in args.only], args.jobs)
        return 1 if failed else 0
    else:
        report(s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
