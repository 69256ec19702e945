"""Reference runs of every method through every runner, fingerprinted: a refactor that must change no byte shows it
by writing the same fingerprints before and after.

Each run is small (a 12-feature toy task, 3 clients, 3 rounds, one thread) and covers one path: every registered
method in the simulator; D-Turbo-VBI's update downlink with delta positions and partial participation; a model with
BatchNorm (calibration); a robust rule under sign-flipping attackers; the Flower Strategy over an in-process grid
for each method it runs. A run's fingerprint is the SHA-256 of its metrics rows (wall-time columns left out), of
its final model's tensors, of its resolved config and of its last checkpoint's arrays.

    python benchmarks/reference_runs.py --out benchmarks/results/reference_runs.json      # write them
    python benchmarks/reference_runs.py --check benchmarks/results/reference_runs.json    # run again, compare

Fingerprints depend on the torch build and the machine's float arithmetic: compare two commits on one machine.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import logging
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

TIMING = {"seconds", "server_seconds"}
CLIENTS = 3
METHODS = ("dturbo", "fedavg", "fedpaq", "dssm", "stc", "fedpm", "feddst")


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 24), nn.ReLU())
        self.head = nn.Linear(24, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class BnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 24), nn.BatchNorm1d(24), nn.ReLU())
        self.head = nn.Linear(24, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def toy_arrays(n: int = 600) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 12)).astype(np.float32)
    y = (x[:, :3].sum(1) > 0).astype(np.int64) + 2 * (x[:, 3] > 0)
    return x, y


def base_config(algorithm: str, **extra: dict[str, Any]) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "experiment": {"seed": 2, "rounds": 3, "threads": 1, "algorithm": algorithm},
        "data": {"name": "arrays"},
        "federation": {"clients": CLIENTS, "partition": "iid"},
        "model": {"name": "mlp", "hidden": [24]},
        "train": {"local_steps": 4, "batch_size": 32, "lr": 0.01},
        "dturbo": {"sparsity": {"target_density": 0.5, "warmup_rounds": 0, "ramp_rounds": 2}},
        "stc": {"p_up": 0.1, "p_down": 0.1},
        "feddst": {"density": 0.5, "readjust_every": 1, "readjust_ratio": 0.2},
    }
    for section, keys in extra.items():
        merged = dict(cfg.get(section, {}))
        for k, v in keys.items():
            merged[k] = {**merged.get(k, {}), **v} if isinstance(v, dict) and isinstance(merged.get(k), dict) else v
        cfg[section] = merged
    return cfg


def digest(obj: Any) -> str:
    h = hashlib.sha256()
    if isinstance(obj, dict):
        for k in sorted(obj, key=str):
            h.update(str(k).encode())
            h.update(digest(obj[k]).encode())
    elif isinstance(obj, list | tuple):
        for v in obj:
            h.update(digest(v).encode())
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        h.update(str(a.dtype).encode() + str(a.shape).encode() + a.tobytes())
    else:
        h.update(repr(obj).encode())
    return h.hexdigest()[:16]


def run_dir_fingerprint(out: Path) -> dict[str, str]:
    from safetensors.numpy import load_file

    with open(out / "metrics.csv", newline="") as f:
        rows = [{k: v for k, v in r.items() if k not in TIMING} for r in csv.DictReader(f)]
    model = load_file(str(out / "model.safetensors"))
    ckpt = {}
    for p in sorted((out / "checkpoint").glob("*.safetensors")):
        ckpt[p.name] = digest(load_file(str(p)))
    config = (out / "config.toml").read_text() if (out / "config.toml").exists() else ""
    return {"metrics": digest(rows), "model": digest(model), "config": digest(config), "checkpoint": digest(ckpt),
            "final_accuracy": rows[-1]["accuracy"], "cum_bits": rows[-1]["cum_bits"]}


def simulator_run(name: str, cfg_dict: dict[str, Any], tmp: Path, net: type[nn.Module] | None = None
                  ) -> dict[str, str]:
    from dturbo import load_config
    from dturbo.data import dataset_from_arrays
    from dturbo.federation import build_federation
    from dturbo.sim import Simulator

    x, y = toy_arrays()
    cfg = load_config(cfg_dict)
    fed = build_federation(cfg, dataset_from_arrays(x, y, x[:200], y[:200]))
    model = None
    if net is not None:
        from dturbo.nn.convert import user_model_factory

        d = cfg.dturbo
        factory = user_model_factory(net, sigma_mode=d.sigma_mode, sigma_init_ratio=d.sigma_init_ratio,
                                     seed=cfg.experiment.seed, input_shape=(12,))
        model = lambda _ds: factory  # noqa: E731
    Simulator(cfg, tmp / name, federation=fed, model=model).run()
    return run_dir_fingerprint(tmp / name)


def strategy_run(algorithm: str, net: type[nn.Module]) -> dict[str, str]:
    from flwr.app import ArrayRecord, Context, Message

    import dturbo
    import dturbo.flower as dflower
    from dturbo import load_config
    from dturbo.data import dataset_from_arrays
    from dturbo.federation import build_federation
    from dturbo.flower import client as client_module
    from dturbo.flower.inprocess import InProcessGrid

    cfg_dict = base_config(algorithm, model={"name": "custom"})
    x, y = toy_arrays()
    fed = build_federation(load_config(cfg_dict), dataset_from_arrays(x, y, x[:200], y[:200]))

    def app(msg: Message, context: Context) -> Message:
        client_module._CACHE.clear()  # a fresh ClientApp process per message: client state travels in Context
        data = fed.clients[context.node_config["partition-id"]]
        if msg.metadata.message_type == "train":
            return dflower.fit(msg, context, dturbo.bayesianize(net()), data)
        if msg.metadata.message_type.startswith("query"):
            return dflower.count_samples(msg, context, data)
        return dflower.evaluate(msg, context, dturbo.bayesianize(net()), data)

    logging.getLogger("flwr").setLevel(logging.ERROR)
    grid = InProcessGrid(app, CLIENTS)
    strategy = dflower.DturboStrategy(net, algorithm=algorithm, config=cfg_dict, fraction_evaluate=0.0)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=3)
    metrics = {rnd: {k: v for k, v in dict(m).items() if k not in TIMING}
               for rnd, m in result.train_metrics_clientapp.items()}
    final = strategy.global_model().state_dict()
    return {"metrics": digest(metrics), "model": digest(dict(final)), "cum_bits": str(metrics[3]["cum_bits"])}


def all_runs(tmp: Path, only: str | None) -> dict[str, dict[str, str]]:
    runs: dict[str, Any] = {}
    for m in METHODS:
        runs[f"sim_{m}"] = lambda m=m: simulator_run(f"sim_{m}", base_config(m), tmp)
    runs["sim_dturbo_update_delta_partial"] = lambda: simulator_run("upd", base_config(
        "dturbo", dturbo={"transmission": {"down_mu": "update", "positions": "delta"}},
        federation={"clients_per_round": 2}), tmp)
    runs["sim_dturbo_bn"] = lambda: simulator_run("bn", base_config("dturbo", model={"name": "custom"}), tmp, BnNet)
    runs["sim_fedavg_bn"] = lambda: simulator_run("bnf", base_config("fedavg", model={"name": "custom"}), tmp, BnNet)
    runs["sim_dturbo_trimmed_signflip"] = lambda: simulator_run("rob", base_config(
        "dturbo", robust={"rule": "trimmed_mean", "trim": 0.34}, faults={"attackers": 1, "attack": "sign_flip"}),
        tmp)
    runs["sim_fedpm_median_faults"] = lambda: simulator_run("fpm", base_config(
        "fedpm", robust={"rule": "median"}, faults={"drop_prob": 0.2, "corrupt_prob": 0.2}), tmp)
    for m, net in (("dturbo", TinyNet), ("stc", TinyNet), ("feddst", TinyNet), ("fedavg", TinyNet),
                   ("dturbo", BnNet)):
        runs[f"strategy_{m}_{net.__name__}"] = lambda m=m, net=net: strategy_run(m, net)
    out = {}
    for name, fn in runs.items():
        if only and only not in name:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out[name] = fn()
        print(f"{name}: {out[name]}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--check", type=Path)
    p.add_argument("--only", default=None, help="run only the runs whose name holds this text")
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        runs = all_runs(Path(d), args.only)
    if args.out:
        args.out.write_text(json.dumps(runs, indent=1, sort_keys=True) + "\n")
    if args.check:
        ref = json.loads(args.check.read_text())
        bad = [n for n in runs if ref.get(n) != runs[n]]
        for n in bad:
            print(f"DIFFERS: {n}: {ref.get(n)} != {runs[n]}")
        print(f"{len(runs) - len(bad)} of {len(runs)} runs identical")
        sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
