"""What relative-entropy coding of D-Turbo-VBI's uploads would cost: KL(posterior || prior) against the bits sent.

Relative-entropy coding (minimal random coding: Havasi et al., ICLR 2019; in federated learning with the global
model as side information: Isik et al., arXiv 2306.12625) sends a sample of a client's posterior q in about
KL(q || p) bits, p a distribution the server shares. Here q = N(mu_t, sigma_t^2) on the support, the client's
posterior after its round, and p = N(mu_G, sigma_G^2), the global posterior it received: the side information of
the federated form. A block costs at least its KL, whatever the coder; so where KL exceeds the bits the upload
really takes, relative-entropy coding cannot win.

The joint comparison's chosen setting is measured in the steady state (the round after its seed-0 run, as
``round_time.py``) and in an early round (round 3 of a fresh run), every client: each one's KL summed over the
support, against the bytes of its real upload (8 x bytes). Then the bound: each seed's bits to T had every upload of
the steady state cost that round's KL / upload of its bits. Writes ``benchmarks/results/rec_bits.{json,md}``.

Usage: .venv/bin/python benchmarks/rec_bits.py [--stage all|bound]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness as h  # noqa: E402
from round_time import DEFAULT_SETTINGS, Start, steady_start  # noqa: E402

from dturbo.algorithms.dturbo.layers import sigma_grid_on  # noqa: E402
from dturbo.algorithms.registry import build_algorithm  # noqa: E402
from dturbo.config import Config  # noqa: E402
from dturbo.nn.bayes import bayesian_layers  # noqa: E402
from dturbo.settings import parse_config  # noqa: E402

RESULTS = HERE / "results"
EARLY_ROUND = 3
# the first round of the steady state: the support at its target density after 1 warm-up and 14 ramp rounds
STEADY_FROM = 16


def kl_bits(mu_q: np.ndarray, sigma_q: np.ndarray, mu_p: np.ndarray, sigma_p: np.ndarray) -> float:
    """KL(N(mu_q, sigma_q^2) || N(mu_p, sigma_p^2)) summed over the values, in bits."""
    nats = np.log(sigma_p / sigma_q) + (sigma_q**2 + (mu_q - mu_p) ** 2) / (2 * sigma_p**2) - 0.5
    return float(nats.sum() / math.log(2))


def round_of(cfg: Config, start: Start) -> list[dict[str, Any]]:
    """Every client's round after ``start``: the KL of its posterior from the global one, and its upload's bits."""
    server, client = build_algorithm(cfg, start.fed)
    if client.keeps_state:
        client.import_state(start.client_state)
    clients = list(range(cfg.federation.clients))
    downs = server.downlinks(start.state, start.round_idx, clients)
    received: dict[str, Any] = {}
    load = client._load

    def keep(down: Any) -> Any:
        received["down"] = down
        return load(down)

    client._load = keep  # type: ignore[method-assign]
    out = []
    for cid in clients:
        up = client.fit(downs[cid], start.fed.clients[cid], cid)
        kl = weights = 0.0
        shift = []
        for d, (_, layer) in zip(received["down"].layers, bayesian_layers(client.model), strict=True):
            s = d.support
            grid = s.shape
            mu_p = np.asarray(d.mu, dtype=np.float64).reshape(grid)[s]
            sigma_p = sigma_grid_on(d.sigma, s)[s]
            mu_q = layer.weight_mu.detach().double().numpy().reshape(grid)[s]
            sigma_q = np.broadcast_to(layer.sigma.detach().double().numpy(), layer.weight_mu.shape).reshape(grid)[s]
            kl += kl_bits(mu_q, sigma_q, mu_p, sigma_p)
            weights += int(s.sum())
            shift.append(((mu_q - mu_p) / sigma_p) ** 2)
        out.append({"client": cid, "kl_bits": kl, "upload_bits": 8 * len(up), "weights": int(weights),
                    "mean_shift_over_sigma_sq": float(np.mean(np.concatenate(shift)))})
        h.say(f"round {start.round_idx + 1}, client {cid}: KL {kl / 1e3:.1f} kbit, upload {8 * len(up) / 1e3:.1f} "
              f"kbit")
    return out


def early_start(cfg: Config, fed: Any) -> Start:
    """The state after EARLY_ROUND - 1 rounds of a fresh run, every client each round."""
    server, client = build_algorithm(cfg, fed)
    state = server.init()
    clients = list(range(cfg.federation.clients))
    for rnd in range(EARLY_ROUND - 1):
        downs = server.downlinks(state, rnd, clients)
        state = server.aggregate(state, [client.fit(downs[c], fed.clients[c], c) for c in clients], rnd).state
    return Start(fed, state, client.export_state() if client.keeps_state else {}, EARLY_ROUND - 1)


def bits_to_t_at_kl(m: dict[str, np.ndarray], t: float, ratio: float,
                    from_round: int) -> tuple[float | None, float | None]:
    """(bits to T as sent, bits to T had each upload of round ``from_round`` on cost ``ratio`` of its bits) of one
    run's metrics ``m``; (None, None) when it never reaches T."""
    sent = h.bits_to(m["cum_bits"], m["accuracy"], t)
    if sent is None:
        return None, None
    upto = m["cum_bits"] <= sent
    return sent, sent - (1.0 - ratio) * float(m["up_bits"][upto & (m["round"] >= from_round)].sum())


def bound(summary: dict[str, Any], camp: h.Campaign, label: str) -> dict[str, Any]:
    """Bits to T if every upload from round ``STEADY_FROM`` on cost the steady round's KL / upload of its bits: each
    seed of ``label`` in the joint campaign against STC's mean bits to T (joint.json). The steady round measured
    follows the run's last, whose updates are small, so the ratio likely flatters relative-entropy coding in the
    rounds before it."""
    joint = json.loads((RESULTS / "joint.json").read_text())
    t = float(joint["t"])
    stc = next(r["bits_to_t"] for r in joint["table"] if r["method"] == "stc")
    ratio = summary["steady"]["kl_over_upload"]
    seeds = []
    for run in sorted((r for r in h.load_runs(camp, h.Settings()) if r.cand.label == label), key=lambda r: r.seed):
        sent, at_kl = bits_to_t_at_kl(run.m, t, ratio, STEADY_FROM)
        if sent is None or at_kl is None:
            seeds.append({"seed": run.seed, "bits_to_t": None, "bits_to_t_at_kl": None})
            continue
        seeds.append({"seed": run.seed, "bits_to_t": sent, "bits_to_t_at_kl": at_kl,
                      "vs_stc": sent / stc, "vs_stc_at_kl": at_kl / stc})
    return {"from_round": STEADY_FROM, "kl_over_upload": ratio, "stc_bits_to_t": stc, "seeds": seeds}


def markdown(res: dict[str, Any]) -> str:
    md = [f"Relative-entropy coding's least cost against D-Turbo-VBI's uploads (`{res['setting']}`, seed 0, all 10 "
          f"clients of a round): KL(q || p) with q each client's posterior after the round and p the global posterior "
          f"it received, summed over the support.", "",
          "| round | KL (kbit, all clients) | uploads sent (kbit) | KL / upload | KL bits per weight on the support |",
          "|---|---|---|---|---|"]
    for v in res["summary"].values():
        md.append(f"| {v['round']} | {v['kl_bits'] / 1e3:.1f} | {v['upload_bits'] / 1e3:.1f} | "
                  f"{v['kl_over_upload']:.1f}x | {v['kl_bits_per_weight']:.2f} |")
    b = res.get("bound")
    if b is not None:
        md += ["", f"Bits to T if every upload from round {b['from_round']} on cost {b['kl_over_upload']:.2f}x its "
                   f"bits (the KL / upload of the round after the run's last, whose updates are small: the rounds "
                   f"before it likely cost more), against STC's {b['stc_bits_to_t'] / 1e6:.1f} Mbit:", "",
               "| seed | bits to T (Mbit) | x STC's | at KL (Mbit) | x STC's |", "|---|---|---|---|---|"]
        for r in b["seeds"]:
            if r["bits_to_t"] is None:
                md.append(f"| {r['seed']} | never | | | |")
            else:
                md.append(f"| {r['seed']} | {r['bits_to_t'] / 1e6:.1f} | {r['vs_stc']:.3f}x | "
                          f"{r['bits_to_t_at_kl'] / 1e6:.1f} | {r['vs_stc_at_kl']:.3f}x |")
    return "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stage", choices=("all", "bound"), default="all",
                    help="all: measure KL against the uploads, then the bound; bound: the bound alone, from the "
                         "committed rec_bits.json and joint runs")
    args = ap.parse_args(argv)
    camp = h.load_campaign(HERE / "joint.toml")
    label = DEFAULT_SETTINGS[0]
    if args.stage == "bound":
        res = json.loads((RESULTS / "rec_bits.json").read_text())
        res["bound"] = bound(res["summary"], camp, label)
        h.write_results(RESULTS, "rec_bits", res, markdown(res))
        return 0
    torch.set_num_threads(1)
    cfg = parse_config(h.config_tree(camp, camp.by_label()[label], 0))
    steady = steady_start(cfg, h.ROOT / "runs" / camp.tag / f"{label}_s0", 16)
    rows = {"early": round_of(cfg, early_start(cfg, steady.fed)), "steady": round_of(cfg, steady)}
    summary = {}
    for when, rs in rows.items():
        kl, up = sum(r["kl_bits"] for r in rs), sum(r["upload_bits"] for r in rs)
        summary[when] = {"round": (EARLY_ROUND if when == "early" else steady.round_idx + 1),
                         "kl_bits": kl, "upload_bits": up, "kl_over_upload": kl / up,
                         "kl_bits_per_weight": kl / sum(r["weights"] for r in rs)}
    res = {"setting": label, "prior": "N(mu_G, sigma_G^2), the global posterior the client received",
           "summary": summary, "clients": rows, "bound": bound(summary, camp, label),
           "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}
    h.write_results(RESULTS, "rec_bits", res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
