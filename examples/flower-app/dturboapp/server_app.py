"""dturboapp: a Flower ServerApp with D-Turbo-VBI as its strategy.

It runs the strategy on the app's model, evaluates the global model on the test set after every round, then writes
the final model (``final_model.pt``, the Bayesian model's state_dict) and the bit ledger of every round
(``bits.csv``: dturbo's coded bytes and Flower's Message sizes side by side) into ``out-dir``.
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

import dturbo
from dturbo.flower import DTurboVBI
from dturboapp.task import Net, load_test, test

log = logging.getLogger("flwr")

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    rounds = int(rc["num-server-rounds"])
    model = dturbo.bayesianize(Net())
    x_test, y_test = load_test(str(rc["data-path"]))

    def central_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net = dturbo.bayesianize(Net())
        net.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = test(net, x_test, y_test)
        return MetricRecord({"accuracy": acc, "loss": loss})

    strategy = DTurboVBI(
        model,
        preset="quick",
        fraction_train=float(rc["fraction-train"]),
        fraction_evaluate=float(rc["fraction-evaluate"]),
        sparsity={"target_density": float(rc["target-density"]), "ramp_rounds": max(1, rounds - 2)},
        overrides={"train.local_epochs": float(rc["local-epochs"]), "train.lr": float(rc["learning-rate"]),
                   "train.batch_size": int(rc["batch-size"])},
    )
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=rounds,
                            evaluate_fn=central_evaluate)

    out = Path(str(rc["out-dir"])).resolve()
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result.arrays.to_torch_state_dict(), out / "final_model.pt")
    with open(out / "bits.csv", "w", newline="") as f:
        fields = ["round", "accuracy", "density", "down_bits", "up_bits", "flower_down_bytes", "flower_up_bytes",
                  "down_framing_bytes", "up_framing_bytes"]
        writer = csv.DictWriter(f, fields)
        writer.writeheader()
        for rnd, m in sorted(result.train_metrics_clientapp.items()):
            row = {"round": rnd, "accuracy": result.evaluate_metrics_serverapp[rnd]["accuracy"],
                   "density": m["density"], "down_bits": m["down_bits"], "up_bits": m["up_bits"],
                   "flower_down_bytes": m["flower_down_bytes"], "flower_up_bytes": m["flower_up_bytes"],
                   "down_framing_bytes": int(m["flower_down_bytes"]) - int(m["down_bits"]) // 8,
                   "up_framing_bytes": int(m["flower_up_bytes"]) - int(m["up_bits"]) // 8}
            writer.writerow(row)
            log.info("round %d: accuracy %.4f, density %.3f, dturbo %d + %d bytes down/up, Flower %d + %d",
                     rnd, row["accuracy"], row["density"], int(row["down_bits"]) // 8, int(row["up_bits"]) // 8,
                     row["flower_down_bytes"], row["flower_up_bytes"])
    log.info("dturboapp: final model and bits.csv in %s", out)
