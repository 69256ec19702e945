"""D-Turbo-VBI as a Flower strategy in a user's app, against ``dturbo run``: the same final accuracy and bits.

Usage: OMP_NUM_THREADS=1 python benchmarks/flower_strategy.py [--out runs/flower_strategy] [--rounds 12]

Two runs of the ``quick`` preset (Fashion-MNIST, alexnet-small, 10 clients, Dirichlet(0.5), seed 0), both with
``experiment.threads = 1``:

* ``dturbo run --preset quick`` (the command line, in a subprocess);
* the example app's logic (examples/flower-app: a ServerApp with :class:`dturbo.flower.DTurboVBI`, a ClientApp
  whose handlers call :func:`dturbo.flower.fit` / :func:`dturbo.flower.count_samples`) on Flower's simulation engine
  (``flwr.simulation.run_simulation``, 10 virtual SuperNodes, one Ray worker of one CPU), with ``dturbo run``'s
  model (:func:`dturbo.nn.models.build_model` via the seeded factory of the config) and data split
  (:func:`dturbo.federation.build_federation`, each node taking its ``partition-id``'s share) in place of the
  example's own CNN and IID split. The server evaluates the global model on the test set after every round
  (``evaluate_fn``), as ``dturbo run`` does; there is no federated evaluation.

Writes benchmarks/results/flower_strategy.{json,md}: accuracy, density and bits per round of both, the final model's
difference, Flower's Message sizes beside dturbo's ledger, and the wall times.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PRESET = "quick"
OVERRIDES = ["experiment.threads=1"]


def run_cli(out: Path, rounds: int) -> tuple[list[dict[str, str]], float]:
    """``dturbo run --preset quick`` into ``out``: its metrics rows and wall seconds."""
    if out.exists():
        shutil.rmtree(out)
    sets = [*OVERRIDES, f"experiment.rounds={rounds}"]
    cmd = [sys.executable, "-m", "dturbo", "run", "--preset", PRESET, "--out", str(out), "--no-figures"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    seconds = time.perf_counter() - t0
    with open(out / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f)), seconds


# The ClientApp's handlers and what they read live at module level: Ray ships them to its worker by value, and a
# local function (or an lru_cache around one) does not pickle.
_FEDERATION: dict[str, Any] = {}


def federation() -> Any:
    """``dturbo run``'s data split of the preset (built once per process): every node takes its partition-id's part."""
    if "fed" not in _FEDERATION:
        import torch

        from dturbo.federation import build_federation
        from dturbo.settings import load_config

        torch.set_num_threads(1)
        _FEDERATION["cfg"] = cfg = load_config(preset=PRESET, overrides=OVERRIDES)
        _FEDERATION["fed"] = build_federation(cfg)
    return _FEDERATION["fed"]


def model() -> Any:
    """``dturbo run``'s model of the preset: alexnet-small, built and seeded as the runner builds it."""
    from dturbo.algorithms.registry import model_factory

    ds = federation().dataset
    return model_factory(_FEDERATION["cfg"], ds.input_shape, ds.num_classes)()


def client_train(msg: Any, context: Any) -> Any:
    import dturbo.flower

    data = federation().clients[int(context.node_config["partition-id"])]
    return dturbo.flower.fit(msg, context, model(), data)


def client_count(msg: Any, context: Any) -> Any:
    import dturbo.flower

    data = federation().clients[int(context.node_config["partition-id"])]
    return dturbo.flower.count_samples(msg, context, data)


def run_flower(rounds: int) -> tuple[dict[str, Any], float]:
    """The strategy and the client helpers on Flower's simulation engine: the Result, the strategy and seconds."""
    from flwr.app import ArrayRecord, Context, MetricRecord
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    import dturbo.flower
    from dturbo.sim import evaluate

    client_app = ClientApp()
    client_app.train()(client_train)
    client_app.query("dturbo")(client_count)

    out: dict[str, Any] = {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        fed = federation()
        initial = model()

        def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            net = model()
            net.load_state_dict(arrays.to_torch_state_dict())
            acc, loss = evaluate(net, fed.x_test, fed.y_test)
            return MetricRecord({"accuracy": acc, "loss": loss})

        strategy = dturbo.flower.DTurboVBI(model, preset=PRESET, overrides=OVERRIDES, fraction_evaluate=0.0)
        out["result"] = strategy.start(grid=grid, initial_arrays=ArrayRecord(initial.state_dict()),
                                       num_rounds=rounds, evaluate_fn=central)
        out["strategy"] = strategy

    t0 = time.perf_counter()
    run_simulation(server_app, client_app, num_supernodes=len(federation().clients),
                   backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 1}})
    seconds = time.perf_counter() - t0
    if "result" not in out:
        raise RuntimeError("the ServerApp did not finish (see the log above)")
    return out, seconds


def model_difference(run_dir: Path, arrays: Any) -> float:
    """The largest absolute difference between ``dturbo run``'s model.safetensors and the Flower run's final arrays."""
    from safetensors.torch import load_file

    mine = arrays.to_torch_state_dict()
    theirs = load_file(str(run_dir / "model.safetensors"))
    if set(mine) != set(theirs):
        return float("inf")
    return max(float((mine[k].float() - theirs[k].float()).abs().max()) if mine[k].numel() else 0.0 for k in mine)


def compare(cli_rows: list[dict[str, str]], result: Any, strategy: Any) -> dict[str, Any]:
    rows = []
    for r in cli_rows:
        rnd = int(r["round"])
        m = result.train_metrics_clientapp[rnd]
        ev = result.evaluate_metrics_serverapp[rnd]
        rows.append({
            "round": rnd,
            "cli_accuracy": float(r["accuracy"]), "flower_accuracy": float(ev["accuracy"]),
            "cli_density": float(r["density"]), "flower_density": float(m["density"]),
            "cli_up_bits": int(float(r["up_bits"])), "flower_up_bits": int(m["up_bits"]),
            "cli_down_bits": int(float(r["down_bits"])), "flower_down_bits": int(m["down_bits"]),
            "flower_message_up_bytes": int(m["flower_up_bytes"]),
            "flower_message_down_bytes": int(m["flower_down_bytes"]),
            "participants": int(m["participants"]),
        })
    session = strategy.session
    task_bytes = [len(session.settings), sum(len(la.text()) for la in session.layers)]
    return {"rows": rows, "task_settings_bytes": task_bytes[0], "task_model_bytes": task_bytes[1]}


def write(result: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "flower_strategy.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = result["rows"]
    last = rows[-1]
    lines = [
        "# D-Turbo-VBI as a Flower strategy vs `dturbo run` (benchmarks/flower_strategy.py)",
        "",
        f"`{result['command']}`, {result['date']}, {result['machine']['platform']}, one thread each.",
        "",
        f"Preset `{PRESET}` (Fashion-MNIST, alexnet-small, {result['clients']} clients, Dirichlet(0.5), seed "
        f"{result['seed']}, {result['rounds']} rounds). Left: `dturbo run --preset {PRESET} --set "
        "experiment.threads=1`. Right: `dturbo.flower.DTurboVBI` in a ServerApp and `dturbo.flower.fit` in a ClientApp "
        "on Flower's simulation engine (`run_simulation`, 10 virtual SuperNodes, one Ray worker), with the same model "
        "and data split.",
        "",
        f"* final accuracy: `dturbo run` {last['cli_accuracy']:.4f}, Flower {last['flower_accuracy']:.4f} "
        f"(largest difference over the rounds: {result['max_accuracy_difference']:.4f});",
        f"* final density: {last['cli_density']:.4f} and {last['flower_density']:.4f}; every round's accuracy, density "
        f"and bits equal: {result['identical_rows']}; final models' largest weight difference: "
        f"{result['final_model_max_abs_difference']:g};",
        f"* bits over the run: {result['cli_cum_bits']:,} and {result['flower_cum_bits']:,} (dturbo's ledger, 8 x the "
        "coded bytes);",
        f"* Flower's Message sizes (`message_size_mod`'s count) over the run: {result['flower_message_bytes']:,} "
        f"bytes, dturbo's coded bytes {result['flower_cum_bits'] // 8:,}: "
        f"{result['framing_bytes_per_train_message']:g} more per train message (the .npy header, 128; the task "
        f"record, with {result['task_settings_bytes']} bytes of settings and {result['task_model_bytes']} of layer "
        "grids and scales; `server-round`) and "
        f"{result['framing_bytes_per_reply']:g} per reply (the .npy header, `num-examples`, the task);",
        f"* wall time: `dturbo run` {result['cli_seconds']:.0f} s, Flower {result['flower_seconds']:.0f} s.",
        "",
        "| round | accuracy run / Flower | density run / Flower | up Mbit run / Flower | down Mbit run / Flower "
        "| Flower Message bytes up / down |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['round']} | {r['cli_accuracy']:.4f} / {r['flower_accuracy']:.4f} | "
                     f"{r['cli_density']:.4f} / {r['flower_density']:.4f} | "
                     f"{r['cli_up_bits'] / 1e6:.3f} / {r['flower_up_bits'] / 1e6:.3f} | "
                     f"{r['cli_down_bits'] / 1e6:.3f} / {r['flower_down_bits'] / 1e6:.3f} | "
                     f"{r['flower_message_up_bytes']:,} / {r['flower_message_down_bytes']:,} |")
    (RESULTS / "flower_strategy.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "flower_strategy")
    ap.add_argument("--rounds", type=int, default=12, help="the preset's 12; fewer to cut the run short")
    args = ap.parse_args()
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    import torch

    torch.set_num_threads(1)
    cli_rows, cli_seconds = run_cli(args.out / "dturbo_run", args.rounds)
    print(f"dturbo run: {cli_seconds:.0f} s, final accuracy {float(cli_rows[-1]['accuracy']):.4f}", flush=True)
    flower, flower_seconds = run_flower(args.rounds)
    result, strategy = flower["result"], flower["strategy"]
    cmp = compare(cli_rows, result, strategy)
    rows = cmp["rows"]
    m = result.train_metrics_clientapp
    train_msgs = sum(r["participants"] for r in rows)
    down_framing = sum(r["flower_message_down_bytes"] - r["flower_down_bits"] // 8 for r in rows)
    up_framing = sum(r["flower_message_up_bytes"] - r["flower_up_bits"] // 8 for r in rows)
    keys = ("accuracy", "density", "up_bits", "down_bits")
    out = {
        "what": "D-Turbo-VBI as a Flower strategy (run_simulation) vs dturbo run, preset quick, one thread each",
        "command": "OMP_NUM_THREADS=1 python benchmarks/flower_strategy.py" + (
            f" --rounds {args.rounds}" if args.rounds != 12 else ""),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "cpus": os.cpu_count()},
        "preset": PRESET, "rounds": args.rounds, "clients": len(strategy.session.node_of),
        "seed": strategy.session.cfg.experiment.seed, "total_samples": strategy.session.total_samples,
        "cli_final_accuracy": rows[-1]["cli_accuracy"], "flower_final_accuracy": rows[-1]["flower_accuracy"],
        "max_accuracy_difference": max(abs(r["cli_accuracy"] - r["flower_accuracy"]) for r in rows),
        "identical_rows": all(r[f"cli_{k}"] == r[f"flower_{k}"] for r in rows for k in keys),
        "final_model_max_abs_difference": model_difference(args.out / "dturbo_run", result.arrays),
        "cli_cum_bits": int(float(cli_rows[-1]["cum_bits"])), "flower_cum_bits": int(m[len(rows)]["cum_bits"]),
        "flower_message_bytes": sum(r["flower_message_up_bytes"] + r["flower_message_down_bytes"] for r in rows),
        "framing_bytes_per_train_message": down_framing / train_msgs,
        "framing_bytes_per_reply": up_framing / train_msgs,
        "task_settings_bytes": cmp["task_settings_bytes"], "task_model_bytes": cmp["task_model_bytes"],
        "cli_seconds": round(cli_seconds, 1), "flower_seconds": round(flower_seconds, 1),
        "rows": rows,
    }
    write(out)
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}, indent=2))


if __name__ == "__main__":
    main()
