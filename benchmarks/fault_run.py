"""A real run under injected faults, killed with SIGKILL and resumed: rounds survived, faults met, data lost.

    python benchmarks/fault_run.py [--rounds 8] [--kills 2]

Fashion-MNIST (3000-image subset), LeNet-5, D-Turbo-VBI, 10 clients; every round each client may drop (20%),
send corrupted bytes (25%: truncated, garbage, flipped header, oversized, another message kind) or straggle past
a deadline (lognormal slowdown, sigma 0.6, deadline 1.6x); rounds need 4 valid updates (else retried).
The same run is made twice: uninterrupted, and SIGKILLed at random moments then continued with --resume.
"Data lost" = any difference between the two metrics.csv / events.log files, or a round missing.
Writes benchmarks/results/faults.json and faults.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TIMING = {"seconds", "server_seconds"}
SETTINGS = [
    "experiment.threads=1", "model.name=\"lenet5\"", "data.limit_train=3000", "data.limit_test=1000",
    "train.local_steps=10", "dturbo.beta=0.015", "dturbo.sparsity.ramp_rounds=4",
    "faults.drop_prob=0.2", "faults.corrupt_prob=0.25", "faults.straggler_sigma=0.6", "faults.deadline=1.6",
    "federation.min_clients=4", "federation.max_retries=10",
]


def command(out: Path, rounds: int, resume: bool) -> list[str]:
    cmd = [sys.executable, "-m", "dturbo", "run", str(ROOT / "configs" / "fmnist_quick.toml"), "--out", str(out),
           "--no-figures", "--set", f"experiment.rounds={rounds}"]
    for s in SETTINGS:
        cmd += ["--set", s]
    return cmd + (["--resume"] if resume else [])


def rows(out: Path) -> list[dict[str, str]]:
    with open(out / "metrics.csv", newline="") as f:
        return [{k: v for k, v in r.items() if k not in TIMING} for r in csv.DictReader(f)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--kills", type=int, default=2)
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "fault_run")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    import shutil

    shutil.rmtree(args.work, ignore_errors=True)
    ref, cut = args.work / "uninterrupted", args.work / "killed"
    t0 = time.perf_counter()
    subprocess.run(command(ref, args.rounds, False), check=True, env=env, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    rng = np.random.default_rng(11)
    kills = []
    for _ in range(args.kills):
        proc = subprocess.Popen(command(cut, args.rounds, (cut / "checkpoint").exists()), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        delay = float(rng.uniform(0.3, 0.8) * wall / args.kills)
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            done = len(rows(cut)) if (cut / "metrics.csv").exists() else 0
            kills.append({"after_seconds": round(delay, 1), "rounds_saved": done})
    subprocess.run(command(cut, args.rounds, (cut / "checkpoint").exists()), check=True, env=env,
                   stdout=subprocess.DEVNULL)
    a, b = rows(ref), rows(cut)
    same_metrics = a == b
    same_events = (ref / "events.log").read_text() == (cut / "events.log").read_text()
    events = (ref / "events.log").read_text().splitlines()
    kinds = {
        "dropped (no answer)": sum(int(r["clients_dropped"]) for r in a),
        "late (past the deadline)": sum(int(r["clients_late"]) for r in a),
        "corrupted uploads sent": sum(int(r["clients_corrupted"]) for r in a),
        "uploads rejected by the server": sum(int(float(r["clients_rejected"])) for r in a),
        "rounds retried (too few valid updates)": sum(int(r["retries"]) for r in a),
    }
    reasons: dict[str, int] = {}
    for e in events:
        if "upload rejected:" in e:
            why = e.split("upload rejected: ", 1)[1].split(" (")[0]
            key = why if len(why) < 50 else why[:47] + "..."
            reasons[key] = reasons.get(key, 0) + 1
    result = {
        "rounds": args.rounds, "rounds_completed": len(a), "faults": kinds, "rejection_reasons": reasons,
        "kills": kills, "metrics_identical_after_kills": same_metrics, "events_identical": same_events,
        "final_accuracy": float(a[-1]["accuracy"]), "final_density": float(a[-1]["density"]),
        "data_lost": "none" if same_metrics and same_events and len(b) == args.rounds else "YES",
        "wall_seconds_uninterrupted": round(wall, 1),
    }
    out = ROOT / "benchmarks" / "results"
    (out / "faults.json").write_text(json.dumps(result, indent=2) + "\n")
    md = ["| fault | count |", "|---|---|", *(f"| {k} | {v} |" for k, v in kinds.items()),
          f"| SIGKILL + --resume | {len(kills)} kills at {', '.join(str(k['after_seconds']) + ' s' for k in kills)} |",
          "", "| outcome | value |", "|---|---|",
          f"| rounds completed | {len(a)} of {args.rounds} |",
          f"| metrics.csv identical to the uninterrupted run | {same_metrics} |",
          f"| events.log identical | {same_events} |",
          f"| data lost | {result['data_lost']} |",
          f"| final accuracy | {100 * result['final_accuracy']:.1f}% |",
          f"| final density | {100 * result['final_density']:.1f}% |",
          "", "Rejection reasons seen: " + "; ".join(f"{k} ({v})" for k, v in reasons.items())]
    (out / "faults.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    sys.exit(0 if result["data_lost"] == "none" else 1)


if __name__ == "__main__":
    main()
