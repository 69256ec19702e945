"""In-process federated runner: rounds, client sampling, bit ledger, evaluation, checkpoints, metrics.

It drives any algorithm written against the protocol of :mod:`dturbo.algorithms.base`; nothing about an
algorithm lives here. Bits are 8 x the bytes of the messages really exchanged: the downlink counts once per
receiving client, every uplink once.
"""

from __future__ import annotations

import csv
import io
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.numpy import save as save_numpy
from safetensors.torch import save as save_torch
from torch import nn

from .algorithms.base import ClientData, ClientError
from .algorithms.dturbo import DturboClient, DturboServer
from .checkpoint import CheckpointError, atomic_write_bytes, config_fingerprint, load_checkpoint, save_checkpoint
from .config import Config
from .data import Dataset, load_dataset, partition_dirichlet, partition_iid
from .nn.models import build_model

BASE_COLUMNS = ["round", "accuracy", "loss", "density", "up_bits", "down_bits", "cum_bits", "seconds"]


@dataclass
class Federation:
    dataset: Dataset
    clients: list[ClientData]
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def total_samples(self) -> int:
        return sum(len(c) for c in self.clients)


def build_federation(cfg: Config, dataset: Dataset | None = None) -> Federation:
    """Load the data and split the training set among the clients (seeded)."""
    ds = dataset or load_dataset(
        cfg.data.name, cfg.data.path, limit_train=cfg.data.limit_train, limit_test=cfg.data.limit_test,
        seed=cfg.experiment.seed,
    )
    f = cfg.federation
    if f.clients > len(ds.y_train):
        raise ValueError(f"federation.clients ({f.clients}) exceeds the number of training samples ({len(ds.y_train)})")
    if f.partition == "dirichlet":
        parts = partition_dirichlet(ds.y_train, f.clients, f.alpha, seed=cfg.experiment.seed,
                                    min_size=min(f.min_partition_size, len(ds.y_train) // f.clients))
    else:
        parts = partition_iid(len(ds.y_train), f.clients, seed=cfg.experiment.seed)
    x = torch.from_numpy(ds.x_train)
    y = torch.from_numpy(ds.y_train)
    clients = [ClientData(x[idx], y[idx]) for idx in (torch.from_numpy(p) for p in parts)]
    return Federation(ds, clients, torch.from_numpy(ds.x_test), torch.from_numpy(ds.y_test))


def model_factory(cfg: Config, dataset: Dataset) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        return build_model(
            cfg.model.name, dataset.input_shape, dataset.num_classes, sigma_mode=cfg.dturbo.sigma_mode,
            sigma_init_ratio=cfg.dturbo.sigma_init_ratio, hidden=cfg.model.hidden, seed=cfg.experiment.seed,
        )

    return make


def build_algorithm(cfg: Config, fed: Federation) -> tuple[DturboServer, DturboClient]:
    factory = model_factory(cfg, fed.dataset)
    if cfg.experiment.algorithm == "dturbo":
        return DturboServer(cfg, factory, fed.total_samples), DturboClient(cfg, factory)
    raise ValueError(f"unknown algorithm {cfg.experiment.algorithm!r}")


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 2000) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of a model in eval mode (mean weights)."""
    model.eval()
    correct = 0
    loss = 0.0
    for i in range(0, len(y), batch_size):
        logits = model(x[i : i + batch_size])
        loss += float(F.cross_entropy(logits, y[i : i + batch_size], reduction="sum"))
        correct += int((logits.argmax(1) == y[i : i + batch_size]).sum())
    return correct / len(y), loss / len(y)


def sample_clients(cfg: Config, round_idx: int) -> list[int]:
    n, k = cfg.federation.clients, cfg.federation.clients_per_round
    if k is None or k >= n:
        return list(range(n))
    rng = np.random.default_rng([cfg.experiment.seed, round_idx, 0x5A])
    return sorted(rng.choice(n, size=k, replace=False).tolist())


class Simulator:
    """Runs an experiment into a run directory (DESIGN.md "A run directory")."""

    def __init__(self, cfg: Config, out: Path, *, resume: bool = False, federation: Federation | None = None,
                 on_round: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.cfg = cfg
        self.out = Path(out)
        self.resume = resume
        self.on_round = on_round
        if cfg.experiment.threads:  # before anything is built: reductions depend on the thread count
            torch.set_num_threads(cfg.experiment.threads)
        self.fed = federation or build_federation(cfg)
        self.server, self.client = build_algorithm(cfg, self.fed)
        self.fingerprint = config_fingerprint(cfg.to_dict())

    # ----------------------------------------------------------- run files
    @property
    def metrics_path(self) -> Path:
        return self.out / "metrics.csv"

    @property
    def checkpoint_dir(self) -> Path:
        return self.out / "checkpoint"

    def _prepare(self) -> tuple[dict[str, Any], int, float, list[dict[str, Any]]]:
        """Returns (state, first round, cumulative bits, previous rows)."""
        if self.resume:
            state, counters = load_checkpoint(self.checkpoint_dir)
            if counters.get("fingerprint") != self.fingerprint:
                raise CheckpointError(
                    f"checkpoint in {self.checkpoint_dir} belongs to another configuration "
                    f"(fingerprint {counters.get('fingerprint')} != {self.fingerprint}); it was left untouched"
                )
            expected = set(self.server.init().keys())
            if set(state) != expected:
                raise CheckpointError(f"checkpoint in {self.checkpoint_dir} does not match the model; left untouched")
            done = int(counters["rounds_done"])
            rows = [r for r in self._read_rows() if int(r["round"]) <= done]
            if len(rows) != done:
                raise CheckpointError(f"metrics.csv has {len(rows)} rows for {done} checkpointed rounds")
            self._write_rows(rows)
            events = self.out / "events.log"
            if events.exists():  # drop the events of rounds that will be run again
                kept = [ln for ln in events.read_text().splitlines(keepends=True)
                        if ln.startswith("round ") and int(ln.split()[1].rstrip(":")) <= done]
                atomic_write_bytes(events, "".join(kept).encode())
            return state, done, float(counters["cum_bits"]), rows
        if self.checkpoint_dir.exists() or self.metrics_path.exists():
            raise FileExistsError(f"{self.out} already holds a run; use --resume to continue it or another --out")
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.out / "config.toml", self.cfg.to_toml().encode())
        return self.server.init(), 0, 0.0, []

    def _read_rows(self) -> list[dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        with open(self.metrics_path, newline="") as f:
            return list(csv.DictReader(f))

    def _write_rows(self, rows: list[dict[str, Any]]) -> None:
        buf = io.StringIO()
        if rows:
            writer = csv.DictWriter(buf, fieldnames=list(rows[0].keys()), lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
        atomic_write_bytes(self.metrics_path, buf.getvalue().encode())

    # ---------------------------------------------------------------- rounds
    def run(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        state, start, cum_bits, rows = self._prepare()
        acc = loss = float("nan")
        if rows:
            acc, loss = float(rows[-1]["accuracy"]), float(rows[-1]["loss"])
        for rnd in range(start, cfg.experiment.rounds):
            t0 = time.perf_counter()
            participants = sample_clients(cfg, rnd)
            down = self.server.downlink(state, rnd)
            uplinks: list[bytes] = []
            failed: list[str] = []
            for cid in participants:
                try:
                    uplinks.append(self.client.fit(down, self.fed.clients[cid], cid))
                except ClientError as err:
                    failed.append(f"client {cid}: {err}")
            up_bits = 8 * sum(len(u) for u in uplinks)
            down_bits = 8 * len(down) * len(participants)
            result = self.server.aggregate(state, uplinks, rnd)
            state = result.state
            cum_bits += up_bits + down_bits
            last = rnd == cfg.experiment.rounds - 1
            if (rnd + 1) % cfg.experiment.eval_every == 0 or last:
                acc, loss = evaluate(self.server.global_model(state), self.fed.x_test, self.fed.y_test)
            row: dict[str, Any] = {
                "round": rnd + 1, "accuracy": acc, "loss": loss, "density": result.metrics.pop("density"),
                "up_bits": up_bits, "down_bits": down_bits, "cum_bits": cum_bits,
                "seconds": round(time.perf_counter() - t0, 3),
                "clients_failed": len(failed),
                **{k: _fmt(v) for k, v in result.metrics.items()},
            }
            rows.append(row)
            self._log_events(rnd + 1, failed + result.rejected)
            self._save_messages(state, rnd + 1)
            self._write_rows(rows)
            save_checkpoint(self.checkpoint_dir, state, {
                "rounds_done": rnd + 1, "cum_bits": cum_bits, "fingerprint": self.fingerprint,
            })
            if self.on_round:
                self.on_round(row)
        self._save_model(state)
        return rows

    def _log_events(self, round_no: int, events: list[str]) -> None:
        """Why clients failed or were rejected (metrics.csv has the counts): one line each in events.log."""
        if events:
            with open(self.out / "events.log", "a") as f:
                f.writelines(f"round {round_no}: {e}\n" for e in events)

    def _save_messages(self, state: dict[str, Any], round_no: int) -> None:
        """pi (B->A message) and masks of every layer this round, for the heat maps (Fig. 3)."""
        folder = self.out / "messages"
        folder.mkdir(exist_ok=True)
        path = folder / f"round_{round_no:04d}.safetensors"
        atomic_write_bytes(path, save_numpy(self.server.support_messages(state)))

    def _save_model(self, state: dict[str, Any]) -> None:
        model = self.server.global_model(state)
        # clone: tied parameters (sigma_mode = "client") must be separate tensors in a safetensors file
        tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        meta = {"model": self.cfg.model.name, "dataset": self.cfg.data.name}
        atomic_write_bytes(self.out / "model.safetensors", save_torch(tensors, metadata=meta))


def _fmt(v: float) -> float | str:
    return "" if isinstance(v, float) and math.isnan(v) else v
