"""A method defined outside dturbo: one module with its two halves, its config section and its spec, registered
from here, runs through dturbo.Experiment like a built-in one (dturbo.protocol, dturbo.algorithms.register).

The toy is signSGD with a majority-free mean: each client uploads the sign bits of its model update (one bit a
parameter), the server moves the global model by ``step`` times the mean of the signs."""

from __future__ import annotations

import csv
import tomllib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

import dturbo
from dturbo.algorithms import ALGORITHMS, AlgorithmSpec, register, unregister
from dturbo.algorithms.base import (
    client_generator,
    fields_dict,
    frame,
    need,
    pack_scalars,
    sample_uniform,
    unpack_scalars,
    upload_meta,
)
from dturbo.algorithms.registry import model_factory
from dturbo.codec import CodecError, decode_dense, decode_quantized, encode_dense, encode_quantized
from dturbo.config import Config, ConfigError
from dturbo.protocol import ClientAlgorithm, ClientData, MessageError, Rejection, RoundResult, ServerAlgorithm, State
from dturbo.settings import load_config

DOWN, UP = "signs/down", "signs/up"


class SignsConfig(BaseModel):
    """``[signs]``: the toy's own section."""

    model_config = ConfigDict(extra="forbid", strict=True)

    step: float = Field(0.01, gt=0, description="how far the global model moves along the mean sign")


def _flat(model: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().astype(np.float32)


def _load(model: nn.Module, theta: np.ndarray) -> None:
    at = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy(theta[at : at + p.numel()]).reshape(p.shape))
            at += p.numel()


class SignsServer(ServerAlgorithm):
    layouts = {DOWN: {"round": "header", "theta": "dense"}, UP: {"meta": "header", "signs": "quantized"}}

    def __init__(self, cfg: Config, factory: Any, total_samples: int) -> None:
        self.cfg, self.factory, self.total_samples = cfg, factory, total_samples

    def init(self) -> State:
        return {"theta": _flat(self.factory())}

    def select_clients(self, round_idx: int) -> list[int]:
        f = self.cfg.federation
        return sample_uniform(self.cfg.experiment.seed, round_idx, f.clients, f.clients_per_round)

    def downlink(self, state: State, round_idx: int) -> bytes:
        return frame(DOWN, {"round": pack_scalars([round_idx]), "theta": encode_dense(state["theta"], "float32")})

    def aggregate(self, state: State, uplinks: list[bytes], round_idx: int, senders: list[int] | None = None
                  ) -> RoundResult:
        theta = state["theta"]
        signs, rejected = [], []
        for i, data in enumerate(uplinks):
            try:
                fields = fields_dict(data, UP)
                upload_meta(fields, round_idx, self.total_samples)
                symbols, _, _ = decode_quantized(need(fields, "signs"), max_elements=theta.size)
                if symbols.size != theta.size:
                    raise MessageError(f"{symbols.size} signs for {theta.size} parameters")
            except (MessageError, CodecError) as err:
                rejected.append(Rejection(i, str(err)))
                continue
            signs.append(2.0 * symbols - 1.0)
        if not signs:
            raise MessageError("no valid client update this round")
        step = self.cfg.signs.step  # type: ignore[attr-defined]
        new = (theta + step * np.mean(signs, axis=0)).astype(np.float32)
        return RoundResult({"theta": new}, {"density": 1.0, "clients_ok": float(len(signs))}, rejected)

    def global_model(self, state: State) -> nn.Module:
        model = self.factory()
        _load(model, state["theta"])
        return model


class SignsClient(ClientAlgorithm):
    def __init__(self, cfg: Config, factory: Any) -> None:
        self.cfg, self.model = cfg, factory()

    def fit(self, downlink: bytes, data: ClientData, client_id: int) -> bytes:
        fields = fields_dict(downlink, DOWN)
        round_idx = int(unpack_scalars(need(fields, "round"), 1)[0])
        start = decode_dense(need(fields, "theta"))
        _load(self.model, start)
        self.model.eval()  # the mean weights: plain SGD on them
        opt = torch.optim.SGD(self.model.parameters(), lr=self.cfg.train.lr)
        gen = client_generator(self.cfg.experiment.seed, round_idx, client_id)
        for _ in range(self.cfg.train.local_steps):
            idx = torch.randint(len(data), (min(self.cfg.train.batch_size, len(data)),), generator=gen)
            opt.zero_grad()
            F.cross_entropy(self.model(data.x[idx]), data.y[idx]).backward()
            opt.step()
        signs = (_flat(self.model) > start).astype(np.int64)
        return frame(UP, {"meta": pack_scalars([round_idx, client_id, len(data)]), "signs": encode_quantized(signs, 2)})


SPEC = AlgorithmSpec("signs", SignsConfig, SignsServer, SignsClient, default_lr=0.05, label="signSGD (toy)")


@pytest.fixture
def signs() -> Iterator[AlgorithmSpec]:
    register(SPEC)
    try:
        yield SPEC
    finally:
        unregister("signs")


def _arrays(n: int = 240) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 12)).astype(np.float32)
    y = (x[:, :3].sum(1) > 0).astype(np.int64) + 2 * (x[:, 3] > 0)
    return x, y, x[:100], y[:100]


def test_a_registered_method_runs_end_to_end(tmp_path, signs):
    cfg = {"experiment": {"name": "toy", "seed": 0, "rounds": 2, "threads": 1, "algorithm": "signs"},
           "federation": {"clients": 3, "partition": "iid"}, "model": {"name": "mlp", "hidden": [8]},
           "train": {"local_steps": 3, "batch_size": 16}, "signs": {"step": 0.02}}
    res = dturbo.Experiment(cfg, data=_arrays(), out=tmp_path / "run", progress=False).run()
    assert [r["round"] for r in res.metrics] == [1, 2] and res.config.train.lr == 0.05
    params = sum(p.numel() for p in res.model.parameters())
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    # one bit a parameter per upload, plus the message's framing and meta
    up = float(rows[0]["up_bits"])
    assert 3 * params <= up <= 3 * (params + 600)
    saved = tomllib.loads((tmp_path / "run" / "config.toml").read_text())
    assert saved["signs"] == {"step": 0.02} and saved["experiment"]["algorithm"] == "signs"
    again = dturbo.Experiment(cfg, data=_arrays(), out=tmp_path / "again", progress=False).run()
    assert [r["accuracy"] for r in again.metrics] == [r["accuracy"] for r in res.metrics]
    # the run's model moved from the initial one, by at most the steps taken
    start = _flat(model_factory(res.config, (12,), 4)())
    moved = np.abs(_flat(res.model) - start)
    assert moved.max() > 0 and moved.max() <= 2 * 0.02 + 1e-6


def test_its_section_is_a_config_section_while_registered(signs):
    cfg = load_config({"experiment": {"algorithm": "signs"}})
    assert cfg.signs.step == 0.01 and list(cfg.to_dict())[-1] == "signs"  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=r"config key 'signs.stepp': unknown key \(did you mean 'signs.step'\?\)"):
        load_config({"signs": {"stepp": 1.0}})
    assert load_config({}, ["signs.step=0.5"]).signs.step == 0.5  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="taken"):
        register(SPEC)


def test_unregistered_it_is_gone():
    assert "signs" not in ALGORITHMS and "signs" not in dturbo.Config.model_fields
    with pytest.raises(ConfigError, match="unknown key"):
        load_config({"signs": {"step": 0.5}})
    with pytest.raises(ConfigError, match="Input should be 'dturbo', .* or 'feddst'"):
        load_config({"experiment": {"algorithm": "signs"}})
    assert list(load_config({}).to_dict()) == ["experiment", "data", "federation", "model", "train", "dturbo",
                                               "faults", "robust", "fedavg", "fedpaq", "dssm", "fedpm", "stc",
                                               "feddst"]
