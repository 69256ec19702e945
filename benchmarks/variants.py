"""D-Turbo-VBI's chosen joint setting with one option changed at a time, on the joint protocol.

The joint comparison's chosen setting (``results/joint.json``'s ``chosen``) runs its 3 seeds again once per entry of
:data:`VARIANTS` (``runs/variants/``, curves committed in ``results/variants_runs/``); the chosen setting's own runs
are the joint campaign's. Not tuning candidates: each asks what one option costs and saves, seed by seed.

* ``down2``: the downlink (the update from what each client holds, clipped levels, error feedback) at 2 bits
  instead of 3; its axis: total bits.
* ``trained``: ``global_model = "trained"``, the round's model the aggregate on the support its clients trained
  (the same messages); its axis: the largest drop of validation accuracy from one round to the next after round 3.
* ``cut``: ``dead_units = "cut"``, the weights joined to a unit that carries nothing off the support (fewer values
  in every message), with the library's sampling, ``"detached"``; it is judged against the chosen setting under
  ``sampling = "detached"`` (sampling.py's runs), so that one option differs; its axis: total bits.
* ``flops``: ``sparsity.budget = "flops"``, the prior deciding how many channels each convolution keeps under one
  compute budget (0.38 of the multiply-adds, the chosen setting's support's share), instead of the convolutions'
  hand-set ``layer_targets``; the dense layers at the chosen setting's mean density (0.19, by the group selector),
  the classifier whole. Its axis: the exported model's speedup over the same network dense (``time``: the variant's
  and the chosen setting's exported models timed in one session, as joint.py times); faster means faster on every
  seed than the chosen setting on any seed (a tie is not a win).
* ``flops_floor``: ``flops`` with ``sparsity.min_layer_density = 0.19`` (the dense layers' density, which it
  leaves as they are): under ``flops`` alone the prior leaves conv1, conv2 and conv3 one channel each by round 9
  of seeds 0 and 1 (the shared field, scaled by each weight's multiply-adds, is steepest on the early
  convolutions); the floor keeps 2 of conv1's 6 channels, 4 of conv2's 16 and 7 of conv3's 32 at least. Its axis:
  speedup, as ``flops``'s.
* ``flops_sqrt``: ``flops`` with ``sparsity.cost_power = 0.5``: each weight's field (u / mean u) ** 0.5 times the
  shared one instead of u / mean u (on the convolutions 3.7x, 1.7x, 0.8x and 0.8x in place of 13.8x, 3.0x, 0.6x
  and 0.6x), so that the cost still steers which channels go without emptying the early convolutions, and no floor.
  Its axis: speedup, as ``flops``'s.
* ``up_sign``: ``up_quantizer = "sign"`` (``up_bits = 1``): the update up as its signs times each layer's mean
  magnitude, what it rounds off kept by the client and added to its next upload (error feedback), instead of QSGD's
  unbiased 15 levels; its axis: total bits.
* ``down_sign``: ``down_quantizer = "sign"``: the downlink's update from what each client holds as signs times each
  layer's mean magnitude (the server's error feedback sends what it rounds off again), instead of 3 bits on levels
  clipped at 3 root mean squares; the first downlink, to a client that holds nothing, stays on 3-bit max levels; its
  axis: total bits.
* ``settled_sign``: ``down_quantizer = "settled_sign"``: ``down_sign``'s signs only from the round after the support
  first has its target density (round 16 of the chosen setting's 1 warm-up and 14 ramp rounds), the ramp's downlinks
  on the chosen setting's 3-bit clipped levels: ``down_sign``'s seeds fall behind the chosen setting's in the ramp
  (validation after round 2: 65.2%, 55.9% and 45.5% against 74.4%, 70.0% and 55.5%), where the updates are large
  and the support moves; its axis: total bits.
* ``library``: the library's default sampling and round model, where the joint campaign's candidates keep ``local``
  and ``cut``: ``sampling = "detached"`` (local training 1.26x FedAvg's in the steady state against local's 1.92x,
  ``results/round_time.md``) and ``global_model = "trained"``, together in one run; its axis: the largest drop, as
  ``trained``'s.
* ``settled_cut``: ``settled_sign``, ``dead_units = "cut"`` and ``global_model = "trained"`` together, with the chosen
  setting's sampling (``local``): the two options that each send fewer bits, and the round model without the
  drops; its axis: total bits.
* ``settled_cut_t30``: ``settled_cut`` with ``target_density = 0.30``: the convolutions keep their ``layer_targets``,
  so the weights added are the dense layers' (they hold most of the weights and little of the compute); its axis:
  validation accuracy, judged against ``settled_cut``.
* ``settled_cut_t35``: the same at 0.35, judged on validation accuracy against ``settled_cut_t30``.
* ``down_ternary``: ``down_quantizer = "ternary"`` with ``down_share = 0.1`` (STC's chosen share): the downlink's
  update as STC's server sends it, the tenth of each layer's values largest in magnitude as signs times their mean
  magnitude, the rest 0 (the server's error feedback sends them later), instead of 3 bits on clipped levels; the
  first downlink stays on 3-bit max levels; its axis: total bits.
* ``settled_ternary``: ``down_quantizer = "settled_ternary"``: ``down_ternary``'s code only after the support has
  settled, the ramp's downlinks on 3-bit clipped levels: ``settled_sign`` with a tenth of the values a round in place
  of all their signs; its axis: total bits, judged against ``settled_sign``.
* ``rerun``: the chosen setting itself, trained again on a CPU whose kernels round differently from the one that
  trained the joint campaign (``joint.py verify`` finds round 1 different there); not judged: the spread it shows is
  what rounding alone moves, the noise under every comparison here.
* ``biases``: ``biases = "as_mu"``: each layer's biases travel as mu does, in their own field, instead of as float16
  values both ways: up as the update from the biases received on the uplink's levels (QSGD's, 5 bits, range-coded),
  down as the update from the biases each client holds on the downlink's (3-bit clipped levels, error feedback):
  alexnet-small's 332 biases are 664 bytes a message in float16. Its axis: total bits.
* ``settled_biases``: ``settled_sign`` with ``biases = "as_mu"`` (the biases as signs once the support has settled);
  its axis: total bits, judged against ``settled_sign``.
* ``settled_biases_nearest``: ``settled_biases`` with ``down_rounding = "nearest"``: the ramp's downlinks round each
  value of the update to the nearest of 7 clipped levels (0 among them) instead of stochastically onto 8: half the
  error of a value, and the small values on one symbol (``tests/test_down_update.py`` tracks both roundings on
  synthetic updates); the ramp holds most of the downlink's bits. Its axis: total bits, judged against
  ``settled_biases``.
* ``nearest``: the chosen setting with ``down_rounding = "nearest"``: its 3-bit clipped downlink on 7 levels, each
  value to its nearest, in every round; its axis: total bits.
* ``settled_nearest``: ``settled_sign`` with ``down_rounding = "nearest"`` and the biases as float16 values:
  ``settled_biases_nearest`` without ``biases = "as_mu"``, whose seeds end lower on test than ``settled_sign``'s; its
  axis: total bits, judged against ``settled_sign``.
* ``partial``: the chosen setting with ``clients_per_round = 5`` (half the clients a round, drawn each round): a
  client's downlink is the update from the weights it held when it last took part, however many rounds ago, its
  error feedback the server's for that client; its axis: total bits, judged against ``partial_values8``.
* ``partial_values8``: ``partial`` with ``down_mu = "values"`` and ``down_bits = 8`` (mu_G on the support at 8 bits
  on max levels, what a client gets whatever it holds): the reference of ``partial``, not judged. Both change the
  protocol (5 clients a round), so their bits are not set against STC's.
* ``settled_t30``: ``settled_cut_t30`` with ``dead_units = "kept"``: the ``settled_cut`` family's seeds 1 and 2 end
  below T where ``settled_sign``'s do not, and ``cut`` costs 0.27 test points under ``detached``; its axis: total
  bits. The family is timed (``time``) beside the variants judged on speed.

The rule, fixed before the runs: a variant is recommended when its mean final validation accuracy is at most
``MARGIN`` below its reference's (the chosen setting's runs, or those it names) and it is better on its axis (means
over the seeds; validation only, test accuracy and bits to T are reported).
Writes ``benchmarks/results/variants.{json,md}`` (``time``: ``variants_speed.json``, the exported models in
``variants_models/``).

Usage: .venv/bin/python benchmarks/variants.py [plan|run|time|report] [--jobs 2] [--only VARIANT ...]
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
from joint import _mbit, faster, largest_drop, per_param, time_runs  # noqa: E402
from sampling import campaigns as sampling_campaigns  # noqa: E402
from sampling import dispatch, seed_table, shape  # noqa: E402

# budget = "flops" on the chosen setting's compute: its support's share of the multiply-adds, its dense layers' density
FLOPS = {"dturbo.sparsity.budget": "flops", "dturbo.sparsity.target_density": 0.38,
         "dturbo.sparsity.layer_targets": {"dense": 0.19, "last": 1.0}}
UP_SIGN = {"dturbo.transmission.up_bits": 1, "dturbo.transmission.up_quantizer": "sign"}
DOWN_SIGN = {"dturbo.transmission.down_quantizer": "sign"}
# the two options that each send fewer bits (settled signs down, dead units cut), on the library's round model
SETTLED_CUT = {"dturbo.transmission.down_quantizer": "settled_sign", "dturbo.dead_units": "cut",
               "dturbo.global_model": "trained"}
PARTIAL = {"federation.clients_per_round": 5}
# name: (the options it changes, what it is, the row's key it is judged on (lower is better, but for speedup and
# val_accuracy), the runs it is judged against: REFERENCE, the joint campaign's, "detached", sampling.py's with
# sampling = "detached", or another variant's)
VARIANTS: dict[str, tuple[dict[str, Any], str, str, str]] = {
    "down2": ({"dturbo.transmission.down_bits": 2}, "down_bits = 2", "total_bits", "chosen"),
    "trained": ({"dturbo.global_model": "trained"}, 'global_model = "trained"', "val_drop", "chosen"),
    "cut": ({"dturbo.sampling": "detached", "dturbo.dead_units": "cut"}, 'dead_units = "cut" (sampling detached)',
            "total_bits", "detached"),
    "flops": (FLOPS, 'budget = "flops" (the convolutions\' channels by the prior)', "speedup", "chosen"),
    "flops_floor": (FLOPS | {"dturbo.sparsity.min_layer_density": 0.19},
                    'budget = "flops", each layer at least 0.19 of its channels', "speedup", "chosen"),
    "flops_sqrt": (FLOPS | {"dturbo.sparsity.cost_power": 0.5},
                   'budget = "flops", the field by the square root of the cost', "speedup", "chosen"),
    "up_sign": (UP_SIGN, 'up_quantizer = "sign"', "total_bits", "chosen"),
    "down_sign": (DOWN_SIGN, 'down_quantizer = "sign"', "total_bits", "chosen"),
    "settled_sign": ({"dturbo.transmission.down_quantizer": "settled_sign"},
                     'down_quantizer = "settled_sign"', "total_bits", "chosen"),
    "library": ({"dturbo.sampling": "detached", "dturbo.global_model": "trained"},
                'sampling = "detached", global_model = "trained" (the library\'s)', "val_drop", "chosen"),
    "settled_cut": (SETTLED_CUT, 'settled_sign, dead_units = "cut", global_model = "trained"', "total_bits",
                    "chosen"),
    "settled_cut_t30": (SETTLED_CUT | {"dturbo.sparsity.target_density": 0.30},
                        "settled_cut with target_density = 0.30 (the dense layers' share up)", "val_accuracy",
                        "settled_cut"),
    "settled_cut_t35": (SETTLED_CUT | {"dturbo.sparsity.target_density": 0.35},
                        "settled_cut with target_density = 0.35", "val_accuracy", "settled_cut_t30"),
    "settled_t30": (SETTLED_CUT | {"dturbo.dead_units": "kept", "dturbo.sparsity.target_density": 0.30},
                    "settled_cut_t30 with dead_units kept", "total_bits", "chosen"),
    "down_ternary": ({"dturbo.transmission.down_quantizer": "ternary", "dturbo.transmission.down_share": 0.1},
                     'down_quantizer = "ternary" (a tenth of the update)', "total_bits", "chosen"),
    "settled_ternary": ({"dturbo.transmission.down_quantizer": "settled_ternary",
                         "dturbo.transmission.down_share": 0.1},
                        'down_quantizer = "settled_ternary"', "total_bits", "settled_sign"),
    "rerun": ({}, "the chosen setting, trained again on another CPU", "none", "chosen"),
    "biases": ({"dturbo.transmission.biases": "as_mu"}, 'biases = "as_mu"', "total_bits", "chosen"),
    "settled_biases": ({"dturbo.transmission.down_quantizer": "settled_sign", "dturbo.transmission.biases": "as_mu"},
                       'settled_sign, biases = "as_mu"', "total_bits", "settled_sign"),
    "settled_biases_nearest": ({"dturbo.transmission.down_quantizer": "settled_sign",
                                "dturbo.transmission.biases": "as_mu", "dturbo.transmission.down_rounding": "nearest"},
                               'settled_biases, down_rounding = "nearest"', "total_bits", "settled_biases"),
    "nearest": ({"dturbo.transmission.down_rounding": "nearest"}, 'down_rounding = "nearest"', "total_bits",
                "chosen"),
    "settled_nearest": ({"dturbo.transmission.down_quantizer": "settled_sign",
                         "dturbo.transmission.down_rounding": "nearest"},
                        'settled_sign, down_rounding = "nearest"', "total_bits", "settled_sign"),
    "partial": (PARTIAL, "5 of 10 clients a round (the chosen update downlink)", "total_bits", "partial_values8"),
    "partial_values8": (PARTIAL | {"dturbo.transmission.down_mu": "values", "dturbo.transmission.down_bits": 8,
                                   "dturbo.transmission.down_quantizer": "max"},
                        '5 of 10 clients a round, down_mu = "values" at 8 bits', "none", "chosen"),
}
# the variants that change the protocol (a key outside [dturbo]): their bits are not set against STC's
OTHER_PROTOCOL = {name for name, (changes, _, _, _) in VARIANTS.items() if any(not k.startswith("dturbo.")
                                                                                 for k in changes)}
AXES = {"total_bits": "fewer total bits", "val_drop": "a smaller largest drop of validation accuracy after round 3",
        "speedup": "a faster exported model on every seed", "val_accuracy": "a higher mean validation accuracy",
        "none": ""}  # "none": a control, not judged
# timed beside those judged on speed: variants whose support differs from the chosen setting's
TIMED = {"settled_cut", "settled_cut_t30", "settled_cut_t35", "settled_t30"}
REFERENCE = "chosen"
REFERENCES = {REFERENCE: "the chosen setting", "detached": 'sampling = "detached"'}
MARGIN = 0.002  # in accuracy: 0.2 points, as sampling.py's


def campaigns(s: h.Settings) -> tuple[h.Campaign, h.Campaign, str]:
    """(the joint campaign, this one: its chosen D-Turbo-VBI setting once per variant, that setting's label)."""
    joint = h.load_campaign(HERE / "joint.toml")
    chosen = json.loads((s.results / "joint.json").read_text())["chosen"]["dturbo"]
    base = joint.by_label()[chosen]
    cands = [replace(base, label=f"{chosen}_{name}", overrides={**base.overrides, **changes},
                     note=f"{base.note}; {what}") for name, (changes, what, _, _) in VARIANTS.items()]
    return joint, h.Campaign("variants", joint.protocol, cands), chosen


def row(run: h.Run, variant: str, t: float, speed: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return ({"variant": variant} | shape(run, t)
            | {"initial_bits": float(run.m["down_bits"][0]), "val_drop": largest_drop(run.m["val_accuracy"]),
               # the steady state, as joint.py's: the mean downlink of the last rounds, per participating client
               "steady_down_mbit": per_param(run, "down", 1) / 1e6,
               "speedup": speed.get(f"{run.cand.label}_s{run.seed}", {}).get("speedup")})


def time_speedups(s: h.Settings, sessions: int = 3) -> dict[str, Any]:
    """The exported models of every variant judged on speed and of the chosen setting, one session
    (``joint.time_runs``), each against the chosen setting's seed's dense network."""
    joint, camp, chosen = campaigns(s)
    runs = {}
    for seed in camp.seeds:
        dense = s.results / "joint_models" / f"{chosen}_s{seed}" / "dense"
        runs[f"{chosen}_s{seed}"] = (s.runs_root / joint.tag / f"{chosen}_s{seed}", dense.parent, dense)
        for name, (_, _, axis, _) in VARIANTS.items():
            if axis == "speedup" or name in TIMED:
                label = f"{chosen}_{name}_s{seed}"
                runs[label] = (s.runs_root / camp.tag / label, s.results / "variants_models" / label, dense)
    out = time_runs(runs, camp.base, s, sessions)
    (s.results / "variants_speed.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


def summarize(rows: list[dict[str, Any]], seeds: int) -> dict[str, dict[str, Any]]:
    """Per variant: the seeds' means (None where a seed never reaches T), the largest drops, the seeds reaching T."""
    out = {}
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]

        def mean(key: str, mine: list[dict[str, Any]] = mine) -> float | None:
            xs = [r[key] for r in mine]
            return None if any(x is None for x in xs) else float(np.mean(xs))

        after = [None if r["bits_to_t"] is None else r["bits_to_t"] - r["initial_bits"] for r in mine]
        speed = [r["speedup"] for r in mine]
        out[name] = {"accuracy": mean("accuracy"), "val_accuracy": mean("val_accuracy"),
                     "bits_to_t": mean("bits_to_t"),
                     "bits_to_t_after_initial": None if None in after else float(np.mean(after)),
                     "total_bits": mean("total_bits"), "steady_down_mbit": mean("steady_down_mbit"),
                     "largest_drop": max(r["largest_drop"] for r in mine), "val_drop": mean("val_drop"),
                     "speedup": mean("speedup"),
                     "speedup_range": None if None in speed else [min(speed), max(speed)],
                     "seeds_reaching_t": sum(r["bits_to_t"] is not None for r in mine), "seeds": seeds}
    return out


def better(axis: str, a: dict[str, Any], b: dict[str, Any]) -> bool:
    """``a`` better than ``b`` on ``axis``: a higher mean (val_accuracy), faster on every seed than ``b`` on any
    (speedup), else a lower mean."""
    if axis == "val_accuracy":
        return a[axis] > b[axis]
    if axis == "speedup":
        return a["speedup_range"] is not None and b["speedup_range"] is not None and \
            faster(a["speedup_range"], b["speedup_range"])
    return a[axis] < b[axis]


def recommend(summary: dict[str, dict[str, Any]]) -> dict[str, bool]:
    """The rule of the module docstring, per variant against its reference's runs: validation only."""
    return {name: (summary[name]["val_accuracy"] >= summary[ref]["val_accuracy"] - MARGIN
                   and better(axis, summary[name], summary[ref]))
            for name, (_, _, axis, ref) in VARIANTS.items() if name in summary and ref in summary and axis != "none"}


def vs_stc(x: float | None, key: str, name: str, stc: dict[str, Any] | None) -> str:
    """`` (0.816x STC's)``: a variant's bits against the joint table's STC row, none for another protocol's."""
    return "" if x is None or stc is None or not stc.get(key) or name in OTHER_PROTOCOL else \
        f" ({x / stc[key]:.3f}x STC's)"


def report(s: h.Settings) -> None:
    joint, camp, chosen = campaigns(s)
    res_joint = json.loads((s.results / "joint.json").read_text())
    t = float(res_joint["t"])
    runs = h.load_runs(camp, s)
    done = [r for r in runs if sum(o.cand.label == r.cand.label for o in runs) == len(camp.seeds)]
    speed_path = s.results / "variants_speed.json"
    speed = json.loads(speed_path.read_text())["runs"] if speed_path.exists() else {}
    if not done:
        raise h.HarnessError(f"no variant has all {len(camp.seeds)} seeds done: run `benchmarks/variants.py run` "
                             f"first")
    rows = [row(r, REFERENCE, t, speed) for r in h.load_runs(joint, s) if r.cand.label == chosen]
    if any(VARIANTS[r.cand.label.removeprefix(f"{chosen}_")][3] == "detached" for r in done):
        _, sampling_camp, _ = sampling_campaigns(s)
        rows += [row(r, "detached", t, speed) for r in h.load_runs(sampling_camp, s)
                 if r.cand.label == f"{chosen}_detached"]
    rows += [row(r, r.cand.label.removeprefix(f"{chosen}_"), t, speed)
             for r in sorted(done, key=lambda r: (r.cand.label, r.seed))]
    summary = summarize(rows, len(camp.seeds))
    recommended = recommend(summary)
    stc = next((r for r in res_joint["table"] if r["method"] == "stc"), None)
    res = {"setting": chosen, "t": t, "seeds": camp.seeds, "margin": MARGIN,
           "variants": {name: {"set": changes, "axis": axis, "reference": ref}
                        for name, (changes, _, axis, ref) in VARIANTS.items()},
           "summary": summary, "recommended": recommended, "runs": rows,
           "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}

    what = REFERENCES | {name: v[1] for name, v in VARIANTS.items()}

    def speedups(v: dict[str, Any]) -> str:
        return "" if v["speedup_range"] is None else \
            f"{v['speedup']:.2f}x ({v['speedup_range'][0]:.2f}-{v['speedup_range'][1]:.2f}x)"
    md = [f"D-Turbo-VBI's chosen joint setting `{chosen}` with one option changed (or the options a row names, "
          f"together), on the joint protocol (3 seeds; "
          f"T = {t:.2%}).", "",
          *seed_table(rows, "variant", lambda r: what[r["variant"]],
                      {"steady downlink (Mbit a client)": lambda r: f"{r['steady_down_mbit']:.3f}",
                       "speedup": lambda r: "" if r["speedup"] is None else f"{r['speedup']:.2f}x",
                       "largest drop after round 3 (test / validation)":
                           lambda r: f"{r['largest_drop'] * 100:.1f} / {r['val_drop'] * 100:.1f} points"})]
    md += ["", "| variant | mean validation accuracy | mean test accuracy | seeds reaching T | mean Mbit to T | "
               "after round 1's downlink | mean total Mbit | largest drop after round 3 (test) | speedup (seeds) | "
               "recommended |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in summary.items():
        rec = "yes" if recommended.get(name) else "" if name not in recommended else "no"
        md.append(f"| {what[name]} | {v['val_accuracy']:.2%} | {v['accuracy']:.2%} | {v['seeds_reaching_t']} of "
                  f"{v['seeds']} | {_mbit(v['bits_to_t'])}{vs_stc(v['bits_to_t'], 'bits_to_t', name, stc)} | "
                  f"{_mbit(v['bits_to_t_after_initial'])}"
                  f"{vs_stc(v['bits_to_t_after_initial'], 'bits_to_t_after_initial', name, stc)} | "
                  f"{_mbit(v['total_bits'])} | "
                  f"{v['largest_drop'] * 100:.1f} points | {speedups(v)} | {rec} |")
    md += ["", f"Recommended: a variant whose mean validation accuracy is at most {100 * MARGIN:.1f} points below its "
               f"reference's and that is better on its axis ("
               + "; ".join(f"{what[name]}: {AXES[axis]} than {what[ref]}"
                           for name, (_, _, axis, ref) in VARIANTS.items() if name in summary and axis != "none")
               + ")."]
    h.write_results(s.results, "variants", res, "\n".join(md) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", nargs="?", default="plan", choices=["plan", "run", "time", "report"])
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (one torch thread each)")
    ap.add_argument("--only", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                    help="train these variants' runs (another process may be training the others)")
    ap.add_argument("--sessions", type=int, default=3, help="time: timing sessions per model")
    args = ap.parse_args(argv)
    s = h.Settings()
    if args.command == "time":
        time_speedups(s, args.sessions)
        return 0
    _, camp, chosen = campaigns(s)
    wanted = {f"{chosen}_{name}" for name in args.only}
    return dispatch(args.command, camp, s, lambda j: j.cand.label in wanted, args.jobs, report)


if __name__ == "__main__":
    sys.exit(main())
