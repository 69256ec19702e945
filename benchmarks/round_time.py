"""The cost of a D-Turbo-VBI round against a FedAvg round, both timed on this machine in one run.

One client's local training of one round (what dominates a round: the server's step is timed apart), for the
joint comparison's chosen D-Turbo-VBI setting and for FedAvg, on the same client data (Fashion-MNIST, alexnet-small,
the protocol's 2 local epochs on one client's Dirichlet(0.5) share), one torch thread, interleaved: each repeat
trains one D-Turbo-VBI client then one FedAvg client, so that a slower moment of the machine falls on both. Also
the server step of each (aggregation, and D-Turbo-VBI's turbo step: E3, E4, SPMP, E2, the support), timed on the
uploads of that round. Writes ``benchmarks/results/round_time.{json,md}``.

Usage: .venv/bin/python benchmarks/round_time.py [--repeats 5] [--setting LABEL]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness as h  # noqa: E402

from dturbo.algorithms.registry import build_algorithm  # noqa: E402
from dturbo.federation import build_federation  # noqa: E402
from dturbo.settings import parse_config  # noqa: E402

RESULTS = HERE / "results"
DEFAULT_SETTINGS = ("dturbo_joint_half_t25", "fedavg16_lr2e-3_cos")


def timed_round(cfg_tree: dict, client_ids: list[int]) -> tuple[list[float], float]:
    """(seconds of each client's local training in round 1, seconds of the server's aggregation) of one
    algorithm, from its initial state (round 0's downlink trained; round 1 as the timed one)."""
    cfg = parse_config(cfg_tree)
    fed = build_federation(cfg)
    server, client = build_algorithm(cfg, fed)
    state = server.init()
    # round 0: every client, so that the timed round starts from a trained model and a pruned support
    downs = server.downlinks(state, 0, list(range(cfg.federation.clients)))
    state = server.aggregate(state, [client.fit(downs[c], fed.clients[c], c) for c in downs], 0).state
    downs = server.downlinks(state, 1, client_ids)
    seconds, ups = [], []
    for c in client_ids:
        t0 = time.perf_counter()
        ups.append(client.fit(downs[c], fed.clients[c], c))
        seconds.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    server.aggregate(state, ups, 1)
    return seconds, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of each")
    ap.add_argument("--clients", type=int, nargs="+", default=[0, 1], help="clients timed in each repeat")
    ap.add_argument("--settings", nargs=2, default=list(DEFAULT_SETTINGS), help="D-Turbo-VBI and FedAvg labels "
                                                                               "of benchmarks/joint.toml")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    camp = h.load_campaign(HERE / "joint.toml")
    by = camp.by_label()
    trees = {label: h.config_tree(camp, by[label], 0) for label in args.settings}
    client_s: dict[str, list[float]] = {label: [] for label in trees}
    server_s: dict[str, list[float]] = {label: [] for label in trees}
    for r in range(args.repeats):
        for label, tree in trees.items():
            c, s = timed_round(tree, args.clients)
            client_s[label] += c
            server_s[label].append(s)
            print(f"repeat {r + 1}: {label}: clients {[round(x, 2) for x in c]} s, server {s:.2f} s", flush=True)
    dt, fa = args.settings
    ratio = statistics.median(client_s[dt]) / statistics.median(client_s[fa])
    res = {"settings": {"dturbo": dt, "fedavg": fa}, "client_seconds": client_s, "server_seconds": server_s,
           "median_client_seconds": {k: statistics.median(v) for k, v in client_s.items()},
           "ratio_client": ratio, "goal_ratio": 1.3,
           "machine": {"platform": platform.platform(), "python": platform.python_version(),
                       "torch": torch.__version__, "threads": 1},
           "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}
    (RESULTS / "round_time.json").write_text(json.dumps(res, indent=1) + "\n")
    md = [f"One client's local training of one round ({camp.base['train']['local_epochs']:g} local epochs, "
          "alexnet-small, Fashion-MNIST, one torch thread), the median over "
          f"{args.repeats} interleaved repeats of clients {args.clients}:", "",
          "| setting | local training (s) | server step (s) |", "|---|---|---|"]
    for label in trees:
        md.append(f"| `{label}` | {statistics.median(client_s[label]):.2f} | "
                  f"{statistics.median(server_s[label]):.2f} |")
    md += ["", f"D-Turbo-VBI's local training costs **{ratio:.2f}x** FedAvg's (goal: at most 1.3x): "
               f"**{'met' if ratio <= 1.3 else 'missed'}**."]
    (RESULTS / "round_time.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
