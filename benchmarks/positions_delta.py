"""What ``[dturbo.transmission] positions = "delta"`` saves on the frontier's chosen setting (issue 12, "Positions").

    python benchmarks/positions_delta.py [--runs runs/frontier] [--setting dturbo_warm2] [--seeds 0 1 2]

No training: the frontier's recorded runs (``runs/frontier/<setting>_s<seed>``, made by ``benchmarks/frontier.py``)
hold every round's support (``messages/round_NNNN.safetensors``, key ``<layer>.mask``: the support after round
NNNN's server step, i.e. the S that round NNNN + 1's downlink carries; round 1's downlink carries the initial S,
every weight with 2 dense warm-up rounds). For each round this script codes the supports exactly as
``DturboMessages`` does, once whole (``positions = "full"``: it must give the recorded ``down_positions_bits``,
which checks the round alignment) and once against the previous round's support, the one every client holds in
that protocol (10 clients, all of them every round, no faults: each decoded the previous downlink). The coding is
lossless, so accuracy, density and the uplink are those recorded (tests/test_positions_delta.py runs both ways
and finds every metric equal but the downlink's bits); the downlink changes by the support fields' bytes, their
framing and the base round's 8 bytes in ``meta``, all counted here per client.

Steady state as in benchmarks/frontier.py: the mean over the last 5 rounds of bits / (participants x parameters),
parameters = weights + biases of the model. Results: benchmarks/results/positions_delta.{json,md}.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from dturbo.codec import encode_message, encode_support, encode_support_delta, payload_bits  # noqa: E402
from dturbo.config import load_config  # noqa: E402
from dturbo.nn.models import build_model  # noqa: E402

STEADY_ROUNDS = 5  # benchmarks/frontier.py: the steady state is the mean over the last 5 rounds
META_EXTRA_BYTES = 8  # positions = "delta": meta's third float64 scalar, the base round
INPUTS = {"fashion-mnist": ((1, 28, 28), 10), "mnist": ((1, 28, 28), 10), "cifar10": ((3, 32, 32), 10)}


def field_bytes(name: str, payload: bytes) -> int:
    """Bytes one field takes in a framed message (name, length, payload)."""
    return len(encode_message("k", [(name, payload)])) - len(encode_message("k", []))


def model_params(model: str, dataset: str, hidden: list[int], width: float) -> int:
    """Weights + biases, as benchmarks/frontier.py's model_params."""
    shape, classes = INPUTS[dataset]
    net = build_model(model, shape, classes, hidden=tuple(hidden), width=width)
    return sum(p.numel() for n, p in net.named_parameters() if n.endswith(("weight_mu", "bias")))


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def measure(run: Path) -> dict:
    """Per round: the recorded and re-coded full positions, and the delta's positions and whole downlink."""
    cfg = load_config(run / "config.toml")
    tr = cfg.dturbo.transmission
    assert tr.down_bits < 16 and tr.positions == "full", "a recorded run with positions travelling whole"
    rows = read_rows(run / "metrics.csv")
    masks = [load_file(run / "messages" / f"round_{r:04d}.safetensors") for r in range(1, len(rows))]
    layers = [k[: -len(".mask")] for k in masks[0] if k.endswith(".mask")]
    # round 1's downlink: the initial support, every weight (dense warm-up; no float16 mu of the init rounds to 0)
    assert cfg.dturbo.sparsity.warmup_rounds > 0, "round 1's support is the initial one only with a warm-up"
    first = {n: np.ones(masks[0][f"{n}.mask"].shape, bool) for n in layers}
    carried = [first] + [{n: m[f"{n}.mask"].astype(bool) for n in layers} for m in masks]
    out = []
    held = None
    for row, supports in zip(rows, carried, strict=True):
        receivers = int(row["participants"]) * (int(row["retries"]) + 1)
        full_pos = delta_pos = change = 0
        flips = 0
        for n in layers:
            whole = encode_support(supports[n], value_bits=tr.down_bits)
            delta = encode_support_delta(supports[n], None if held is None else held[n], value_bits=tr.down_bits,
                                         full=whole)
            full_pos += payload_bits(whole, "support")["positions"]
            delta_pos += payload_bits(delta, "support_delta")["positions"]
            change += field_bytes(f"{n}.support", delta) - field_bytes(f"{n}.support", whole)
            flips += 0 if held is None else int(np.count_nonzero(supports[n] != held[n]))
        change += META_EXTRA_BYTES
        down = int(row["down_bits"])
        out.append({
            "round": int(row["round"]), "participants": int(row["participants"]),
            "density_carried": float(np.mean(np.concatenate([s.reshape(-1) for s in supports.values()]))),
            "flips": flips,
            "down_positions_bits_recorded": int(row["down_positions_bits"]),
            "down_positions_bits_full": full_pos * receivers,
            "down_positions_bits_delta": delta_pos * receivers,
            "down_bits_full": down, "down_bits_delta": down + 8 * change * receivers,
            "up_bits": int(row["up_bits"]),
        })
        held = supports  # every client decoded this round's downlink (all selected, no faults)
    bad = [r["round"] for r in out if r["down_positions_bits_full"] != r["down_positions_bits_recorded"]]
    assert not bad, f"{run}: re-coded full positions differ from the recorded ones in rounds {bad}"
    params = model_params(cfg.model.name, cfg.data.name, list(cfg.model.hidden), cfg.model.width)
    last = out[-STEADY_ROUNDS:]

    def steady(key: str) -> float:
        return float(np.mean([r[key] / (r["participants"] * params) for r in last]))

    return {
        "run": run.name, "params": params, "rounds": out,
        "steady_bits_per_param_round": {"up": steady("up_bits"), "down_full": steady("down_bits_full"),
                                        "down_delta": steady("down_bits_delta"),
                                        "down_positions_full": steady("down_positions_bits_full"),
                                        "down_positions_delta": steady("down_positions_bits_delta")},
        "total_mbit": {"up": sum(r["up_bits"] for r in out) / 1e6,
                       "down_full": sum(r["down_bits_full"] for r in out) / 1e6,
                       "down_delta": sum(r["down_bits_delta"] for r in out) / 1e6,
                       "positions_full": sum(r["down_positions_bits_full"] for r in out) / 1e6,
                       "positions_delta": sum(r["down_positions_bits_delta"] for r in out) / 1e6},
    }


def table(results: list[dict]) -> str:
    head = ["| seed run | steady up | steady down full -> delta | steady positions full -> delta | total Mbit full "
            "-> delta (up + down) | positions Mbit full -> delta |", "|---|---|---|---|---|---|"]
    lines = []
    for r in results:
        s, t = r["steady_bits_per_param_round"], r["total_mbit"]
        lines.append(f"| {r['run']} | {s['up']:.3f} | {s['down_full']:.3f} -> {s['down_delta']:.3f} | "
                     f"{s['down_positions_full']:.3f} -> {s['down_positions_delta']:.3f} | "
                     f"{t['up'] + t['down_full']:.1f} -> {t['up'] + t['down_delta']:.1f} | "
                     f"{t['positions_full']:.2f} -> {t['positions_delta']:.2f} |")
    return "\n".join(head + lines)


def per_round(results: list[dict]) -> str:
    head = ["| round | " + " | ".join(f"{r['run']} flips / positions full -> delta (kbit)" for r in results) + " |",
            "|---|" + "---|" * len(results)]
    lines = []
    for i in range(len(results[0]["rounds"])):
        got = [r["rounds"][i] for r in results]
        cells = [f"{x['flips']} / {x['down_positions_bits_full'] / 1e3:.1f} -> "
                 f"{x['down_positions_bits_delta'] / 1e3:.1f}" for x in got]
        lines.append(f"| {results[0]['rounds'][i]['round']} | " + " | ".join(cells) + " |")
    return "\n".join(head + lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "frontier")
    ap.add_argument("--setting", default="dturbo_warm2")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    results = [measure(args.runs / f"{args.setting}_s{seed}") for seed in args.seeds]
    mean = {k: float(np.mean([r["steady_bits_per_param_round"][k] for r in results]))
            for k in results[0]["steady_bits_per_param_round"]}
    tot = {k: float(np.mean([r["total_mbit"][k] for r in results])) for k in results[0]["total_mbit"]}
    summary = {"setting": args.setting, "seeds": args.seeds, "steady_rounds": STEADY_ROUNDS,
               "mean_steady_bits_per_param_round": mean, "mean_total_mbit": tot, "runs": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "positions_delta.json").write_text(json.dumps(summary, indent=1) + "\n")
    md = [f"# `positions = \"delta\"` on `{args.setting}` (benchmarks/positions_delta.py)", "",
          "Recorded supports of the frontier runs re-coded: whole (equal to the recorded positions, round by round) "
          "and as the flips since the previous round's support, which every client holds in that protocol. Bits "
          f"per parameter per round per client, steady = mean of the last {STEADY_ROUNDS} rounds; totals over the "
          "run's rounds. Lossless: accuracy, density and the uplink are the recorded ones.", "",
          table(results), "",
          f"Mean of {len(results)} seeds: steady down {mean['down_full']:.3f} -> {mean['down_delta']:.3f} "
          f"bits/param/round (positions {mean['down_positions_full']:.3f} -> {mean['down_positions_delta']:.3f}), "
          f"up {mean['up']:.3f}; total {tot['up'] + tot['down_full']:.1f} -> {tot['up'] + tot['down_delta']:.1f} "
          f"Mbit.", "", "## Per round (all clients)", "", per_round(results), ""]
    (args.out / "positions_delta.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
