"""In-process federated runner: rounds, client sampling, bit ledger, evaluation, checkpoints, metrics.

It drives any algorithm written against the protocol of :mod:`dturbo.algorithms.base`; nothing about an
algorithm lives here. Bits are 8 x the bytes of the messages really exchanged: the downlink counts once per
receiving client, every uplink once.
"""

from __future__ import annotations

import csv
import io
import json
import math
import time
import warnings
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

from .algorithms.base import (
    LEDGER_PARTS,
    ClientAlgorithm,
    ClientData,
    ClientError,
    MessageError,
    ServerAlgorithm,
    message_bits,
)
from .algorithms.registry import ALGORITHMS
from .checkpoint import (
    STATE_FILE,
    CheckpointError,
    atomic_write_bytes,
    config_fingerprint,
    load_checkpoint,
    save_checkpoint,
)
from .codec import decode_message, encode_message
from .config import Config, ConfigError
from .data import Dataset, load_dataset, partition_dirichlet, partition_iid
from .device import CPU, resolve_device
from .nn.models import build_model, check_input_shape
from .sparsity import density_schedule

BASE_COLUMNS = ["round", "accuracy", "loss", "density", "up_bits", "down_bits", "cum_bits", "seconds"]
# The bit ledger (docs/algorithm.md §9): up and down apart, each split into headers, positions and values.
LEDGER_COLUMNS = [f"{d}_{part}_bits" for d in ("up", "down") for part in LEDGER_PARTS]
# Private state a client algorithm keeps between rounds (STC's residuals and model copy): its optional
# ``export_state()`` arrays go into the same atomic checkpoint file as the server state, under this prefix, and
# back through ``import_state(arrays)`` on --resume, so that a resumed run is identical to an uninterrupted one.
CLIENT_STATE_PREFIX = "clients/"


@dataclass
class Federation:
    dataset: Dataset
    clients: list[ClientData]
    x_test: torch.Tensor
    y_test: torch.Tensor
    x_val: torch.Tensor | None = None  # held out of the training set (data.validation), never trained on
    y_val: torch.Tensor | None = None

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
    x_train, y_train, val = ds.x_train, ds.y_train, None
    if cfg.data.validation > 0:
        # Carved before the clients' split, seeded apart from it: hyperparameters are chosen on it, never on test.
        order = np.random.default_rng([cfg.experiment.seed, 0x7A1]).permutation(len(y_train))
        n_val = max(1, round(cfg.data.validation * len(y_train)))
        held, kept = np.sort(order[:n_val]), np.sort(order[n_val:])
        val = (torch.from_numpy(x_train[held]), torch.from_numpy(y_train[held]))
        x_train, y_train = x_train[kept], y_train[kept]
    if f.clients > len(y_train):
        raise ValueError(f"federation.clients ({f.clients}) exceeds the number of training samples ({len(y_train)})")
    if f.partition == "dirichlet":
        parts = partition_dirichlet(y_train, f.clients, f.alpha, seed=cfg.experiment.seed,
                                    min_size=min(f.min_partition_size, len(y_train) // f.clients))
    else:
        parts = partition_iid(len(y_train), f.clients, seed=cfg.experiment.seed)
    x = torch.from_numpy(x_train)
    y = torch.from_numpy(y_train)
    clients = [ClientData(x[idx], y[idx]) for idx in (torch.from_numpy(p) for p in parts)]
    return Federation(ds, clients, torch.from_numpy(ds.x_test), torch.from_numpy(ds.y_test), *(val or (None, None)))


ModelFactory = Callable[[], nn.Module]


def model_factory(cfg: Config, dataset: Dataset) -> ModelFactory:
    """The seeded factory of the built-in model ``[model]`` names (a model of one's own: ``dturbo.Experiment``'s
    ``model=``, :func:`dturbo.nn.convert.user_model_factory`)."""
    if cfg.model.name == "custom":
        raise ConfigError("config key 'model.name': 'custom' stands for a model given to dturbo.Experiment(model=...) "
                          "in Python; it cannot be built from the config (dturbo run, Flower): name a built-in model")

    def make() -> nn.Module:
        return build_model(
            cfg.model.name, dataset.input_shape, dataset.num_classes, sigma_mode=cfg.dturbo.sigma_mode,
            sigma_init_ratio=cfg.dturbo.sigma_init_ratio, hidden=cfg.model.hidden, width=cfg.model.width,
            seed=cfg.experiment.seed,
        )

    return make


def build_algorithm(cfg: Config, fed: Federation, factory: ModelFactory | None = None
                    ) -> tuple[ServerAlgorithm, ClientAlgorithm]:
    """The configured algorithm's server and client halves on the model of ``factory`` (a zero-argument function
    that returns the seeded initial model, the same every call), by default the built-in model of ``[model]``."""
    if factory is None:
        factory = model_factory(cfg, fed.dataset)
    if cfg.experiment.algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {cfg.experiment.algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    # Input size and classes vs model, before anything runs: a clear ModelInputError / ModelOutputError instead of
    # a traceback mid-round. fork_rng: building reseeds torch's global RNG, which the run's own draws must not notice.
    with torch.random.fork_rng(devices=[]):
        model = factory()
        name = cfg.model.name if cfg.model.name != "custom" else type(model).__name__
        check_input_shape(model, fed.dataset.input_shape, name, fed.dataset.num_classes)
    server_cls, client_cls = ALGORITHMS[cfg.experiment.algorithm]
    return server_cls(cfg, factory, fed.total_samples), client_cls(cfg, factory)


class ScheduleWarning(UserWarning):
    """The sparsity schedule does not reach its target within the run (a warning: short test runs do it
    on purpose)."""


def schedule_warning(cfg: Config) -> str | None:
    """For D-Turbo-VBI in target mode whose ramp ends after the last round: the density the schedule reaches
    at the last round and how to reach the target; None when the target is reached."""
    sp = cfg.dturbo.sparsity
    rounds = cfg.experiment.rounds
    if cfg.experiment.algorithm != "dturbo" or sp.mode != "target" or sp.warmup_rounds + sp.ramp_rounds <= rounds:
        return None
    reached = density_schedule(rounds - 1, target=sp.target_density, warmup=sp.warmup_rounds, ramp=sp.ramp_rounds)
    fix = f"set experiment.rounds >= {sp.warmup_rounds + sp.ramp_rounds}"
    if rounds > sp.warmup_rounds:
        fix += f" or dturbo.sparsity.ramp_rounds <= {rounds - sp.warmup_rounds}"
    else:
        fix += f" or dturbo.sparsity.warmup_rounds < {rounds} with a shorter ramp_rounds"
    layers = " (the layer_targets likewise)" if sp.layer_targets else ""
    return (f"the sparsity schedule does not reach target_density {sp.target_density:g} within the run: "
            f"warmup_rounds {sp.warmup_rounds} + ramp_rounds {sp.ramp_rounds} > experiment.rounds {rounds}, so the "
            f"scheduled density at the last round is {reached:.3f}{layers}; to reach the target, {fix}")


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 2000,
             device: torch.device = CPU) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of a model in eval mode (mean weights), computed on ``device`` (the model is
    moved there; on the CPU nothing moves)."""
    model.eval().to(device)
    correct = 0
    loss = 0.0
    for i in range(0, len(y), batch_size):
        xb, yb = x[i : i + batch_size].to(device), y[i : i + batch_size].to(device)
        logits = model(xb)
        loss += float(F.cross_entropy(logits, yb, reduction="sum"))
        correct += int((logits.argmax(1) == yb).sum())
    return correct / len(y), loss / len(y)


def format_bits(b: float) -> str:
    """A bit count in Gbit / Mbit / kbit / bit, two decimals."""
    for unit, scale in (("Gbit", 1e9), ("Mbit", 1e6), ("kbit", 1e3)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} bit"


def round_summary(row: dict[str, Any]) -> str:
    """A metrics row in one line, as progress shows it: accuracy, density and the bits so far."""
    return (f"acc {float(row['accuracy']):.4f}  density {float(row['density']):.3f}  "
            f"bits {format_bits(float(row['cum_bits']))}")


class Simulator:
    """Runs an experiment into a run directory (README.md: "A run directory holds ...")."""

    def __init__(self, cfg: Config, out: Path, *, resume: bool = False, federation: Federation | None = None,
                 dataset: Dataset | None = None, on_round: Callable[[dict[str, Any]], None] | None = None,
                 model: Callable[[Dataset], ModelFactory] | None = None) -> None:
        """``federation``: clients already split (tests); else ``dataset`` (data already loaded, e.g. a library
        user's arrays: :func:`dturbo.data.dataset_from_arrays`) is split among the clients; else the config's
        data is read. ``model``: given the dataset, the factory of a model of one's own (``dturbo.Experiment``'s
        ``model=``) that replaces the built-in model of ``[model]``."""
        self.cfg = cfg
        self.out = Path(out)
        self.resume = resume
        self.on_round = on_round
        if cfg.experiment.threads:  # before anything is built: reductions depend on the thread count
            torch.set_num_threads(cfg.experiment.threads)
        self.device = resolve_device(cfg.experiment.device)  # "cuda" without a GPU fails here, before any work
        if (msg := schedule_warning(cfg)) is not None:
            warnings.warn(msg, ScheduleWarning, stacklevel=2)
        self.fed = federation or build_federation(cfg, dataset)
        factory = model(self.fed.dataset) if model is not None else None
        self.server, self.client = build_algorithm(cfg, self.fed, factory)
        self.fingerprint = config_fingerprint(cfg.to_dict())
        self.final_model: nn.Module | None = None  # the global model saved at the end of run(), in eval mode

    # ----------------------------------------------------------- run files
    @property
    def metrics_path(self) -> Path:
        return self.out / "metrics.csv"

    @property
    def checkpoint_dir(self) -> Path:
        return self.out / "checkpoint"

    def _prepare(self) -> tuple[dict[str, Any], int, float, list[dict[str, Any]]]:
        """Returns (state, first round, cumulative bits, previous rows)."""
        if self.out.exists() and not self.out.is_dir():
            raise FileExistsError(f"--out {self.out} names a file; --out must be a directory (a new or empty one "
                                  f"for a new run, a run directory with --resume)")
        has_checkpoint = (self.checkpoint_dir / STATE_FILE).exists()
        if self.resume and not has_checkpoint and self._run_files():
            raise CheckpointError(
                f"{self.out} has no checkpoint to resume (the run stopped before its first round was saved): run "
                f"again without --resume into a fresh --out, or delete {self.out} and run again"
            )
        if self.resume:
            state, counters = load_checkpoint(self.checkpoint_dir)
            if counters.get("fingerprint") != self.fingerprint:
                raise CheckpointError(
                    f"checkpoint in {self.checkpoint_dir} belongs to another configuration "
                    f"(fingerprint {counters.get('fingerprint')} != {self.fingerprint}); it was left untouched"
                )
            state = self._restore_client_state(state)
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
        if has_checkpoint:
            raise FileExistsError(f"{self.out} already holds a run; use --resume to continue it, or another --out")
        if self.checkpoint_dir.exists() or self.metrics_path.exists():
            # Started but no round saved: nothing to resume, yet not ours to overwrite.
            raise FileExistsError(
                f"{self.out} holds a run that stopped before its first round was saved (no checkpoint, so "
                f"nothing to --resume); delete {self.out} and run again, or choose another --out"
            )
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.out / "config.toml", self.cfg.to_toml().encode())
        return self.server.init(), 0, 0.0, []

    def _run_files(self) -> bool:
        """Whether ``out`` holds anything a run writes (a run was started there)."""
        names = ("config.toml", "metrics.csv", "checkpoint", "events.log", "messages", "model.safetensors")
        return any((self.out / n).exists() for n in names)

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
        val = (float("nan"), float("nan"))
        if rows:
            acc, loss = float(rows[-1]["accuracy"]), float(rows[-1]["loss"])
            if "val_accuracy" in rows[-1]:
                val = (float(rows[-1]["val_accuracy"]), float(rows[-1]["val_loss"]))
        for rnd in range(start, cfg.experiment.rounds):
            t0 = time.perf_counter()
            result, traffic, counts, events = self._round(state, rnd)
            up_bits, down_bits = traffic["up_bits"], traffic["down_bits"]
            ledger = {k: v for k, v in traffic.items() if k in LEDGER_COLUMNS}
            participants = counts.pop("participants")
            state = result.state
            check_finite(state, rnd + 1)
            cum_bits += up_bits + down_bits
            last = rnd == cfg.experiment.rounds - 1
            if (rnd + 1) % cfg.experiment.eval_every == 0 or last:
                model = self.server.global_model(state)
                acc, loss = evaluate(model, self.fed.x_test, self.fed.y_test, device=self.device)
                if self.fed.x_val is not None:
                    val = evaluate(model, self.fed.x_val, self.fed.y_val, device=self.device)
            row: dict[str, Any] = {
                "round": rnd + 1, "accuracy": acc, "loss": loss,
                **({"val_accuracy": val[0], "val_loss": val[1]} if self.fed.x_val is not None else {}),
                "density": result.metrics.pop("density"),
                "up_bits": up_bits, "down_bits": down_bits, "cum_bits": cum_bits,
                "seconds": round(time.perf_counter() - t0, 3),
                **ledger,
                "participants": participants,
                **counts,
                **{k: _fmt(v) for k, v in result.metrics.items()},
            }
            rows.append(row)
            self._log_events(rnd + 1, events)
            self._save_messages(state, rnd + 1)
            self._write_rows(rows)
            save_checkpoint(self.checkpoint_dir, {**state, **self._client_state()}, {
                "rounds_done": rnd + 1, "cum_bits": cum_bits, "fingerprint": self.fingerprint,
            })
            if self.on_round:
                self.on_round(row)
        self.final_model = self._save_model(state)
        return rows

    def _round(self, state: dict[str, Any], rnd: int) -> tuple[Any, dict[str, int], dict[str, int], list[str]]:
        """One round, run again (``federation.on_too_few = "retry"``) while fewer than ``min_clients`` updates
        are valid. Returns (result, bits by column, client counts, events). Bits of every attempt count: they
        were sent. Raises TooFewClientsError when the round cannot be completed; nothing saved is touched."""
        fed = self.cfg.federation
        traffic = dict.fromkeys(["up_bits", "down_bits", *LEDGER_COLUMNS], 0)
        events: list[str] = []
        counts: dict[str, int] = {}
        for attempt in range(fed.max_retries + 1):
            participants = self.server.select_clients(rnd)
            faults = draw_faults(self.cfg, rnd, attempt, participants)
            down = self.server.downlink(state, rnd)
            uplinks: list[bytes] = []
            senders: list[int] = []
            tally = dict.fromkeys(["clients_failed", "clients_dropped", "clients_late", "clients_corrupted"], 0)
            for cid in participants:
                if faults.get(cid) == "drop":
                    tally["clients_dropped"] += 1
                    events.append(f"client {cid}: did not answer (injected drop)")
            answers = self.fit_clients(down, [c for c in participants if faults.get(c) != "drop"], rnd)
            for cid, up in answers.items():
                fault = faults.get(cid)
                if isinstance(up, ClientLost):
                    tally["clients_dropped"] += 1
                    events.append(f"client {cid}: did not answer ({up})")
                    continue
                if isinstance(up, ClientError):
                    tally["clients_failed"] += 1
                    events.append(f"client {cid}: {up}")
                    continue
                if fault == "late":
                    tally["clients_late"] += 1
                    events.append(f"client {cid}: answered after the deadline (injected straggler), ignored")
                    continue
                if fault is not None:  # "corrupt:<how>"
                    tally["clients_corrupted"] += 1
                    up = corrupt(up, fault.split(":", 1)[1], rnd, cid)
                uplinks.append(up)
                senders.append(cid)
            for key, bits in self._ledger(down, len(participants), uplinks).items():
                traffic[key] += bits
            traffic["up_bits"] += 8 * sum(len(u) for u in uplinks)
            traffic["down_bits"] += 8 * len(down) * len(participants)
            try:
                result = self.server.aggregate(state, uplinks, rnd)
                valid, why = int(result.metrics["clients_ok"]), ""
            except MessageError as err:  # not a single valid update
                result, valid, why = None, 0, f": {err}"
            if result is not None:  # "uplink i: why" -> "client <id>: rejected: why"
                for msg in result.rejected:
                    head, _, why = msg.partition(": ")
                    idx = int(head.split()[1]) if head.startswith("uplink ") else -1
                    events.append(f"client {senders[idx]}: upload rejected: {why}" if 0 <= idx < len(senders) else msg)
            counts = {"participants": len(participants), **tally, "retries": attempt}
            if result is not None and valid >= fed.min_clients:
                return result, traffic, counts, events
            events.append(f"attempt {attempt + 1}: {valid} valid client updates, fewer than "
                          f"federation.min_clients = {fed.min_clients}{why}")
            if fed.on_too_few == "stop":
                break
        self._log_events(rnd + 1, events)
        then = (f"the checkpoint of round {rnd} is intact: fix the cause and continue with --resume" if rnd else
                f"no round was saved, so there is nothing to --resume: fix the cause, delete {self.out} and run "
                f"again, or run into another --out")
        raise TooFewClientsError(
            f"round {rnd + 1}: fewer than federation.min_clients = {fed.min_clients} valid client updates after "
            f"{attempt + 1} attempt(s) (see {self.out / 'events.log'}); {then}"
        )

    def fit_clients(self, down: bytes, clients: list[int], rnd: int) -> dict[int, bytes | ClientError]:
        """Send the downlink to ``clients`` and collect their uploads (bytes), or the reason one has none:
        ClientError (it failed, e.g. diverged) or ClientLost (it never answered). In process here; a
        transport (Flower) overrides this and nothing else, so both runners make the same run directory."""
        answers: dict[int, bytes | ClientError] = {}
        for cid in clients:
            try:
                answers[cid] = self.client.fit(down, self.fed.clients[cid], cid)
            except ClientError as err:
                answers[cid] = err
        return answers

    def _ledger(self, down: bytes, receivers: int, uplinks: list[bytes]) -> dict[str, int]:
        """Bits by direction and part (docs/algorithm.md §9); an uplink that does not even frame counts as headers."""
        out = dict.fromkeys(LEDGER_COLUMNS, 0)
        for part, bits in message_bits(down, self.server.layouts).items():
            out[f"down_{part}_bits"] = bits * receivers
        for data in uplinks:
            try:
                parts = message_bits(data, self.server.layouts)
            except ValueError:  # malformed: the server rejects it; its bytes still crossed the wire
                parts = {"headers": 8 * len(data)}
            for part, bits in parts.items():
                out[f"up_{part}_bits"] += bits
        return out

    def _log_events(self, round_no: int, events: list[str]) -> None:
        """Why clients failed or were rejected (metrics.csv has the counts): one line each in events.log."""
        if events:
            with open(self.out / "events.log", "a") as f:
                f.writelines(f"round {round_no}: {e}\n" for e in events)

    def _save_messages(self, state: dict[str, Any], round_no: int) -> None:
        """pi (B->A message) and masks of every layer this round, for the heat maps (Fig. 3)."""
        if not hasattr(self.server, "support_messages"):
            return
        folder = self.out / "messages"
        folder.mkdir(exist_ok=True)
        path = folder / f"round_{round_no:04d}.safetensors"
        atomic_write_bytes(path, save_numpy(self.server.support_messages(state)))

    def _client_state(self) -> dict[str, Any]:
        """The client algorithm's private state to checkpoint (CLIENT_STATE_PREFIX), if it keeps any."""
        export = getattr(self.client, "export_state", None)
        return {} if export is None else {CLIENT_STATE_PREFIX + k: v for k, v in export().items()}

    def _restore_client_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Hand the checkpointed client state back to the client algorithm; returns the server state alone."""
        private = {k[len(CLIENT_STATE_PREFIX):]: v for k, v in state.items() if k.startswith(CLIENT_STATE_PREFIX)}
        if hasattr(self.client, "import_state"):
            try:
                self.client.import_state(private)
            except ValueError as err:
                raise CheckpointError(f"checkpoint in {self.checkpoint_dir}: {err}; left untouched") from None
        return {k: v for k, v in state.items() if not k.startswith(CLIENT_STATE_PREFIX)}

    def _save_model(self, state: dict[str, Any]) -> nn.Module:
        """Write model.safetensors; returns the global model (mean weights, pruned) in eval mode."""
        model = self.server.global_model(state).eval()
        # clone: tied parameters (sigma_mode = "client") must be separate tensors in a safetensors file
        tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        meta = {"model": self.cfg.model.name, "dataset": self.cfg.data.name, "algorithm": self.cfg.experiment.algorithm}
        if self.fed.dataset.input_norm is not None:  # so an export can take raw inputs (dturbo.export)
            meta["input_norm"] = json.dumps(self.fed.dataset.input_norm)
        atomic_write_bytes(self.out / "model.safetensors", save_torch(tensors, metadata=meta))
        return model


class ClientLost(ClientError):
    """A client did not answer at all (its node went away, a timeout): no upload, no reason from it."""


class TooFewClientsError(RuntimeError):
    """A round could not gather ``federation.min_clients`` valid client updates."""


class PoisonedStateError(RuntimeError):
    """The server state took a NaN or Inf; the run stops before it can be checkpointed."""


def check_finite(state: dict[str, Any], round_no: int) -> None:
    """Refuse to go on (and to checkpoint) with a NaN / Inf anywhere in the server state."""
    bad = [k for k, v in state.items() if np.asarray(v).dtype.kind == "f" and not np.all(np.isfinite(v))]
    if bad:
        kept = f"round {round_no - 1}'s is intact" if round_no > 1 else "no round was saved yet"
        raise PoisonedStateError(f"round {round_no}: the server state holds NaN/Inf in {', '.join(bad[:5])}; "
                                 f"stopping before the checkpoint is written ({kept})")


CORRUPTIONS = ("truncate", "garbage", "header_flip", "oversize", "wrong_kind")


def draw_faults(cfg: Config, rnd: int, attempt: int, participants: list[int]) -> dict[int, str]:
    """Injected faults of one round attempt (``[faults]``), a pure function of (seed, round, attempt): client id
    -> "drop" | "late" | "corrupt:<how>"; clients without a fault are absent."""
    f = cfg.faults
    if not (f.drop_prob or f.corrupt_prob or (f.deadline is not None and f.straggler_sigma)):
        return {}
    rng = np.random.default_rng([cfg.experiment.seed, rnd, attempt, 0xFA17])
    n = len(participants)
    u_drop, u_corrupt, how = rng.random(n), rng.random(n), rng.integers(0, len(CORRUPTIONS), n)
    slowdown = np.exp(f.straggler_sigma * rng.standard_normal(n))
    out = {}
    for i, cid in enumerate(participants):
        if u_drop[i] < f.drop_prob:
            out[cid] = "drop"
        elif f.deadline is not None and slowdown[i] > f.deadline:
            out[cid] = "late"
        elif u_corrupt[i] < f.corrupt_prob:
            out[cid] = f"corrupt:{CORRUPTIONS[how[i]]}"
    return out


def corrupt(data: bytes, how: str, rnd: int, cid: int) -> bytes:
    """A hostile or broken client's bytes, derived from a valid upload (seeded by round and client)."""
    rng = np.random.default_rng([rnd, cid, 0xBAD])
    if how == "truncate":
        return data[: int(rng.integers(0, len(data)))]
    if how == "garbage":
        return rng.integers(0, 256, len(data), dtype=np.uint8).tobytes()
    if how == "header_flip":
        buf = bytearray(data)
        buf[int(rng.integers(0, min(4, len(buf))))] ^= 1 << int(rng.integers(0, 8))  # magic, version, kind
        return bytes(buf)
    if how == "oversize":
        return data + bytes(4 * len(data))
    if how == "wrong_kind":
        kind, fields = decode_message(data)
        return encode_message("evil/" + kind, fields)
    raise ValueError(f"unknown corruption {how!r}")


def _fmt(v: float) -> float | str:
    return "" if isinstance(v, float) and math.isnan(v) else v
