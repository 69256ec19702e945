"""One run, all three savings: every method on one protocol with the same tuning budget, and D-Turbo-VBI's joint
setting (few bits up and down, and a final model that export makes faster).

The protocol and every candidate are data, ``benchmarks/joint.toml``, fixed before their runs. Each method has at most
``budget`` candidates. Stages:

1. ``select``: seed 0 of every candidate;
2. ``seeds``: one setting per method by :data:`RULE` (validation split only), then its seeds 1 and 2;
3. ``time``: each chosen run's final model exported and timed against the same network dense
   (``benchmarks/speed.py``); a final model with no zero weight is the dense network (1.0x, nothing to time), but
   a narrower network (``model.widths``) is timed against the protocol's network dense;
4. ``report``: ``results/joint.{json,md}`` and ``docs/results/joint.png``.

Usage: .venv/bin/python benchmarks/joint.py [plan|run|verify|time|report] [--jobs 2] [--stage select|seeds|all]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness as h  # noqa: E402

CAMPAIGN = HERE / "joint.toml"
NAMES = {"dturbo": "D-Turbo-VBI", "fedavg32": "FedAvg 32-bit", "fedavg16": "FedAvg 16-bit", "stc": "STC",
         "feddst": "FedDST", "fedpaq": "FedPAQ", "dssm": "DSSM", "fedpm": "FedPM",
         "narrow_fedavg16": "narrow FedAvg 16-bit", "narrow_stc": "narrow STC"}
PEERS = ("stc", "feddst", "fedpaq", "dssm", "fedpm", "narrow_fedavg16", "narrow_stc")
# Methods whose final model has no zero weight by construction (dense weights averaged, or a dense model plus
# sparse updates): their exported model is the dense network, 1.0x, unless the network itself is narrower.
DENSE_FINAL = {"fedavg", "fedpaq", "stc", "dssm"}
GOALS = {"points_below_fedavg32": 1.0, "points_below_stc": 0.3, "vs_stc": 0.7, "speedup": 2.5, "axes_won": 2,
         "above_chance": 0.05, "largest_drop": 0.03, "drop_after": 3}
STEADY_ROUNDS = 5  # bits per parameter per round: the mean over the last rounds
RULE = (
    "Each candidate runs seed 0. The accuracy references (FedAvg 32-bit and 16-bit) take their candidate with the "
    "highest final validation accuracy. T_val is FedAvg-16's chosen final validation accuracy less t_margin. Every "
    "other method takes, among its candidates whose final validation accuracy is at least T_val, the one whose "
    "validation accuracy first reaches T_val with the fewest bits (up + down); when none ends at T_val, the one with "
    "the highest final validation accuracy. Ties go to the candidate listed first in the campaign file. The chosen "
    "setting then runs the protocol's other seeds. Test accuracy is never read by the choice."
)


def narrow(cand: h.Candidate) -> bool:
    """A dense-from-scratch baseline: a narrower network than the protocol's (``model.widths``)."""
    return "model.widths" in cand.overrides


def dense_final(cand: h.Candidate) -> bool:
    """The final model is the protocol's network dense: 1.0x by definition, nothing to time."""
    return cand.algorithm in DENSE_FINAL and not narrow(cand)


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


# ------------------------------------------------------------------------------------------------- report
@cache
def params(model: str, dataset: str, widths: tuple[int, ...] | None = None) -> int:
    """Weights and biases of a built-in model (sigma and the other variational parameters are not its parameters),
    of ``widths`` (``model.widths``) when given."""
    from dturbo.nn.models import build_model

    shape, classes = h.SHAPES[dataset]
    net = build_model(model, shape, classes, widths=widths)
    return sum(p.numel() for n, p in net.named_parameters() if n.endswith(("weight_mu", "bias")))


def per_param(run: h.Run, direction: str, n_params: int) -> float:
    """Steady state: bits / (participating clients x parameters), the mean over the last STEADY_ROUNDS rounds."""
    k = min(STEADY_ROUNDS, len(run.m["round"]))
    bits = run.m[f"{direction}_bits"][-k:]
    who = run.m["participants"][-k:]
    return float(np.mean(bits / (np.maximum(who, 1) * n_params)))


def largest_drop(acc: np.ndarray, after: int = GOALS["drop_after"]) -> float:
    """The largest fall of test accuracy from one round to the next, among the rounds after round ``after``."""
    return float(max(0.0, np.max(acc[after - 1:-1] - acc[after:]))) if len(acc) > after else 0.0


def _mean(xs: list[float]) -> float:
    return float(np.mean(xs))


def _std(xs: list[float]) -> float:
    return float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0


def line(method: str, runs: list[h.Run], t: float, speed: dict[str, float], n_params: int) -> dict[str, Any]:
    """One method's chosen setting over its seeds: accuracy, nonzeros, bits to T (None unless every seed reaches
    it), total bits, steady bits per parameter per round up and down, speedup (each seed's own model)."""
    to_t = [r.bits_to(t) for r in runs]
    # round 1's downlink carries the initial model, at each method's own precision
    initial = [float(r.m["down_bits"][0]) for r in runs]
    cfg = runs[0].cfg
    # a narrow network's nonzero weights as a share of the protocol's network, as every other row's
    widths = None if cfg.model.widths is None else tuple(cfg.model.widths)
    share = 1.0 if widths is None else params(cfg.model.name, cfg.data.name, widths) / n_params
    return {
        "method": method, "name": NAMES.get(method, method), "setting": runs[0].cand.label,
        "note": runs[0].cand.note, "seeds": [r.seed for r in runs],
        "accuracy": _mean([r.final_acc for r in runs]), "accuracy_std": _std([r.final_acc for r in runs]),
        "val_accuracy": _mean([r.final_val for r in runs]),
        "density": _mean([r.density for r in runs]) * share,
        "bits_to_t_seeds": to_t,
        "bits_to_t": _mean(to_t) if all(b is not None for b in to_t) else None,
        "seeds_reaching_t": sum(b is not None for b in to_t),
        "initial_bits": _mean(initial),
        "bits_to_t_after_initial": (_mean([b - i for b, i in zip(to_t, initial, strict=True)])
                                    if all(b is not None for b in to_t) else None),
        "total_bits": _mean([r.total_bits for r in runs]),
        "up_bits_per_param": _mean([per_param(r, "up", n_params) for r in runs]),
        "down_bits_per_param": _mean([per_param(r, "down", n_params) for r in runs]),
        "speedup_seeds": [speed.get(f"{r.cand.label}_s{r.seed}") for r in runs],
        "speedup": (_mean([speed[f"{r.cand.label}_s{r.seed}"] for r in runs])
                    if all(f"{r.cand.label}_s{r.seed}" in speed for r in runs) else None),
    }


def axes(a: dict[str, Any], b: dict[str, Any]) -> dict[str, bool | None]:
    """Whether ``a`` beats ``b`` on each axis: accuracy (higher mean), bits to T (fewer; never reaching T is worse
    than any number of bits; neither reaching it is a tie), speedup (every seed's model faster than every one of the
    other's, where both give their seeds' timings: one architecture timed twice differs by the timing's noise, a tie;
    else the higher mean); None where a number is missing."""
    inf = math.inf
    ba, bb = (a["bits_to_t"] if a["bits_to_t"] is not None else inf), (b["bits_to_t"] if b["bits_to_t"] is not None
                                                                         else inf)
    sa, sb = a.get("speedup_seeds") or [], b.get("speedup_seeds") or []
    if a["speedup"] is None or b["speedup"] is None:
        quicker = None
    elif sa and sb and None not in sa and None not in sb:
        quicker = faster(sa, sb)
    else:
        quicker = a["speedup"] > b["speedup"]
    return {"accuracy": a["accuracy"] > b["accuracy"], "bits_to_t": ba < bb, "speedup": quicker}


def faster(a: list[float], b: list[float]) -> bool:
    """Whether every seed's speedup of ``a`` is above every one of ``b``'s: one architecture timed twice differs by
    the timing's noise, so overlapping seeds are a tie."""
    return min(a) > max(b)


def goals(rows: dict[str, dict[str, Any]], curves: list[np.ndarray] | None = None, classes: int = 10
          ) -> list[dict[str, Any]]:
    """D-Turbo-VBI's goals, each met or missed with its numbers; ``curves``: its seeds' test accuracy by round."""
    dt, out = rows.get("dturbo"), []
    if dt is None:
        return out
    n = len(dt["seeds"])
    out.append({"goal": "every seed reaches T", "value": f"{dt['seeds_reaching_t']} of {n} seeds",
                "met": dt["seeds_reaching_t"] == n})
    if "stc" in rows:
        ref, mine = rows["stc"]["bits_to_t"], dt["bits_to_t"]
        ratio = mine / ref if mine is not None and ref else None
        out.append({"goal": f"bits to T at most {GOALS['vs_stc']}x STC's",
                    "value": f"{ratio:.3f}x" if ratio is not None else
                    f"{dt['seeds_reaching_t']} of {n} seeds reach T", "ratio": ratio,
                    "met": ratio is not None and ratio <= GOALS["vs_stc"]})
        gap = 100 * (rows["stc"]["accuracy"] - dt["accuracy"])
        out.append({"goal": f"final test accuracy at least STC's - {GOALS['points_below_stc']} points",
                    "value": f"{gap:+.2f} points below STC" if gap >= 0 else f"{-gap:.2f} points above STC",
                    "met": gap <= GOALS["points_below_stc"]})
    if "fedavg32" in rows:
        gap = 100 * (rows["fedavg32"]["accuracy"] - dt["accuracy"])
        out.append({"goal": f"final test accuracy within {GOALS['points_below_fedavg32']} point of FedAvg 32-bit",
                    "value": f"{gap:+.2f} points below" if gap >= 0 else f"{-gap:.2f} points above",
                    "met": gap <= GOALS["points_below_fedavg32"]})
    out.append({"goal": f"exported model at least {GOALS['speedup']}x faster than dense (CPU)",
                "value": f"{dt['speedup']:.2f}x" if dt["speedup"] is not None else "not timed",
                "met": dt["speedup"] is not None and dt["speedup"] >= GOALS["speedup"]})
    if curves:
        chance = 1.0 / classes
        low = min(float(np.min(c)) for c in curves)
        out.append({"goal": f"every round of every seed at least {100 * GOALS['above_chance']:.0f} points above "
                            f"chance ({100 * chance:.0f}%)", "value": f"lowest {100 * low:.1f}%",
                    "met": low >= chance + GOALS["above_chance"]})
        after = GOALS["drop_after"]
        drop = max((largest_drop(c, after) for c in curves), default=0.0)
        out.append({"goal": f"no round after round {after} more than {100 * GOALS['largest_drop']:.0f} points below "
                            f"the round before", "value": f"largest drop {100 * max(drop, 0.0):.1f} points",
                    "met": drop <= GOALS["largest_drop"]})
    for peer in (m for m in rows if m != "dturbo"):
        won = axes(dt, rows[peer])
        k = sum(bool(v) for v in won.values())
        out.append({"goal": f"better than {NAMES.get(peer, peer)} on at least {GOALS['axes_won']} of accuracy, bits "
                            f"to T and speedup", "value": ", ".join(f"{a} {'yes' if v else 'no' if v is False else '?'}"
                                                                  for a, v in won.items()),
                    "axes": won, "met": k >= GOALS["axes_won"]})
    return out


def peer_wins(table: list[dict[str, Any]]) -> list[str]:
    """Each axis on which a peer beats D-Turbo-VBI's chosen setting, with both numbers."""
    rows = {r["method"]: r for r in table}
    dt, out = rows.get("dturbo"), []
    if dt is None:
        return out
    for peer in PEERS:
        if peer not in rows:
            continue
        p = rows[peer]
        won = axes(p, dt)
        if won["accuracy"]:
            out.append(f"{p['name']}: higher test accuracy, {100 * p['accuracy']:.2f}% against "
                       f"{100 * dt['accuracy']:.2f}%")
        if won["bits_to_t"]:
            mine = ("not all of D-Turbo-VBI's seeds reach T" if dt["bits_to_t"] is None
                    else f"against {_mbit(dt['bits_to_t'])} Mbit")
            out.append(f"{p['name']}: fewer bits to T, {_mbit(p['bits_to_t'])} Mbit; {mine}")
        if won["speedup"]:
            out.append(f"{p['name']}: a faster exported model, {p['speedup']:.2f}x against {dt['speedup']:.2f}x")
    return out


def summarize(camp: h.Campaign, runs: list[h.Run], speed: dict[str, float]) -> dict[str, Any]:
    """Everything the report shows, from the committed runs and the speed records."""
    choice = choose(camp, runs)
    p = camp.protocol
    by_method = {m: sorted([r for r in runs if r.cand.label == label], key=lambda r: r.seed)
                 for m, label in choice.chosen.items()}
    complete = {m: rs for m, rs in by_method.items() if [r.seed for r in rs] == camp.seeds}
    t = None
    if p["t_reference"] in complete:
        t = _mean([r.final_acc for r in complete[p["t_reference"]]]) - p["t_margin"]
    base = camp.base
    n_params = params(base["model"]["name"], base["data"]["name"])
    rows = {m: line(m, rs, t, speed, n_params) for m, rs in complete.items()} if t is not None else {}
    seed0 = {r.cand.label: r for r in runs if r.seed == camp.seeds[0]}
    candidates = {m: [{"label": c.label, "note": c.note, "chosen": choice.chosen.get(m) == c.label,
                       "val_accuracy": seed0[c.label].final_val if c.label in seed0 else None,
                       "val_bits_to_t_val": (seed0[c.label].bits_to(choice.t_val, "val_accuracy")
                                             if c.label in seed0 and choice.t_val is not None else None)}
                      for c in camp.candidates if c.method == m] for m in camp.methods()}
    return {
        "protocol": {"config": base, "seeds": camp.seeds, "t_margin": p["t_margin"], "budget": p["budget"],
                     "rule": RULE, "parameters": n_params},
        "t": t, "t_val": choice.t_val, "chosen": choice.chosen, "why": choice.why, "candidates": candidates,
        "table": list(rows.values()),
        "goals": goals(rows, [r.m["accuracy"] for r in complete.get("dturbo", [])]),
        "runs": [{"method": m, "label": m, "setting": r.cand.label, "seed": r.seed, "final_density": r.density,
                  "speedup": speed.get(f"{r.cand.label}_s{r.seed}"), "curve": r.curve()}
                 for m, rs in complete.items() for r in rs],
    }


def _mbit(b: float | None) -> str:
    return "never" if b is None else f"{b / 1e6:.1f}"


def markdown(res: dict[str, Any]) -> str:
    """The report: protocol, rule, the table of chosen settings, the goals, the candidates."""
    p = res["protocol"]
    cfg = p["config"]
    out = [f"Protocol: {cfg['data']['name']}, {cfg['model']['name']} ({p['parameters']:,} parameters), "
           f"{cfg['federation']['clients']} clients, Dirichlet({cfg['federation']['alpha']}), "
           f"{cfg['experiment']['rounds']} rounds of {cfg['train']['local_epochs']:g} local epochs, "
           f"{100 * cfg['data']['validation']:.0f}% of the training set held out for validation; seeds "
           f"{', '.join(map(str, p['seeds']))}; at most {p['budget']} candidates a method.", "",
           f"Choice: {p['rule']}", ""]
    if res["t"] is not None:
        out += [f"T = FedAvg-16's final test accuracy (mean over seeds) - {100 * p['t_margin']:.1f} points = "
                f"**{100 * res['t']:.2f}%**. Bits are 8 x the bytes of every message, up + down. Speedup: each "
                f"seed's exported model against the same network dense, 3000 test images, CPU, 2 threads.", ""]
    head = ["method", "setting", "candidates", "test accuracy (mean +- std)", "nonzero", "bits to T (Mbit)",
            "x FedAvg-16", "total (Mbit)", "bits/param/round up", "down", "speedup (CPU)"]
    rows = []
    ref = next((r for r in res["table"] if r["method"] == "fedavg16"), None)
    for r in res["table"]:
        ratio = (r["bits_to_t"] / ref["bits_to_t"] if ref and ref["bits_to_t"] and r["bits_to_t"] is not None
                 else None)
        reach = ("" if r["seeds_reaching_t"] == len(r["seeds"]) else
                 f" ({r['seeds_reaching_t']} of {len(r['seeds'])} seeds)")
        rows.append([r["name"], f"`{r['setting']}`", str(len(res["candidates"].get(r["method"], []))),
                     f"{100 * r['accuracy']:.2f} +- {100 * r['accuracy_std']:.2f}", f"{100 * r['density']:.1f}%",
                     _mbit(r["bits_to_t"]) + reach, "" if ratio is None else f"{ratio:.3f}",
                     _mbit(r["total_bits"]), f"{r['up_bits_per_param']:.2f}", f"{r['down_bits_per_param']:.2f}",
                     "" if r["speedup"] is None else f"{r['speedup']:.2f}x"])
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(x) + " |" for x in rows)]
    if res["goals"]:
        out += ["", "D-Turbo-VBI's goals:", ""]
        out += [f"* {g['goal']}: {g['value']}: **{'met' if g['met'] else 'missed'}**" for g in res["goals"]]
    out += initial_model(res["table"])
    if wins := peer_wins(res["table"]):
        out += ["", "Where a peer wins against D-Turbo-VBI:", "", *(f"* {w}" for w in wins)]
    out += ["", "Candidates (seed 0, validation split; T_val = "
            + ("" if res["t_val"] is None else f"{100 * res['t_val']:.2f}%") + "):", "",
            "| method | candidate | final validation accuracy | Mbit to T_val | chosen |", "|---|---|---|---|---|"]
    for m, cands in res["candidates"].items():
        for c in cands:
            val = "not run" if c["val_accuracy"] is None else f"{100 * c['val_accuracy']:.2f}%"
            out.append(f"| {NAMES.get(m, m)} | `{c['label']}`: {c['note']} | {val} | "
                       f"{'' if c['val_accuracy'] is None else _mbit(c['val_bits_to_t_val'])} | "
                       f"{'**yes**' if c['chosen'] else ''} |")
    return "\n".join(out) + "\n"


def initial_model(table: list[dict[str, Any]]) -> list[str]:
    """The report's table of round 1's downlink (the initial model, at each method's own precision) and the bits to
    T after it: what bits to T would be if every client built the initial model from a shared seed."""
    rows = {r["method"]: r for r in table}
    stc = rows.get("stc", {}).get("bits_to_t_after_initial")
    out = ["", "Round 1's downlink carries the initial model, at each method's own precision. Bits to T after it:",
           "", "| method | round 1 downlink (Mbit) | bits to T after it (Mbit) | x STC's |", "|---|---|---|---|"]
    for r in table:
        after = r["bits_to_t_after_initial"]
        ratio = "" if after is None or not stc else f"{after / stc:.3f}"
        out.append(f"| {r['name']} | {r['initial_bits'] / 1e6:.2f} | {_mbit(after)} | {ratio} |")
    return out


def figure(res: dict[str, Any], path: Path) -> None:
    """Test accuracy vs cumulative bits (log x) of every method's chosen setting, the mean over seeds; each line
    ends with its speedup; T as a dotted line, each method's bits to T as a marker."""
    import matplotlib.pyplot as plt

    from dturbo.report import _save, bits_log_axis

    fig, ax = plt.subplots(figsize=(8.5, 5.6), layout="constrained")
    for i, row in enumerate(res["table"]):
        curves = [np.array(r["curve"]) for r in res["runs"] if r["method"] == row["method"]]
        n = min(len(c) for c in curves)
        bits = np.mean([c[:n, 1] for c in curves], axis=0)
        acc = 100 * np.mean([c[:n, 2] for c in curves], axis=0)
        color = f"C{i % 10}"
        speed = "" if row["speedup"] is None else f", {row['speedup']:.2f}x faster"
        ax.plot(bits, acc, "-", lw=2.2 if row["method"] == "dturbo" else 1.4, color=color,
                label=f"{row['name']}: {100 * row['accuracy']:.2f}%, {100 * row['density']:.0f}% nonzero{speed}")
        if row["speedup"] is not None:
            ax.annotate(f"{row['speedup']:.2f}x", (bits[-1], acc[-1]), xytext=(4, -3), textcoords="offset points",
                        fontsize=8, color=color)
        if row["bits_to_t"] is not None:
            ax.plot([row["bits_to_t"]], [100 * res["t"]], "o", color=color, ms=5)
    if res["t"] is not None:
        ax.axhline(100 * res["t"], color="0.4", lw=0.8, ls=":")
        ax.annotate(f"T = {100 * res['t']:.2f}%", (0.01, 100 * res["t"]), xycoords=("axes fraction", "data"),
                    xytext=(0, 3), textcoords="offset points", fontsize=8, color="0.3")
    ax.set_xscale("log")
    ax.set(xlabel="cumulative communication, up + down (bits, log scale)", ylabel="test accuracy (%)",
           title="Accuracy vs communication, and the exported model's speedup (mean over seeds)")
    ax.set_ylim(70, 92)
    ax.grid(alpha=0.3, which="major")
    fig.legend(loc="outside lower center", fontsize=8, ncols=2, frameon=False)
    bits_log_axis(ax)
    path.parent.mkdir(parents=True, exist_ok=True)
    _save(fig, path)


def report(camp: h.Campaign, s: h.Settings, docs: Path) -> dict[str, Any]:
    runs = h.load_runs(camp, s)
    speed = {f"{r.cand.label}_s{r.seed}": 1.0 for r in runs if dense_final(r.cand)}
    speed_path = s.results / "joint_speed.json"
    if speed_path.exists():
        speed |= {k: v["speedup"] for k, v in json.loads(speed_path.read_text())["runs"].items()}
    res = summarize(camp, runs, speed)
    res["date"] = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    (s.results / "joint.json").write_text(json.dumps(res, indent=1) + "\n")
    (s.results / "joint.md").write_text(markdown(res))
    if res["table"]:
        figure(res, docs / "results" / "joint.png")
    return res


def time_runs(runs: dict[str, tuple[Path, Path, Path]], base: dict[str, Any], s: h.Settings, sessions: int = 3
              ) -> dict[str, Any]:
    """Time each run ``name: (run directory, models folder, dense network)``: its final model exported into
    ``<models>/exported`` (kept, so that the timing can be repeated without the run directory; the dense network too
    where it is ``<models>/dense``) against the same network dense: 3000 test images of the protocol's data, batch
    3000, 2 threads, ``sessions`` sessions. Returns the machine, the timing, the date and the records by name
    (``runs``)."""
    import speed as sp
    import torch

    from dturbo.data import load_dataset

    ds = load_dataset(base["data"]["name"], s.data_path or h.DEFAULT_DATA[base["data"]["name"]], limit_test=3000,
                      seed=0)
    x = torch.from_numpy(ds.x_test[:3000])
    allocator = sp.reuse_memory()
    records = {}
    for name, (run_dir, models, dense) in runs.items():
        if not (models / "exported").exists():
            if not (run_dir / "model.safetensors").exists():
                h.say(f"{name}: no exported model and no run directory; train it first")
                continue
            sp.export_run(run_dir, models / "exported")
            if dense == models / "dense":
                sp.export_run(run_dir, dense, compaction=False)
        if not dense.exists():
            h.say(f"{name}: no dense network of the protocol's size at {dense}; time D-Turbo-VBI's first")
            continue
        rec = sp.time_pair(models / "exported", dense, x, batches=(3000,), threads=(2,), sessions=sessions)
        records[name] = {k: rec[k] for k in ("speedup", "speedup_sessions", "speedup_eager")}
        h.say(f"{name}: {rec['speedup']:.2f}x (sessions {rec['speedup_sessions']})")
    return {"machine": sp.machine(allocator), "timing": {"samples": 3000, "batch": 3000, "threads": 2,
                                                         "sessions": sessions, "device": "cpu"},
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "runs": records}


def time_chosen(camp: h.Campaign, s: h.Settings, sessions: int = 3, only: list[str] | None = None) -> dict[str, Any]:
    """Every chosen seed's final model of a method whose model can be sparse (of ``only``'s methods; None: all),
    timed by :func:`time_runs` into ``<results>/joint_models/<run>``; a narrow network against D-Turbo-VBI's seed's
    dense export (the protocol's network). The other methods' timings stay as they are."""
    choice = choose(camp, h.load_runs(camp, s))
    by = camp.by_label()
    path = s.results / "joint_speed.json"
    records = json.loads(path.read_text())["runs"] if path.exists() else {}
    runs = {}
    for method, label in choice.chosen.items():
        if dense_final(by[label]) or (only is not None and method not in only):
            continue
        for seed in camp.seeds:
            name = f"{label}_s{seed}"
            models = s.results / "joint_models" / name
            dense = (s.results / "joint_models" / f"{choice.chosen['dturbo']}_s{seed}" / "dense"
                     if narrow(by[label]) else models / "dense")
            runs[name] = (s.runs_root / camp.tag / name, models, dense)
    out = time_runs(runs, camp.base, s, sessions)
    out["runs"] = records | out["runs"]
    path.write_text(json.dumps(out, indent=1) + "\n")
    return out


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
    ap.add_argument("--sessions", type=int, default=3, help="time: timing sessions per model")
    ap.add_argument("--docs", type=Path, default=h.ROOT / "docs", help="report: where docs/results/joint.png goes")
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
        # Every run reused from another campaign, and seed 0 of every method's chosen setting, its first rounds
        # trained again with this code: the cache holds what this code computes.
        bad = 0
        checked = {}
        chosen = {f"{label}_s{camp.seeds[0]}" for label in choose(camp, h.load_runs(camp, s)).chosen.values()}
        for job in select_jobs(camp, s, index) + seed_jobs(camp, s, index):
            path = job.source or job.committed / f"{job.name}.csv"
            if job.status not in ("reuse", "done") or not (h.trained_elsewhere(path, camp.tag) or job.name in chosen):
                continue
            if args.only is not None and job.cand.method not in args.only:
                continue
            diffs = h.verify(job, path, args.rounds)
            bad += bool(diffs)
            checked[job.name] = {"trained_as": h.run_name(path), "rounds": args.rounds, "differences": diffs}
            print(f"{job.name} ({h.run_name(path)}): first {args.rounds} rounds "
                  f"{'identical' if not diffs else 'DIFFER: ' + '; '.join(diffs)}", flush=True)
        (s.results / "joint_verify.json").write_text(json.dumps(
            {"what": "runs trained by an earlier campaign with the same resolved config, and seed 0 of each method's "
                     "chosen setting, their first rounds trained again with this code and compared column by column",
             "machine": h.machine(), "runs": checked}, indent=1) + "\n")
        return 1 if bad else 0
    elif args.command == "time":
        time_chosen(camp, s, args.sessions, args.only)
    elif args.command == "report":
        res = report(camp, s, args.docs)
        print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
