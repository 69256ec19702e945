"""The cost of a D-Turbo-VBI round against a FedAvg round, both timed on this machine in one run, in the steady state.

One client's local training of one round (what dominates a round: the server's step is timed apart), for the
joint comparison's chosen D-Turbo-VBI setting under each ``[dturbo] sampling`` and for FedAvg, on the same client data
(Fashion-MNIST, alexnet-small, the protocol's 2 local epochs on one client's Dirichlet(0.5) share), one torch thread,
interleaved: each repeat trains the clients of every setting in turn, so that a slower moment of the machine falls on
all of them.

D-Turbo-VBI is timed in the steady state, after the ramp: the round after the last of its seed-0 run of the joint
protocol (``runs/joint/<label>_s0``, which ``benchmarks/joint.py run`` writes), at the density that run ended on.
Without that run this script trains the setting itself into ``runs/round_time/`` up to ``--steady-round`` rounds.
FedAvg's round costs the same in every round. Also the server step of each (aggregation, and D-Turbo-VBI's turbo
step: E3, E4, SPMP, E2, the support), timed on the uploads of that round.
Writes ``benchmarks/results/round_time.{json,md}``.

Usage: .venv/bin/python benchmarks/round_time.py [--repeats 3] [--settings DTURBO FEDAVG] [--steady-round 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import shutil
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness as h  # noqa: E402

from dturbo.algorithms.registry import build_algorithm  # noqa: E402
from dturbo.config import Config  # noqa: E402
from dturbo.federation import Federation  # noqa: E402
from dturbo.nn.bayes import SAMPLINGS, bayesian_layers  # noqa: E402
from dturbo.settings import parse_config  # noqa: E402
from dturbo.sim import Simulator  # noqa: E402

RESULTS = HERE / "results"
DEFAULT_SETTINGS = ("dturbo_ef_c4q_t25_u5d3_r14", "fedavg16_lr3e-3_cos")


@dataclasses.dataclass
class Start:
    """A run's state at the start of the timed round: the server's state, what the clients hold, the round."""

    fed: Federation
    state: dict[str, Any]
    client_state: dict[str, np.ndarray]
    round_idx: int


def steady_start(cfg: Config, run_dir: Path, steady_round: int) -> Start:
    """The checkpoint of ``run_dir`` (a copy of it is resumed, the run itself is left as it is); with none, the
    setting trained from scratch into ``runs/round_time/`` for ``steady_round`` rounds."""
    if not (run_dir / "checkpoint").exists():
        run_dir = h.ROOT / "runs" / "round_time" / run_dir.name
        if not (run_dir / "checkpoint").exists():
            h.say(f"no checkpoint of {run_dir.name}: training {steady_round} rounds into {run_dir}")
            shutil.rmtree(run_dir, ignore_errors=True)
            sim = Simulator(cfg.model_copy(update={"experiment": cfg.experiment.model_copy(
                update={"rounds": steady_round})}), run_dir, on_round=lambda r: h.say(f"round {r['round']}"))
            sim.run()
    copy = h.ROOT / "runs" / "round_time" / "_timed"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns(".lock"))
    sim = Simulator(cfg, copy, resume=True)
    state, done, _, _ = sim._open()
    return Start(sim.fed, state, sim.client.export_state() if sim.client.keeps_state else {}, done)


def timed_round(cfg: Config, start: Start, client_ids: list[int]) -> tuple[list[float], float, float]:
    """(seconds of each client's local training in the round after ``start``, seconds of the server's aggregation,
    the density of the round's support) of one setting, built afresh from ``start``."""
    server, client = build_algorithm(cfg, start.fed)
    if client.keeps_state:
        client.import_state(start.client_state)
    downs = server.downlinks(start.state, start.round_idx, client_ids)
    seconds, ups = [], []
    for c in client_ids:
        t0 = time.perf_counter()
        ups.append(client.fit(downs[c], start.fed.clients[c], c))
        seconds.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    server.aggregate(start.state, ups, start.round_idx)
    aggregate = time.perf_counter() - t0
    masks = [m.mask for _, m in bayesian_layers(client.model)]
    density = float(sum(m.sum() for m in masks) / sum(m.numel() for m in masks)) if masks else 1.0
    return seconds, aggregate, density


def with_sampling(cfg: Config, name: str) -> Config:
    tree = cfg.to_dict()
    tree["dturbo"]["sampling"] = name
    return parse_config(tree)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of each")
    ap.add_argument("--clients", type=int, nargs="+", default=[0, 1], help="clients timed in each repeat")
    ap.add_argument("--settings", nargs=2, default=list(DEFAULT_SETTINGS), help="D-Turbo-VBI and FedAvg labels "
                                                                               "of benchmarks/joint.toml")
    ap.add_argument("--steady-round", type=int, default=16, help="rounds trained when no joint run is there")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    camp = h.load_campaign(HERE / "joint.toml")
    by = camp.by_label()
    dt, fa = args.settings
    dt_cfg = parse_config(h.config_tree(camp, by[dt], 0))
    fa_cfg = parse_config(h.config_tree(camp, by[fa], 0))
    start = steady_start(dt_cfg, h.ROOT / "runs" / camp.tag / f"{dt}_s0", args.steady_round)
    fa_server, _ = build_algorithm(fa_cfg, start.fed)
    fa_start = Start(start.fed, fa_server.init(), {}, start.round_idx)
    timed = {f"{dt}+{name}": (with_sampling(dt_cfg, name), start) for name in SAMPLINGS}
    timed[fa] = (fa_cfg, fa_start)
    client_s: dict[str, list[float]] = {label: [] for label in timed}
    server_s: dict[str, list[float]] = {label: [] for label in timed}
    density = {}
    for r in range(args.repeats):
        for label, (cfg, st) in timed.items():
            c, s, density[label] = timed_round(cfg, st, args.clients)
            client_s[label] += c
            server_s[label].append(s)
            h.say(f"repeat {r + 1}: {label}: clients {[round(x, 2) for x in c]} s, server {s:.2f} s")
    med = {k: statistics.median(v) for k, v in client_s.items()}
    ratios = {name: med[f"{dt}+{name}"] / med[fa] for name in SAMPLINGS}
    chosen = dt_cfg.dturbo.sampling
    res = {"settings": {"dturbo": dt, "fedavg": fa, "sampling": chosen}, "client_seconds": client_s,
           "server_seconds": server_s, "median_client_seconds": med,
           "ratio_client": ratios[chosen], "dturbo_density": density[f"{dt}+{chosen}"],
           "ratio_client_by_sampling": ratios, "timed_round": start.round_idx + 1, "goal_ratio": 1.3,
           "machine": {"platform": platform.platform(), "python": platform.python_version(),
                       "torch": torch.__version__, "threads": 1},
           "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}
    md = [f"One client's local training of round {start.round_idx + 1} ({camp.base['train']['local_epochs']:g} local "
          f"epochs, alexnet-small, Fashion-MNIST, one torch thread), D-Turbo-VBI in the steady state at density "
          f"{res['dturbo_density']:.1%}, the median over {args.repeats} interleaved repeats of clients "
          f"{args.clients}:", "",
          "| setting | sampling | local training (s) | x FedAvg | server step (s) |", "|---|---|---|---|---|"]
    for label in timed:
        name = label.partition("+")[2]
        md.append(f"| `{label.partition('+')[0]}` | {name or '-'} | {med[label]:.2f} | "
                  f"{med[label] / med[fa]:.2f}x | {statistics.median(server_s[label]):.2f} |")
    md += ["", f"D-Turbo-VBI's local training (sampling = \"{chosen}\", the setting's) costs **{ratios[chosen]:.2f}x** "
               f"FedAvg's (goal: at most 1.3x): **{'met' if ratios[chosen] <= 1.3 else 'missed'}**; "
               + "; ".join(f"sampling = \"{k}\": {v:.2f}x" for k, v in ratios.items()) + "."]
    h.write_results(RESULTS, "round_time", res, "\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
