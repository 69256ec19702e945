"""One run, all three savings: every method on one protocol with the same tuning budget, and D-Turbo-VBI's joint
setting (few bits up and down, and a final model that export makes faster).

The protocol and every candidate are data, ``benchmarks/joint.toml``, fixed before their runs. Each method has at most
``budget`` candidates. Stages:

1. ``select``: seed 0 of every candidate;
2. ``seeds``: one setting per method by :data:`RULE` (validation split only), then its seeds 1 and 2;
3. ``time``: each chosen run's final model exported and timed against the same network dense
   (``benchmarks/speed.py``); a final model with no zero weight is the dense network (1.0x, nothing to time);
4. ``report``: ``results/joint.{json,md}`` and ``docs/results/joint.png``.

Usage: .venv/bin/python benchmarks/joint.py [plan|run|verify|time|report] [--jobs 2] [--stage select|seeds|all]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness as h  # noqa: E402

CAMPAIGN = HERE / "joint.toml"
RULE = (
    "Each candidate runs seed 0. The accuracy references (FedAvg 32-bit and 16-bit) take their candidate with the "
    "highest final validation accuracy. T_val is FedAvg-16's chosen final validation accuracy less t_margin. Every "
    "other method takes, among its candidates whose final validation accuracy is at least T_val, the one whose "
    "validation accuracy first reaches T_val with the fewest bits (up + down); when none ends at T_val, the one with "
    "the highest final validation accuracy. The chosen setting then runs the protocol's other seeds. Test "
    "accuracy is never read by the choice."
)


# ------------------------------------------------------------------------------------------------ choice
@dataclass
class Choice:
    """Each method's chosen label, and T_val."""

    chosen: dict[str, str]
    t_val: float | None
    why: dict[str, str]


def choose(camp: h.Campaign, runs: list[h.Run]) -> Choice:
    """:data:`RULE` on the seed-0 runs. A method is chosen once every one of its candidates has run seed 0 (and,
    for a method that is not a reference, once T_val is known)."""
    p = camp.protocol
    seed0 = {r.cand.label: r for r in runs if r.seed == camp.seeds[0]}
    chosen: dict[str, str] = {}
    why: dict[str, str] = {}

    def complete(method: str) -> list[h.Run] | None:
        labels = [c.label for c in camp.candidates if c.method == method]
        return [seed0[x] for x in labels] if all(x in seed0 for x in labels) else None

    for method in p["references"]:
        rs = complete(method)
        if rs:
            best = max(rs, key=lambda r: r.final_val)
            chosen[method] = best.cand.label
            why[method] = f"highest final validation accuracy, {best.final_val:.2%}"
    t_val = None
    if p["t_reference"] in chosen:
        t_val = seed0[chosen[p["t_reference"]]].final_val - p["t_margin"]
    for method in camp.methods():
        if method in p["references"] or t_val is None:
            continue
        rs = complete(method)
        if not rs:
            continue
        reach = [(r.bits_to(t_val, "val_accuracy"), r) for r in rs if r.final_val >= t_val - 1e-12]
        reach = [(b, r) for b, r in reach if b is not None]
        if reach:
            bits, best = min(reach, key=lambda br: (br[0], -br[1].final_val))
            why[method] = f"reaches T_val = {t_val:.2%} with the fewest bits, {bits / 1e6:.1f} Mbit"
        else:
            best = max(rs, key=lambda r: r.final_val)
            why[method] = f"no candidate ends at T_val = {t_val:.2%}: the highest final validation accuracy"
        chosen[method] = best.cand.label
    return Choice(chosen, t_val, why)


# --------------------------------------------------------------------------------------------------- jobs
def select_jobs(camp: h.Campaign, s: h.Settings, index: h.RunIndex) -> list[h.Job]:
    """Seed 0 of every candidate, D-Turbo-VBI's first (its runs are the longest)."""
    order = sorted(camp.candidates, key=lambda c: c.algorithm != "dturbo")
    return [h.plan(h.Job(camp, c, camp.seeds[0], s), index) for c in order]


def seed_jobs(camp: h.Campaign, s: h.Settings, index: h.RunIndex) -> list[h.Job]:
    """The other seeds of every chosen setting."""
    choice = choose(camp, h.load_runs(camp, s))
    by = camp.by_label()
    return [h.plan(h.Job(camp, by[label], seed, s), index)
            for label in choice.chosen.values() for seed in camp.seeds[1:]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", nargs="?", default="plan", choices=["plan", "run", "verify", "time", "report"])
    ap.add_argument("--stage", default="all", choices=["select", "seeds", "all"])
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (one core each)")
    ap.add_argument("--only", nargs="*", default=None, help="methods to run (default: all)")
    ap.add_argument("--results", type=Path, default=h.ROOT / "benchmarks" / "results")
    ap.add_argument("--runs", type=Path, default=h.ROOT / "runs", help="where run directories go")
    ap.add_argument("--data", default=None, help="Fashion-MNIST folder (default: $DTURBO_DATA or the Debian "
                                                   "package's)")
    ap.add_argument("--rounds", type=int, default=2, help="verify: rounds to train again")
    args = ap.parse_args(argv)
    camp = h.load_campaign(CAMPAIGN)
    over = [m for m in camp.methods() if sum(c.method == m for c in camp.candidates) > camp.protocol["budget"]]
    if over:
        raise SystemExit(f"{CAMPAIGN.name}: more than {camp.protocol['budget']} candidates for {over}")
    s = h.Settings(results=args.results, runs_root=args.runs, data_path=args.data)
    index = h.RunIndex(s.results)

    def keep(jobs: list[h.Job]) -> list[h.Job]:
        return [j for j in jobs if args.only is None or j.cand.method in args.only]

    if args.command == "plan":
        h.print_plan("seed 0 of every candidate", select_jobs(camp, s, index))
        choice = choose(camp, h.load_runs(camp, s))
        for method, label in choice.chosen.items():
            print(f"  chosen {method}: {label} ({choice.why[method]})")
        h.print_plan("the chosen settings' other seeds", seed_jobs(camp, s, index))
    elif args.command == "run":
        failed: list[h.Job] = []
        if args.stage in ("select", "all"):
            failed += h.run_jobs(keep(select_jobs(camp, s, index)), args.jobs)
        if args.stage in ("seeds", "all"):
            failed += h.run_jobs(keep(seed_jobs(camp, s, h.RunIndex(s.results))), args.jobs)
        if failed:
            print("failed: " + ", ".join(j.name for j in failed))
            return 1
    elif args.command == "verify":
        # Every run reused from another campaign, its first rounds trained again with this code: the cache holds
        # what this code computes.
        bad = 0
        for job in select_jobs(camp, s, index) + seed_jobs(camp, s, index):
            path = job.source or job.committed / f"{job.name}.csv"
            if job.status not in ("reuse", "done") or not h.trained_elsewhere(path, camp.tag):
                continue
            diffs = h.verify(job, path, args.rounds)
            bad += bool(diffs)
            print(f"{job.name} ({path.parent.name}/{path.name}): first {args.rounds} rounds "
                  f"{'identical' if not diffs else 'DIFFER: ' + '; '.join(diffs)}", flush=True)
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
